"""The KV cache of a batch of rows of different lengths (the batched step's, `batch_step.py`).

`RaggedKVCache`, one per layer, stores row b's tokens left-aligned in slots [0, length_b) of a
(B, heads, capacity, head_dim) buffer. A forward writes row b's L new entries at slots
length_b .. length_b + L - 1 (a scatter), RoPE rotates each row from its own offset (an array
of lengths: `mx.fast.rope` takes one offset per batch row), and the mask lets query j of row b
see slots <= length_b + j only. Rolling back a row is lowering its length: whatever lies beyond
is masked and later overwritten, so there is no compaction to do.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from ..errors import MlxspecError

# Every layer of a batch holds the same lengths, so a step's position arrays (RoPE offsets, the
# slots its new entries go to) are made once for all layers, not once per layer (on a small
# model a step is mostly per-op cost). Keyed by the lengths themselves, so that caches of
# other batches (a draft's) simply miss.
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

    # -- what mlx-lm's attention asks of a cache
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

    def is_trimmable(self) -> bool:
        return True

    @property
    def state(self):
        return [] if self.keys is None else (self.keys, self.values)

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    # -- rows
    def _reserve(self, size: int) -> None:
        if self.keys is None:
            return
        have = self.keys.shape[2]
        if size <= have:
            return
        grow = ((size - have + self.step - 1) // self.step) * self.step

        def pad(a):
            b, h, _, d = a.shape
            return mx.concatenate([a, mx.zeros((b, h, grow, d), a.dtype)], axis=2)

        self.keys, self.values = pad(self.keys), pad(self.values)

    def trim_rows(self, drop: list[int]) -> None:
        """Remove the last drop[b] tokens of row b."""
        self.lengths = [x - d for x, d in zip(self.lengths, drop)]

    def put_row(self, b: int, c: KVCache) -> None:
        """Row b (an empty slot, or b == the batch size: a new one) now holds what the
        single-request cache `c` holds. Written in place: a slot costs one row's copy, a new
        slot (the batch grows past its widest) one copy of the buffer."""
        n = c.offset if c.keys is not None else 0
        if b == len(self.lengths):
            self.lengths.append(0)
            if self.keys is not None:
                self.keys, self.values = self._grown(self.keys, 1), self._grown(self.values, 1)
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
        """A single-request cache over row b's entries (views of the batch's buffers, for
        `put_row` into another batch: not to be updated in place)."""
        n = self.lengths[b]
        out = KVCache()
        if n:
            out.keys, out.values = self.keys[b : b + 1, :, :n, :], self.values[b : b + 1, :, :n, :]
            out.offset = n
        return out

    def take_row(self, b: int) -> KVCache:
        """A single-request cache holding row b (its own copy, evaluated: no view keeps the
        batch's buffer from being updated in place); the slot is left empty."""
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
            self.keys, self.values = self._grown(self.keys, n), self._grown(self.values, n)

    def add_row(self, c: KVCache) -> None:
        """Append a row holding what the single-request cache `c` holds."""
        self.put_row(len(self.lengths), c)

    def remove_row(self, b: int) -> KVCache:
        """Take row b out of the batch; returns it as a single-request cache."""
        out = self.take_row(b)
        self.keep_rows([i for i in range(len(self.lengths)) if i != b])
        return out

    @staticmethod
    def _grown(a: mx.array, rows: int) -> mx.array:
        b, h, cap, d = a.shape
        return mx.concatenate([a, mx.zeros((rows, h, cap, d), a.dtype)])


def plain_attention(cache: list) -> bool:
    """Whether a single-request cache can join the batch (every layer a plain KVCache)."""
    return bool(cache) and all(type(c) is KVCache for c in cache)
