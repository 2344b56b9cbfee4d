"""The KV cache of a batch of rows of different lengths (`batch_step.py`): row b left-aligned
in slots [0, length_b), one offset per row for RoPE and the mask, rollback by lowering a
row's length. See docs/HOW_IT_WORKS.md, "Several requests".
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from ..errors import MlxspecError

# A step's position arrays, made once for all layers (on a small model a step is mostly
# per-op cost); keyed by the lengths, so that other batches' caches (a draft's) simply miss.
_positions: dict = {}


def _remembered(name: str, key: tuple, make) -> mx.array:
    """make(), or what it made last time for the same key."""
    hit = _positions.get(name)
    if hit is None or hit[0] != key:
        hit = _positions[name] = (key, make())
    return hit[1]


def _offset_array(lengths: list[int]) -> mx.array:
    return _remembered("offset", tuple(lengths), lambda: mx.array(lengths, mx.int32))


def _slots_array(lengths: list[int], n: int, shape: tuple) -> mx.array:
    """Where each row's n new entries go, broadcast to the (B, heads, n, dim) of `shape`."""
    def make():
        slots = (_offset_array(lengths)[:, None] + mx.arange(n)[None])[:, None, :, None]
        return mx.broadcast_to(slots, shape)

    return _remembered("slots", (tuple(lengths), n, shape), make)


class RaggedKVCache:
    """One attention layer's keys and values for a batch of rows of different lengths."""

    step = 256

    def __init__(self):
        self.keys = self.values = None  # (B, heads, capacity, head_dim)
        self.lengths: list[int] = []

    @property
    def offset(self) -> mx.array:
        return _offset_array(self.lengths)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if window_size is not None:
            raise MlxspecError("a sliding-window layer cannot run in the batched step")
        longest = max(self.lengths)
        if not return_array and all(x == longest for x in self.lengths):
            return None if N == 1 else "causal"  # no stale slot is visible: as KVCache does
        span = longest + N
        queries = self.offset[:, None] + mx.arange(N)[None]  # (B, N) positions
        return (mx.arange(span)[None, None] <= queries[:, :, None])[:, None]  # (B, 1, N, S)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        n = keys.shape[2]
        longest = max(self.lengths)
        if self.keys is None:  # every row empty so far (one-token prompts)
            b, h, _, d = keys.shape
            cap = ((longest + n + self.step - 1) // self.step) * self.step
            self.keys = mx.zeros((b, h, cap, d), keys.dtype)
            self.values = mx.zeros((b, h, cap, values.shape[3]), values.dtype)
        self._reserve(longest + n)
        if all(x == longest for x in self.lengths):
            self.keys[..., longest : longest + n, :] = keys
            self.values[..., longest : longest + n, :] = values
        else:
            self.keys = mx.put_along_axis(
                self.keys, _slots_array(self.lengths, n, keys.shape), keys, axis=2)
            self.values = mx.put_along_axis(
                self.values, _slots_array(self.lengths, n, values.shape), values, axis=2)
        self.lengths = [x + n for x in self.lengths]
        end = longest + n
        return self.keys[..., :end, :], self.values[..., :end, :]

    @property
    def state(self):
        return [] if self.keys is None else (self.keys, self.values)

    def _reserve(self, size: int) -> None:
        have = self.keys.shape[2]
        if size <= have:
            return
        grow = ((size - have + self.step - 1) // self.step) * self.step
        self.keys, self.values = (
            mx.concatenate([a, mx.zeros((*a.shape[:2], grow, a.shape[3]), a.dtype)], axis=2)
            for a in (self.keys, self.values))

    def trim_rows(self, drop: list[int]) -> None:
        """Remove the last drop[b] tokens of row b."""
        self.lengths = [x - d for x, d in zip(self.lengths, drop)]

    def put_row(self, b: int, c: KVCache) -> None:
        """Row b (an empty slot, or b == the batch size: a new one) now holds what `c` holds;
        in place: a slot costs one row's copy, a new one a copy of the buffer."""
        n = c.offset if c.keys is not None else 0
        if b == len(self.lengths):
            self.add_empty_rows(1)
        if not n:
            self.lengths[b] = 0
            return
        k, v = c.keys[..., :n, :], c.values[..., :n, :]
        if self.keys is None:  # the rows so far are all empty
            cap = ((n + self.step - 1) // self.step + 1) * self.step
            self.keys = mx.zeros((len(self.lengths), k.shape[1], cap, k.shape[3]), k.dtype)
            self.values = mx.zeros((len(self.lengths), v.shape[1], cap, v.shape[3]), v.dtype)
        self._reserve(n + 1)
        self.keys[b : b + 1, :, :n, :] = k
        self.values[b : b + 1, :, :n, :] = v
        self.lengths[b] = n

    def row_view(self, b: int) -> KVCache:
        """A single-request cache viewing row b's entries (for `put_row` elsewhere only)."""
        n = self.lengths[b]
        out = KVCache()
        if n:
            out.keys, out.values = self.keys[b : b + 1, :, :n, :], self.values[b : b + 1, :, :n, :]
            out.offset = n
        return out

    def take_row(self, b: int) -> KVCache:
        """Row b as a single-request cache, the slot left empty; a copy, evaluated, so that no
        view keeps the batch's buffer from being updated in place."""
        out = self.row_view(b)
        if out.offset:
            out.keys, out.values = mx.contiguous(out.keys), mx.contiguous(out.values)
            mx.eval(out.keys, out.values)
        self.lengths[b] = 0
        return out

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only these rows, in this order (a copy of what they hold)."""
        if rows and self.keys is not None:
            idx = mx.array(rows, mx.int32)
            self.keys, self.values = self.keys[idx], self.values[idx]
        elif not rows:
            self.keys = self.values = None
        self.lengths = [self.lengths[b] for b in rows]

    def add_empty_rows(self, n: int) -> None:
        """n more rows, empty: one copy of the buffers for all of them."""
        self.lengths.extend([0] * n)
        if self.keys is not None:
            self.keys, self.values = (mx.concatenate([a, mx.zeros((n, *a.shape[1:]), a.dtype)])
                                      for a in (self.keys, self.values))

    def add_row(self, c: KVCache) -> None:
        """Append a row holding what the single-request cache `c` holds."""
        self.put_row(len(self.lengths), c)

    def remove_row(self, b: int) -> KVCache:
        """Take row b out of the batch; returns it as a single-request cache."""
        out = self.take_row(b)
        self.keep_rows([i for i in range(len(self.lengths)) if i != b])
        return out


def plain_attention(cache: list) -> bool:
    """Whether a single-request cache can join the batch (every layer a plain KVCache). Not
    yet windows (a rotating buffer per row) nor recurrent states (a checkpoint per row to roll
    back): their requests keep a batch of one each, exact on their own caches."""
    return bool(cache) and all(type(c) is KVCache for c in cache)
