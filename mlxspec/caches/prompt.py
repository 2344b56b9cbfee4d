"""A request's prompt cache: a target cache and the tokens it holds, reused by the next prompt
that shares a prefix with them (the engine's, the server's per request, a chat's per turn)."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from . import Checkpoint, leaves, restore, trim_exact
from . import checkpoint as checkpoint_states
from .shift import reusable_chunks, shift_chunks


def common_prefix_len(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@dataclass
class PromptCache:
    """A target cache and its tokens. Recurrent layers cannot be trimmed, so a checkpoint at the
    end of the last prefill is restored by a prompt sharing at least that prefix."""

    cache: list | None = None
    tokens: list[int] = field(default_factory=list)
    kind: str = ""
    checkpoint: tuple[int, Checkpoint] | None = None

    def nbytes(self) -> int:
        """The cache's bytes, plus the recurrent states its checkpoint keeps alive."""
        held = sum(getattr(c, "nbytes", 0) for c in leaves(self.cache or []))
        if self.checkpoint is not None:
            held += self.checkpoint[1].nbytes()
        return held

    def reuse_prefix(self, tokens: list[int], kind: str, model=None, min_chunk: int = 0) -> int:
        """Bring the cache back to its longest reusable common prefix with `tokens`, followed
        (with `model` and `min_chunk` > 0) by its runs of at least `min_chunk` tokens moved to
        where `tokens` has them (`shift.py`); the length it holds (0: nothing reusable)."""
        if self.cache is None or self.kind != kind:
            return 0
        keep = common_prefix_len(self.tokens, tokens)
        chunks = reusable_chunks(self.tokens, tokens, keep, min_chunk) if min_chunk else []
        if chunks and model is not None:
            length = shift_chunks(model, self.cache, keep, chunks)
            self.tokens, self.checkpoint = tokens[:length], None
            return length
        if keep and trim_exact(self.cache, len(self.tokens) - keep):
            self.tokens = self.tokens[:keep]
            return keep
        if self.checkpoint is not None:
            at, ckpt = self.checkpoint
            if 0 < at <= keep and restore(self.cache, ckpt, len(self.tokens), at):
                self.tokens = self.tokens[:at]
                return at
        return 0

    def hold(self, cache: list, tokens: list[int], kind: str | None = None) -> None:
        """It holds `cache`, which holds `tokens` (a fresh cache of `kind`: no checkpoint), or
        its cache back from a batch."""
        self.cache, self.tokens = cache, list(tokens)
        if kind is not None:
            self.kind, self.checkpoint = kind, None

    def fed(self, tokens: list[int]) -> None:
        """Its cache took `tokens` after those it held (a prefill's chunk)."""
        self.tokens = self.tokens + list(tokens)

    def take(self) -> list:
        """The cache, handed over (to a batch, which gives it back by `hold`)."""
        cache, self.cache = self.cache, None
        return cache

    def drop(self) -> None:
        """Forget the cache: its state is unknown (a failed step or prefill)."""
        self.cache, self.tokens, self.checkpoint = None, [], None

    def remember(self) -> None:
        """Checkpoint the recurrent states at the current end (after a prefill)."""
        ckpt = checkpoint_states(self.cache or [])
        self.checkpoint = (len(self.tokens), ckpt) if ckpt is not None else None


class PromptCacheStore:
    """A few `PromptCache`s (one per recent conversation or file), least recently used out
    first, bounded by bytes and count: a request takes the one sharing the longest prefix."""

    def __init__(self, max_bytes: int = 2 << 30, max_entries: int = 8):
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self.entries: list[PromptCache] = []  # least recently used first

    def nbytes(self) -> int:
        return sum(pc.nbytes() for pc in self.entries)

    def take(self, tokens: list[int], min_chunk: int = 0) -> PromptCache:
        """The entry sharing the longest prefix with `tokens` (with `min_chunk` > 0: the most
        tokens reusable, shifted chunks counted), taken over where it is mostly reused."""
        best, best_len, best_prefix = None, 0, 0
        for pc in self.entries:
            prefix = n = common_prefix_len(pc.tokens, tokens)
            if min_chunk:
                n += sum(c[2] for c in reusable_chunks(pc.tokens, tokens, n, min_chunk))
            if n > best_len:
                best, best_len, best_prefix = pc, n, prefix
        if best is None:
            return PromptCache()
        if best_len * 2 >= len(best.tokens):
            # Mostly shared (the next keystroke, the next chat turn): take it over.
            self.entries.remove(best)
            return best
        # A short shared prefix (a common system prompt): copy that prefix, keep the entry.
        return copy_prefix(best, best_prefix) or PromptCache()

    def put(self, pc: PromptCache | None) -> None:
        if pc is None or pc.cache is None or not pc.tokens:
            return
        self.entries = [e for e in self.entries if e is not pc]
        self.entries.append(pc)
        while len(self.entries) > self.max_entries:
            self.entries.pop(0)
        self.shrink(self.max_bytes)

    def shrink(self, max_bytes: int) -> None:
        """Give memory back: the least recently used entries out until the rest hold at most
        `max_bytes`."""
        while self.entries and self.nbytes() > max_bytes:
            self.entries.pop(0)

    def clear(self) -> None:
        self.entries.clear()


def copy_prefix(pc: PromptCache, n: int) -> PromptCache | None:
    """A new PromptCache holding the first n tokens of `pc` (plain KV caches only)."""
    if n <= 0 or not pc.cache or any(type(c) is not KVCache or c.keys is None for c in pc.cache):
        return None
    caches = []
    for c in pc.cache:
        new = KVCache()
        new.keys, new.values, new.offset = c.keys[..., :n, :], c.values[..., :n, :], n
        caches.append(new)
    mx.eval([(c.keys, c.values) for c in caches])
    return PromptCache(caches, pc.tokens[:n], pc.kind)
