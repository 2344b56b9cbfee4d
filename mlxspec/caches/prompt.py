"""A request's prompt cache: a target cache and the tokens it holds, reused by the next prompt
that shares a prefix with them (the engine's, the server's per request, a chat's per turn)."""

from __future__ import annotations

from dataclasses import dataclass, field

from . import Checkpoint, leaves, restore, trim_exact
from . import checkpoint as checkpoint_states


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class PromptCache:
    """A target cache and the tokens it holds; reused when a prompt shares a prefix with them.

    Recurrent layers cannot be trimmed back, so for them a checkpoint is kept at the end of the
    last prefill (the prompt but its last token): a prompt that shares at least that prefix
    (the same request again, the next chat turn) restores it instead of starting over."""

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

    def reuse_prefix(self, tokens: list[int], kind: str) -> int:
        """Bring the cache back to its longest reusable common prefix with `tokens` and return
        that length; 0 means nothing is reusable (no cache, another kind, or a cache that
        cannot go back so far)."""
        if self.cache is None or self.kind != kind:
            return 0
        keep = common_prefix_len(self.tokens, tokens)
        if keep and trim_exact(self.cache, len(self.tokens) - keep):
            self.tokens = self.tokens[:keep]
            return keep
        if self.checkpoint is not None:
            at, ckpt = self.checkpoint
            if 0 < at <= keep and restore(self.cache, ckpt, len(self.tokens), at):
                self.tokens = self.tokens[:at]
                return at
        return 0

    def remember(self) -> None:
        """Checkpoint the recurrent states at the current end (after a prefill)."""
        ckpt = checkpoint_states(self.cache or [])
        self.checkpoint = (len(self.tokens), ckpt) if ckpt is not None else None
