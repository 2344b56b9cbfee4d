"""Exact rollback and prefix reuse for every cache mlx-lm makes, or a clear refusal.

A speculative step feeds the target tokens that may be rejected; afterwards the cache must hold
exactly the committed tokens, as if the rejected ones had never been seen. mlx-lm's
`trim_prompt_cache` silently trims nothing when one layer cannot trim, so nothing here uses it.

* `KVCache`, `QuantizedKVCache`, `ChunkedKVCache`, QuantSpec's hierarchical cache: `trim`.
* Sliding-window layers: mlx-lm's `RotatingKVCache` overwrites the oldest slot in place, so once
  the window has wrapped a rejected token has already destroyed a key that is needed again.
  `make_cache` gives those layers a `WindowedKVCache` instead: the same attention (each query
  sees the last `window` positions) over a buffer that keeps `margin` extra positions, so the
  last `margin` tokens can always be trimmed. Memory: window + margin + a growth step.
* Recurrent layers (`ArraysCache`, `MambaCache`: Gated DeltaNet, Mamba, short convolutions):
  a state cannot be trimmed back, only replaced. `checkpoint` keeps references to the states
  before the speculative tokens (MLX arrays are immutable and these layers assign new state
  arrays, so this copies nothing); `rollback` restores them, trims the attention layers to the
  same point and re-feeds the accepted tokens in one forward. Cost: one extra forward over the
  accepted tokens on a step that rejected something (measured in docs/PERFORMANCE.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    RotatingKVCache,
    _BaseCache,
    make_prompt_cache,
)

from ..errors import MlxspecError

# Speculative tokens a step may feed beyond the committed ones (k + 1 with k <= MAX_NUM_DRAFT,
# or a tree's nodes): how far back a sliding-window cache must always be able to trim.
WINDOW_MARGIN = 80


# ----------------------------------------------------------------------------- sliding window


class WindowedKVCache(_BaseCache):
    """Sliding-window attention that can be trimmed by up to `margin` tokens at any time.

    Slot j of the buffer holds position `start + j`; positions before `start` were dropped once
    no query could see them, even after a rollback of `margin` tokens."""

    step = 256

    def __init__(self, window: int, margin: int = WINDOW_MARGIN):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window, self.margin = window, margin
        self.keys = self.values = None
        self.offset = 0  # absolute position of the next token
        self.start = 0  # absolute position of slot 0

    def _drop(self, n: int) -> int:
        """Leading slots the next `update_and_fetch` of `n` tokens drops (0: the buffer has
        room). The masks are built before that update, so they ask this same rule."""
        used = self.offset - self.start
        if self.keys is not None and used + n <= self.keys.shape[2]:
            return 0
        # Keep what the first new query or a later rollback of `margin` tokens still needs.
        return max(0, self.offset - (self.window - 1) - self.margin - self.start)

    def _key_start(self, n: int) -> int:
        """The absolute position of the first key a forward of `n` new tokens attends."""
        return self.start + self._drop(n)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        n = keys.shape[2]
        used = self.offset - self.start
        if self.keys is None or used + n > self.keys.shape[2]:
            drop = self._drop(n)
            kept = used - drop
            size = ((kept + n + self.step - 1) // self.step + 1) * self.step
            b, h, _, dk = keys.shape

            def grow(old, new_dim, dtype):
                fresh = mx.zeros((b, h, size - kept, new_dim), dtype)
                if old is None or kept == 0:
                    return fresh
                return mx.concatenate([old[..., drop:used, :], fresh], axis=2)

            self.keys = grow(self.keys, dk, keys.dtype)
            self.values = grow(self.values, values.shape[3], values.dtype)
            self.start += drop
            used = kept
        self.keys[..., used : used + n, :] = keys
        self.values[..., used : used + n, :] = values
        self.offset += n
        end = self.offset - self.start
        return self.keys[..., :end, :], self.values[..., :end, :]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """The mask of a forward of `N` new tokens over the keys its update will return (the
        update may drop leading slots first: `_key_start`)."""
        window = window_size or self.window
        start = self._key_start(N)
        if start == 0 and self.offset + N <= window:
            if N == 1:
                return None
            if not return_array:
                return "causal"
        queries = mx.arange(self.offset, self.offset + N)[:, None]
        keys = mx.arange(start, self.offset + N)[None]
        return (keys <= queries) & (keys > queries - window)

    def tree_mask(self, ancestors: mx.array, depths: mx.array) -> mx.array:
        """The mask of a tree forward: node i (at position offset + depths[i]) sees the cached
        positions inside its window and its ancestors."""
        start = self._key_start(len(depths))
        positions = self.offset + depths
        cached = mx.arange(start, self.offset)
        keys = mx.concatenate([cached, positions]) if self.offset > start else positions
        visible = keys[None] > positions[:, None] - self.window
        committed = mx.ones((len(depths), self.offset - start), mx.bool_)
        base = mx.concatenate([committed, ancestors], axis=1) if self.offset > start else ancestors
        return base & visible

    def compact(self, start: int, keep: list[int], total: int) -> None:
        """After a tree step: keep tree entries `keep` (tree entries begin at position `start`)."""
        base = start - self.start
        src = mx.array(keep, mx.int32) + base
        n = len(keep)
        self.keys[..., base : base + n, :] = self.keys[..., src, :]
        self.values[..., base : base + n, :] = self.values[..., src, :]
        self.offset = start + n

    def trimmable(self) -> int:
        """How many tokens can be removed while every later query still finds its window."""
        if self.start == 0:
            return self.offset
        return max(0, self.offset - self.start - (self.window - 1))

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(n, self.trimmable())
        self.offset -= n
        return n

    def size(self) -> int:
        return min(self.offset, self.window)

    def empty(self) -> bool:
        return self.keys is None

    @property
    def state(self):
        end = self.offset - self.start
        if self.keys is None:
            return []
        return self.keys[..., :end, :], self.values[..., :end, :]

    @state.setter
    def state(self, v):
        self.keys, self.values = v

    @property
    def meta_state(self):
        return tuple(map(str, (self.window, self.margin, self.offset, self.start)))

    @meta_state.setter
    def meta_state(self, v):
        self.window, self.margin, self.offset, self.start = map(int, v)

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


# ----------------------------------------------------------------------------- making caches


def _replace_rotating(c):
    if isinstance(c, RotatingKVCache):
        if c.keep:
            raise MlxspecError(
                f"a sliding-window cache that keeps {c.keep} leading tokens cannot be rolled "
                "back exactly; use mode 'none'")
        return WindowedKVCache(c.max_size)
    if isinstance(c, CacheList):
        c.caches = tuple(_replace_rotating(x) for x in c.caches)
    return c


def make_cache(model) -> list:
    """mlx-lm's cache for `model`, with sliding-window layers made exactly trimmable."""
    return [_replace_rotating(c) for c in make_prompt_cache(model)]


def leaves(cache: list) -> list:
    """Every layer cache, with `CacheList`s (several caches per layer) flattened."""
    out = []
    for c in cache:
        if isinstance(c, CacheList):
            out.extend(leaves(list(c.caches)))
        else:
            out.append(c)
    return out


def is_recurrent(c) -> bool:
    return isinstance(c, ArraysCache)


def has_recurrent(cache: list) -> bool:
    return any(is_recurrent(c) for c in leaves(cache))


def family(model) -> str:
    args = getattr(model, "args", None)
    return getattr(args, "model_type", None) or type(model).__module__.rsplit(".", 1)[-1]


def offset(cache: list) -> int:
    """Tokens the cache holds (read from its first attention layer)."""
    for c in leaves(cache):
        if hasattr(c, "offset"):
            return int(c.offset)
    return -1  # only recurrent layers: no token count of their own


# ----------------------------------------------------------------------------- rollback


@dataclass
class Checkpoint:
    """The recurrent states before a speculative forward (None entries: attention layers)."""

    states: list

    def nbytes(self) -> int:
        return sum(a.nbytes for saved in self.states if saved is not None
                   for a in saved if a is not None)


def checkpoint(cache: list) -> Checkpoint | None:
    """What `rollback` needs to undo the next forward; None when every layer can trim."""
    layers = leaves(cache)
    if not any(is_recurrent(c) for c in layers):
        return None
    return Checkpoint([list(c.cache) if is_recurrent(c) else None for c in layers])


def trim_exact(cache: list, n: int) -> bool:
    """Remove the last `n` tokens from every layer, or change nothing and return False."""
    if n <= 0:
        return True
    layers = leaves(cache)
    for c in layers:
        if is_recurrent(c) or not c.is_trimmable():
            return False
        if hasattr(c, "trimmable") and c.trimmable() < n:  # windowed, hierarchical
            return False
        if hasattr(c, "offset") and c.offset < n:
            return False
    for c in layers:
        if c.trim(n) != n:  # checked above: cannot happen; never leave a silent mismatch
            raise MlxspecError(f"{type(c).__name__} trimmed fewer than {n} tokens")
    return True


def rollback(model, cache: list, ckpt: Checkpoint | None, fed: list[int], keep: int) -> None:
    """The cache was fed `fed` since `ckpt` was taken; make it hold only `fed[:keep]`."""
    drop = len(fed) - keep
    if drop <= 0:
        return
    if ckpt is None:
        if not trim_exact(cache, drop):
            raise MlxspecError(f"cannot roll back {drop} tokens of this cache")
        return
    for c, saved in zip(leaves(cache), ckpt.states):
        if saved is not None:
            c.cache = list(saved)
        elif c.trim(len(fed)) != len(fed):
            raise MlxspecError(f"{type(c).__name__} could not roll back {len(fed)} tokens")
    if keep:  # lazily: the next forward evaluates it together with its own work
        model(mx.array(fed[:keep], mx.uint32)[None], cache=cache)


def restore(cache: list, ckpt: Checkpoint, tokens_now: int, tokens_then: int) -> bool:
    """Bring a cache holding `tokens_now` tokens back to the checkpoint taken when it held
    `tokens_then` (recurrent states replaced, attention layers trimmed); False (and nothing
    changed) when an attention layer cannot go back so far."""
    drop = tokens_now - tokens_then
    layers = leaves(cache)
    for c, saved in zip(layers, ckpt.states):
        if saved is None and (not c.is_trimmable() or getattr(c, "offset", drop) < drop or (
                hasattr(c, "trimmable") and c.trimmable() < drop)):
            return False
    for c, saved in zip(layers, ckpt.states):
        if saved is not None:
            c.cache = list(saved)
        elif c.trim(drop) != drop:
            raise MlxspecError(f"{type(c).__name__} could not be restored")
    return True


def check_tree_support(model, cache: list, mode: str) -> None:
    """Tree and lookahead steps feed branches side by side: a recurrent state would run through
    all of them in a row. Refused before generation, naming what works."""
    if has_recurrent(cache):
        raise MlxspecError(
            f"mode {mode!r} verifies token trees, which recurrent layers cannot do exactly: "
            f"{family(model)} has recurrent (ArraysCache) layers. Modes that are exact on it: "
            "none, ngram (without --tree), draft, auto")
