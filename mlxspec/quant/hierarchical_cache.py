"""QuantSpec's hierarchical INT8/INT4 KV cache, shared by the 4-bit draft and the target.

Layout (one `HierarchicalKVCache` per attention layer; KIVI):

* keys are quantized per channel along the token axis, in groups of G tokens, and stored
  transposed, (B, kv_heads, head_dim, tokens), so that `mx.quantized_matmul(q, keys_t, s, b,
  transpose=False)` gives the scores directly from the packed codes;
* values are quantized per token along head_dim (groups of `value_group_size`), stored
  (B, kv_heads, tokens, head_dim), and the output is `mx.quantized_matmul(p, values, s, b,
  transpose=False)`;
* each quantized element has two 4-bit planes (see `kvquant.py`): the draft view reads the upper
  plane only (~INT4), the target view adds the lower plane (~INT8); on a GPU the target's
  product is the sum of two `mx.quantized_matmul` calls, never a dequantized copy of the cache;
  on the CPU in float32 a tile's codes are multiplied as floats with the scales factored out
  (`_float_product`), in half precision as one 8-bit call over the two planes interleaved on
  the fly (`kvquant.target_triple`) (`_route`);
* the most recent tokens live in a full-precision buffer. New keys/values land there.

The position rule. A query at position p reads keys [0, Q(p)) quantized and [Q(p), p] in full
precision, Q(p) = G * floor(max(0, p - (buffer_size - G)) / G): with the default buffer_size = 2G
the full-precision part of every query holds between G+1 and 2G tokens. It depends on the
position only, so a prompt prefilled in one chunk or many, a verify over k+1 tokens, or k+1
single-token steps see the same mix of precisions.

Steps and verifies: one computation per query row (exact in half precision too). The rows of a
forward of at most `SHARED_TILE_ROWS` rows (a step, a verify: at most MAX_NUM_DRAFT + 1 = 65) are
split into segments of equal Q(p); every segment is computed exactly as a single-token step at
one of its positions would be: the packed codes [0, Q) in tiles of `block_size` tokens aligned at
multiples of `block_size`, then the full-precision buffer [Q, end) in tiles starting at Q, with a
running (online) softmax in float32 across the tiles. A single step and a verify row thus sum the
same products in the same order; the verify row only has extra masked (exactly zero) columns at
the end, which change neither a maximum, nor a sum, nor a matmul on MLX's CPU kernels (tested).

Prefill chunks (more rows): `_shared_tile_attention`. Each tile of codes is reconstructed once
for the chunk and all rows that read it quantized take one float product per block of
`SHARED_ROW_BLOCK` rows, stopping at that block's largest Q (so most causally masked scores are
never computed); each group of G rows reads its full-precision window [Q, Q + buffer_size) as one
batched product. The same precisions per row, in another summation order (the same result to
float rounding; prefill is the same computation for `none` and `quantspec`, so their outputs
stay token-identical). MLX's CPU `quantized_matmul` reconstructs every code once per query row:
over a 2048-row chunk that made the per-row computation ~4x plain attention.
No L x context score matrix is ever built: at most (rows of a segment or a row block) x
`block_size`.

Storage grows linearly. Codes live in a list of blocks of `block_size` tokens (the last one grows
in steps of 256 tokens up to `block_size`, copying at most one block); new codes are written into
place, never concatenated onto the whole store. The buffer is a preallocated array written in
place; when full it is compacted (only its live tokens, O(buffer) per compaction). So appends
cost amortised O(1) per token and memory never runs more than one block (and one buffer) ahead.
`allocations` and `bytes_copied` count what growth cost.

Codes are written as soon as a row needs them (`update_and_fetch` flushes codes up to Q of the
last new row); they are a deterministic function of the buffered keys, so writing them early
changes nothing. The buffer drops its oldest tokens only in `commit()` (tokens no future query
reads in full precision), which may only run when every cached token is committed: with
`auto_commit=True` (`make_hierarchical_cache`'s default) at the start of every forward - right
for prefill, plain steps and verifies - and `draft_view(caches)` switches it off while a draft
appends speculative tokens. `trim` may go back to any offset whose queries still find their
full-precision tokens (offset >= buffer start + buffer_size - G); codes of trimmed positions are
forgotten (q_len drops to Q(offset)).

Plugging into mlx-lm: `update_and_fetch(k, v)` returns a `HierarchicalKV` handle in place of each
of the (keys, values) arrays, and `install_attention_adapter(model)` replaces the module-global
`scaled_dot_product_attention` of the model's own module (e.g. `mlx_lm.models.llama`) by a thin
wrapper that sends `HierarchicalKV` operands to `hierarchical_attention` and everything else,
unchanged, to mlx-lm's function. `cache.view` ("target" or "draft", or the `draft_view(caches)`
context manager) selects the planes the attention reads. Hybrid models (recurrent layers next to
attention layers) keep their `ArraysCache` layers; only the attention layers' `KVCache`s are
replaced (`make_hierarchical_cache`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import (
    CacheList,
    KVCache,
    _BaseCache,
    make_prompt_cache,
)

from ..errors import MlxspecError
from .kvquant import (
    BITS,
    PER_WORD,
    SUPPORTED_GROUP_SIZES,
    TwoPlane,
    dequantize_two_plane,
    quantize_two_plane,
    view_codes,
)

VIEWS = ("target", "draft")
BLOCK_SIZE = 4096  # tokens per store block = key columns per attention tile
GROWTH_STEP = 256  # the last block grows in steps of this many tokens
# Forwards of more rows than this (prefill chunks) take `_shared_tile_attention`; fewer (a
# step, a verify of at most MAX_NUM_DRAFT + 1 = 65 rows) the per-row computation that a verify
# shares bit for bit with single-token steps.
SHARED_TILE_ROWS = 128
SHARED_ROW_BLOCK = 256  # rows of a chunk that share one product per tile of codes
_NEG = float(mx.finfo(mx.float32).min)


def quantize_keys(keys: mx.array, group_size: int) -> TwoPlane:
    """Keys (B, H, T, D), T a multiple of G -> planes of the transposed keys (B, H, D, T)."""
    return quantize_two_plane(keys.swapaxes(-1, -2), group_size)


def quantize_values(values: mx.array, group_size: int) -> TwoPlane:
    """Values (B, H, T, D) -> planes along head_dim (per token). A head_dim that is not a
    multiple of the group size (e.g. 16 in tiny test models) is zero-padded to one: MLX's 4-bit
    kernels only take groups of 32, 64 or 128; the padding enters the group's min/max."""
    pad = -values.shape[-1] % group_size
    if pad:
        values = mx.pad(values, [(0, 0)] * (values.ndim - 1) + [(0, pad)])
    return quantize_two_plane(values, group_size)


def default_value_group_size(head_dim: int) -> int:
    """64 where head_dim allows it (as mlx-lm's QuantizedKVCache), else 32 (padding if needed)."""
    return 64 if head_dim % 64 == 0 else 32


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclass
class _Block:
    """Codes of `block_size` consecutive tokens (capacity `cap`, grown in steps)."""

    keys: TwoPlane  # (B, H, D, cap / 8) codes, (B, H, D, cap / G) scales / minima
    values: TwoPlane  # (B, H, cap, Dv / 8) codes, (B, H, cap, Dv / gv)
    cap: int

    def nbytes(self) -> int:
        return sum(a.nbytes for a in (*self.keys, *self.values))

    def key_tile(self, a: int, b: int, g: int) -> TwoPlane:
        """Tokens [a, b) of this block (block-local, multiples of G)."""
        return TwoPlane(self.keys.upper[..., a // PER_WORD : b // PER_WORD],
                        self.keys.lower[..., a // PER_WORD : b // PER_WORD],
                        self.keys.scales[..., a // g : b // g], self.keys.mins[..., a // g : b // g])

    def value_tile(self, a: int, b: int) -> TwoPlane:
        return TwoPlane(*(x[..., a:b, :] for x in self.values))


def _alloc_block(like_k: TwoPlane, like_v: TwoPlane, cap: int, g: int) -> _Block:
    """Zero codes for `cap` tokens, shaped like the given code blocks."""
    ku, _, ks, _ = like_k
    vu, _, vs, _ = like_v
    lead_k, lead_v = ku.shape[:-1], vu.shape[:-2]
    keys = TwoPlane(mx.zeros((*lead_k, cap // PER_WORD), mx.uint32),
                    mx.zeros((*lead_k, cap // PER_WORD), mx.uint32),
                    mx.zeros((*lead_k, cap // g), ks.dtype), mx.zeros((*lead_k, cap // g), ks.dtype))
    values = TwoPlane(mx.zeros((*lead_v, cap, vu.shape[-1]), mx.uint32),
                      mx.zeros((*lead_v, cap, vu.shape[-1]), mx.uint32),
                      mx.zeros((*lead_v, cap, vs.shape[-1]), vs.dtype),
                      mx.zeros((*lead_v, cap, vs.shape[-1]), vs.dtype))
    return _Block(keys, values, cap)


class HierarchicalKVCache(_BaseCache):
    """One layer's hierarchical KV cache (see the module docstring)."""

    def __init__(self, group_size: int = 64, buffer_size: int | None = None,
                 value_group_size: int | None = None, auto_commit: bool = False,
                 block_size: int = BLOCK_SIZE):
        if group_size not in SUPPORTED_GROUP_SIZES:
            raise ValueError(f"group_size must be one of {SUPPORTED_GROUP_SIZES}, got {group_size}")
        buffer_size = 2 * group_size if buffer_size is None else int(buffer_size)
        if buffer_size < 2 * group_size:
            raise ValueError(f"buffer_size must be >= 2 * group_size = {2 * group_size}, "
                             f"got {buffer_size}")
        if block_size % GROWTH_STEP or block_size < GROWTH_STEP:
            raise ValueError(f"block_size must be a multiple of {GROWTH_STEP}, got {block_size}")
        self.group_size = group_size
        self.buffer_size = buffer_size
        self.value_group_size = value_group_size
        self.auto_commit = auto_commit
        self.block_size = block_size
        self.view = "target"
        self.offset = 0
        self.q_len = 0  # tokens whose codes are stored (a multiple of G)
        self.buf_start = 0  # first position held in full precision (a multiple of G)
        self._buf_base = 0  # position of buffer slot 0
        self._buf_k: mx.array | None = None  # (B, H, capacity, D), written in place
        self._buf_v: mx.array | None = None
        self.blocks: list[_Block] = []
        self.allocations = 0  # arrays (re)allocated to grow or compact
        self.bytes_copied = 0  # bytes those reallocations copied
        self.split_forwards = 0  # forwards whose rows read different quantized prefixes

    # -- the position rule
    @property
    def min_recent(self) -> int:
        """Tokens every query sees in full precision at least (buffer_size - G)."""
        return self.buffer_size - self.group_size

    def quantized_before(self, position: int) -> int:
        """Q(p): how many of the first tokens a query at `position` reads quantized."""
        g = self.group_size
        return g * (max(0, position - self.min_recent) // g)

    # -- the full-precision buffer
    @property
    def buf_k(self) -> mx.array | None:
        """The buffered keys (B, H, offset - buf_start, D)."""
        if self._buf_k is None:
            return None
        return self._buf_k[..., self.buf_start - self._buf_base : self.offset - self._buf_base, :]

    @property
    def buf_v(self) -> mx.array | None:
        if self._buf_v is None:
            return None
        return self._buf_v[..., self.buf_start - self._buf_base : self.offset - self._buf_base, :]

    @property
    def buffer_len(self) -> int:
        """Tokens held in full precision."""
        return self.offset - self.buf_start

    def _rebuffer(self, keys: mx.array, values: mx.array, extra: int) -> None:
        """Move the live buffer to slot 0 of fresh arrays with room for `extra` more tokens."""
        live = self.offset - self.buf_start
        cap = _round_up(live + extra + self.buffer_size, 64)
        b, h = keys.shape[:2]
        new_k = mx.zeros((b, h, cap, keys.shape[-1]), keys.dtype)
        new_v = mx.zeros((b, h, cap, values.shape[-1]), values.dtype)
        if live and self._buf_k is not None:
            new_k[..., :live, :] = self.buf_k
            new_v[..., :live, :] = self.buf_v
            self.bytes_copied += (new_k[..., :live, :].nbytes + new_v[..., :live, :].nbytes)
        self._buf_k, self._buf_v, self._buf_base = new_k, new_v, self.buf_start
        self.allocations += 2

    # -- the packed store
    def _ensure_capacity(self, tokens: int, kq: TwoPlane, vq: TwoPlane) -> None:
        """Blocks for the codes of `tokens` tokens. Only the last block grows (doubling, in steps
        of 256 tokens, up to `block_size`): growth copies at most one block."""
        bs = self.block_size
        while True:
            i = len(self.blocks) - 1
            if i >= 0 and min(bs, tokens - i * bs) > self.blocks[-1].cap:
                old = self.blocks[-1]
                need = min(bs, tokens - i * bs)
                cap = min(bs, max(_round_up(need, GROWTH_STEP), 2 * old.cap))
                new = _alloc_block(kq, vq, cap, self.group_size)
                used = max(0, min(self.q_len - i * bs, old.cap))
                if used:
                    _copy_codes(new, old, 0, used, self.group_size)
                    self.bytes_copied += old.nbytes() * used // old.cap
                self.blocks[-1] = new
                self.allocations += 8
                continue
            if len(self.blocks) * bs >= tokens:
                return
            need = min(bs, tokens - len(self.blocks) * bs)
            self.blocks.append(_alloc_block(kq, vq, min(bs, _round_up(need, GROWTH_STEP)),
                                            self.group_size))
            self.allocations += 8

    def _flush_codes(self, to: int) -> None:
        """Store the codes of positions [q_len, to) (from the buffer)."""
        if to <= self.q_len:
            return
        a, b = self.q_len - self._buf_base, to - self._buf_base
        kq = quantize_keys(self._buf_k[..., a:b, :], self.group_size)
        vq = quantize_values(self._buf_v[..., a:b, :], self.value_group_size)
        self._ensure_capacity(to, kq, vq)
        bs, pos = self.block_size, self.q_len
        while pos < to:
            i, lo = divmod(pos, bs)
            hi = min(bs, to - i * bs)
            src = (pos - self.q_len, pos - self.q_len + hi - lo)
            _write_codes(self.blocks[i], lo, hi, kq, vq, src, self.group_size)
            pos = i * bs + hi
        self.q_len = to

    # -- mlx-lm cache protocol
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[HierarchicalKV, HierarchicalKV]:
        """Append the new rows to the buffer; returns (kv, kv) - one `HierarchicalKV` handle in
        both slots, since mlx-lm's attention unpacks `keys, values = ...` and passes both on."""
        if self.auto_commit:
            self.commit()
        if self.value_group_size is None:
            self.value_group_size = default_value_group_size(values.shape[-1])
        n = keys.shape[-2]
        start = self.offset
        if self._buf_k is None or start + n - self._buf_base > self._buf_k.shape[-2]:
            self._rebuffer(keys, values, n)
        s = start - self._buf_base
        self._buf_k[..., s : s + n, :] = keys
        self._buf_v[..., s : s + n, :] = values
        self.offset += n
        self._flush_codes(self.quantized_before(self.offset - 1))
        kv = HierarchicalKV(self, start, n, self.view)
        self.split_forwards += len(kv.segments) > 1
        return kv, kv

    def commit(self) -> int:
        """Declare every cached token committed: drop from the buffer the tokens no future query
        reads in full precision (their codes are stored). Returns how many were dropped."""
        if self._buf_k is None:
            return 0
        to = self.quantized_before(self.offset)
        self._flush_codes(to)
        dropped = max(0, to - self.buf_start)
        self.buf_start += dropped
        # A long prefill chunk left a big buffer behind: compact it.
        live = self.offset - self.buf_start
        if self._buf_k.shape[-2] > 2 * (live + self.buffer_size) + 64:
            self._rebuffer(self._buf_k, self._buf_v, 0)
        return dropped

    def is_trimmable(self) -> bool:
        return True

    def trimmable(self) -> int:
        """How many tokens `trim` can remove now (the next query must find its full-precision
        tokens in the buffer: offset >= buf_start + buffer_size - G)."""
        floor = self.buf_start + self.min_recent if self.buf_start else 0
        return max(0, self.offset - floor)

    def trim(self, n: int) -> int:
        n = max(0, min(n, self.trimmable()))
        if n:
            self.offset -= n
            self.q_len = min(self.q_len, max(self.buf_start, self.quantized_before(self.offset)))
        return n

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self._buf_k is None

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if window_size is not None:
            raise MlxspecError("the hierarchical KV cache has no sliding-window support")
        if N == 1:
            return None
        if return_array:
            return create_causal_mask(N, self.offset)
        return "causal"

    # -- the stored codes as whole arrays (tests, accounting, serialisation)
    def _codes(self, upto: int | None = None) -> tuple[TwoPlane, TwoPlane] | tuple[None, None]:
        upto = self.q_len if upto is None else upto
        if not upto:
            return None, None
        g, bs = self.group_size, self.block_size
        ks, vs = [], []
        for i, blk in enumerate(self.blocks):
            n = min(bs, upto - i * bs)
            if n <= 0:
                break
            ks.append(blk.key_tile(0, n, g))
            vs.append(blk.value_tile(0, n))
        def cat(parts, axis):
            return (TwoPlane(*(mx.concatenate(x, axis=axis) for x in zip(*parts)))
                       if len(parts) > 1 else parts[0])
        return cat(ks, -1), cat(vs, -2)

    @property
    def keys_q(self) -> TwoPlane | None:
        return self._codes()[0]

    @property
    def values_q(self) -> TwoPlane | None:
        return self._codes()[1]

    @property
    def state(self):
        """[buffered keys, buffered values] and, per block in use, the 4 key and 4 value code
        arrays of its stored tokens: views, not a concatenation (the engine evaluates the state
        after every prefill chunk, so copying the whole store there would cost a prefill
        quadratic in its chunk count)."""
        if self._buf_k is None:
            return []
        arrays = [self.buf_k, self.buf_v]
        g, bs = self.group_size, self.block_size
        for i, blk in enumerate(self.blocks):
            n = min(bs, self.q_len - i * bs)
            if n <= 0:
                break
            arrays += list(blk.key_tile(0, n, g)) + list(blk.value_tile(0, n))
        return arrays

    @state.setter
    def state(self, v):
        # mlx-lm's `from_state` sets the state before the meta state: restore once both are in.
        self._pending_state = list(v)
        if hasattr(self, "block_size"):
            self._restore_state()

    def _restore_state(self) -> None:
        v = self._pending_state
        del self._pending_state
        self.allocations = getattr(self, "allocations", 0)
        self.bytes_copied = getattr(self, "bytes_copied", 0)
        self.split_forwards = getattr(self, "split_forwards", 0)
        self._buf_base = self.buf_start
        self._buf_k, self._buf_v = (v[0], v[1]) if v else (None, None)
        self._buf_base = self.buf_start
        self.blocks = []
        q_len, self.q_len = self.q_len, 0
        if len(v) > 2:
            # Groups of 8 code arrays (one per block; a state saved as one group of all the
            # codes reads the same way), written into blocks of this cache's block_size.
            groups = [(TwoPlane(*v[i : i + 4]), TwoPlane(*v[i + 4 : i + 8]))
                      for i in range(2, len(v), 8)]
            self._ensure_capacity(q_len, *groups[0])
            pos, bs = 0, self.block_size
            for kq, vq in groups:
                n, src = vq.upper.shape[-2], 0
                while src < n:
                    i, lo = divmod(pos, bs)
                    hi = min(bs, lo + n - src)
                    _write_codes(self.blocks[i], lo, hi, kq, vq, (src, src + hi - lo),
                                 self.group_size)
                    pos, src = pos + hi - lo, src + hi - lo
        self.q_len = q_len

    @property
    def meta_state(self):
        return tuple(map(str, (self.offset, self.q_len, self.buf_start, self.group_size,
                               self.buffer_size, self.value_group_size or 0,
                               int(self.auto_commit), self.block_size)))

    @meta_state.setter
    def meta_state(self, v):
        offset, q_len, buf_start, g, b, gv, auto, bs = map(int, v)
        self.offset, self.q_len, self.buf_start = offset, q_len, buf_start
        self.group_size, self.buffer_size, self.block_size = g, b, bs
        self.value_group_size, self.auto_commit, self.view = gv or None, bool(auto), "target"
        if hasattr(self, "_pending_state"):
            self._restore_state()

    @property
    def nbytes(self) -> int:
        """Bytes allocated: code blocks (both planes, scales, minima) and the buffer."""
        return sum(self.nbytes_by_part().values())

    def nbytes_by_part(self, used: bool = False) -> dict[str, int]:
        """Bytes by part: allocated (the last block and the buffer with their free room), or
        with `used` only what is held (the codes of q_len tokens, the live buffer)."""
        planes = ([q for q in self._codes() if q is not None] if used
                  else [q for blk in self.blocks for q in (blk.keys, blk.values)])
        buffer = (() if self._buf_k is None
                  else (self.buf_k, self.buf_v) if used else (self._buf_k, self._buf_v))
        return {"upper_plane": sum(q.upper.nbytes for q in planes),
                "lower_plane": sum(q.lower.nbytes for q in planes),
                "scales": sum(q.scales.nbytes + q.mins.nbytes for q in planes),
                "buffer": sum(b.nbytes for b in buffer)}

    def dequantized(self, view: str | None = None) -> tuple[mx.array, mx.array]:
        """The cache (keys, values), (B, H, offset, D): the codes of [0, buf_start) in `view`'s
        planes ("target": both, "draft": upper) and the buffer in full precision. The rows a
        query at position p reads are [:Q(p)] from here only if Q(p) == buf_start (commit)."""
        planes = 1 if (view or self.view) == "draft" else 2
        ks, vs = [], []
        if self.buf_start:
            kq, vq = self._codes(self.buf_start)
            ks.append(dequantize_two_plane(kq, self.group_size, planes).swapaxes(-1, -2))
            v = dequantize_two_plane(vq, self.value_group_size, planes)
            vs.append(v[..., : self._buf_v.shape[-1]])
        if self._buf_k is not None:
            ks.append(self.buf_k)
            vs.append(self.buf_v)
        return mx.concatenate(ks, axis=-2), mx.concatenate(vs, axis=-2)


def _write_codes(blk: _Block, lo: int, hi: int, kq: TwoPlane, vq: TwoPlane,
                 src: tuple[int, int], g: int) -> None:
    """Block tokens [lo, hi) <- tokens src[0]:src[1] of the code arrays (kq, vq)."""
    a, b = src
    for dst, s in zip(blk.keys[:2], kq[:2]):
        dst[..., lo // PER_WORD : hi // PER_WORD] = s[..., a // PER_WORD : b // PER_WORD]
    for dst, s in zip(blk.keys[2:], kq[2:]):
        dst[..., lo // g : hi // g] = s[..., a // g : b // g]
    for dst, s in zip(blk.values, vq):
        dst[..., lo:hi, :] = s[..., a:b, :]


def _copy_codes(new: _Block, old: _Block, lo: int, hi: int, g: int) -> None:
    _write_codes(new, lo, hi, old.keys, old.values, (lo, hi), g)


@dataclass
class HierarchicalKV:
    """What `HierarchicalKVCache.update_and_fetch` returns to the attention layer: the layer's
    code blocks and buffer as they are now, and the positions of the new rows
    (start .. start + num - 1)."""

    cache: HierarchicalKVCache
    start: int
    num: int
    view: str
    segments: list = field(default_factory=list)

    def __post_init__(self):
        c = self.cache
        self.blocks = list(c.blocks)
        self.q_len, self.block_size = c.q_len, c.block_size
        self.buf_k_all, self.buf_v_all, self.buf_base = c._buf_k, c._buf_v, c._buf_base
        self.buf_start = c.buf_start
        self.group_size, self.value_group_size = c.group_size, c.value_group_size
        self.buffer_size = c.buffer_size
        if (c.quantized_before(self.start) < self.buf_start
                or c.quantized_before(self.start + self.num - 1) > self.q_len):
            raise RuntimeError("hierarchical KV cache: a query's full-precision tokens are gone "
                               "(trimmed below the committed part?)")
        # Rows of equal Q(p): (first row, end row, Q). Q steps by G every G positions past
        # min_recent, so the segments follow from the positions without a loop over rows.
        i = 0
        while i < self.num:
            quantized = c.quantized_before(self.start + i)
            # the first position whose Q is larger: min_recent + quantized + G
            j = min(self.num, max(i + 1, c.min_recent + quantized + self.group_size - self.start))
            self.segments.append((i, j, quantized))
            i = j

    @property
    def buf_k(self) -> mx.array:
        return self.buf_k_all[..., self.buf_start - self.buf_base : self.start + self.num - self.buf_base, :]

    @property
    def shape(self):  # so that generic code that only inspects shapes does not break
        b, h, _, d = self.buf_k_all.shape
        return (b, h, self.start + self.num, d)


def _qmm(x, triple, group_size):
    """x @ packed codes (transpose=False); 4-bit planes or the 8-bit target triple, told apart
    by the codes' width against the groups (N = groups x group_size codes in N * bits / 32
    words). MLX's CUDA backend (0.32) has no transpose=False kernel for these shapes: there
    the codes are dequantized first (every view, the draft's and the target's, the same way,
    so quantspec stays token-identical to `none` on this cache)."""
    w, scales, _ = triple
    bits = 32 * w.shape[-1] // (scales.shape[-1] * group_size)
    if dequantize_codes():
        return x @ mx.dequantize(*triple, group_size=group_size, bits=bits).astype(x.dtype)
    return mx.quantized_matmul(x, *triple, transpose=False, group_size=group_size, bits=bits)


@functools.cache
def dequantize_codes() -> bool:
    """Whether `_qmm` dequantizes (MLX's CUDA backend; MLXSPEC_DEQUANTIZE_KV=1 forces it)."""
    forced = os.environ.get("MLXSPEC_DEQUANTIZE_KV", "")
    if forced:
        return forced != "0"
    from ..backend import device_name

    return device_name() == "cuda"


def _expand_kv(a):
    """(B, H, ...) -> (B, H, 1, ...) to broadcast over the query heads of a GQA group."""
    return mx.expand_dims(a, 2)


def _heads_as_rows(x: mx.array, w: mx.array) -> mx.array:
    """x (B, n_kv, rep, rows, K) @ w (B, n_kv, K, N): one product per KV head."""
    B, n_kv, rep, rows, K = x.shape
    return (x.reshape(B, n_kv, rep * rows, K) @ w).reshape(B, n_kv, rep, rows, -1)


def _route(dtype: mx.Dtype) -> str:
    """How a tile's codes are multiplied: "floats" on the CPU in float32 (`_float_product`);
    "eight", one 8-bit packed product over the two planes interleaved, on the CPU in half
    precision, where a verify row must equal the single step bit for bit and OpenBLAS rounds
    a product of few rows and one of many differently (float32 tolerates that, as mlx-lm's own
    cache does; tested both ways); "planes", one 4-bit packed product per plane, on a GPU
    (DESIGN.md section 5: the fewest bytes)."""
    if mx.default_device() != mx.cpu:
        return "planes"
    return "floats" if dtype == mx.float32 else "eight"


def _exp_parts(a: mx.array, b: mx.array) -> tuple[mx.array, mx.array]:
    # exp(x) = 2^f 2^n, n = round(x log2 e), f in [-1/2, 1/2]: 2^f by Cephes' exp2f polynomial,
    # 2^n as float32 bits (0 below x = -87, where exp is denormal: masked scores give exact 0)
    x = a - b
    y = mx.maximum(x, -87.0) * 1.4426950408889634
    n = mx.floor(y + 0.5)
    f = y - n
    p = 1.535336188319500e-4
    for c in (1.339887440266574e-3, 9.618437357674640e-3, 5.550332471162809e-2,
              2.402264791363012e-1, 6.931472028550421e-1, 1.0):
        p = p * f + c
    return p, mx.where(x < -87.0, 0, mx.left_shift(n.astype(mx.int32) + 127, 23))


_exp_parts_compiled = mx.compile(_exp_parts, shapeless=True)


def _exp_difference(a: mx.array, b: mx.array) -> mx.array:
    """exp(a - b) in float32 for the softmax. On the CPU a compiled elementwise kernel (within
    1.2e-7 relative of `mx.exp` over [-87, 0]) and the bits of 2^n cast outside it (`view`
    cannot be compiled shapeless): MLX's CPU `exp` costs ~25 ns an element on x86, 1.5 ms for
    the 7 x 3,968 scores of one layer of the coder 0.5B at 4k, a third of its attention; this
    0.6 ms. Elementwise and deterministic, so a verify row still equals the single step.
    Elsewhere `mx.exp`."""
    if mx.default_device() != mx.cpu:
        return mx.exp(a - b)
    p, bits = _exp_parts_compiled(a, b)
    return p * bits.view(mx.float32)


def _float_product(x: mx.array, planes: TwoPlane, group_size: int, two: bool) -> mx.array:
    """x (..., rows, K) @ one tile's codes (..., K, N), quantized in groups along N, in float32
    with the scales factored out: per group g, (x * step[:, g]) @ codes[:, g] + x @ bias[:, g].
    The codes are converted to floats (exact integers) and never scaled, so no broadcasting
    dequantization runs over the tile. On the CPU this takes ~half the time of MLX's 8-bit
    `quantized_matmul` (keys at 4,096 tokens: 0.45-0.6 against 0.75-1.3 ms a layer; values
    0.45 against 0.7-0.8), whose per-code reconstruction is scalar. A verify row equals the
    single step's to float32 rounding (BLAS products of few and many rows; see `_route`)."""
    codes, step, bias = view_codes(planes, two)
    *lead, k, n = codes.shape
    groups = n // group_size
    x = x.astype(mx.float32)
    tiles = codes.reshape(*lead, k, groups, group_size).swapaxes(-3, -2).astype(mx.float32)
    scaled = mx.expand_dims(x, -3) * mx.expand_dims(step.swapaxes(-1, -2), -2).astype(mx.float32)
    out = (scaled @ tiles).swapaxes(-3, -2)  # (..., rows, groups, G)
    out = out + mx.expand_dims(x @ bias.astype(mx.float32), -1)
    return out.reshape(*out.shape[:-2], n)


def _planes_product(x: mx.array, planes: TwoPlane, group_size: int, two: bool) -> mx.array:
    """x (B, n_kv, rep, rows, K) times the codes (B, n_kv, K, N) of one tile, in the view's
    planes (the draft's upper plane, the target's two), by `_route`. The query heads of a GQA
    group go in as rows of one product per KV head (not as a broadcast batch, which makes MLX
    copy the codes for every head: ~17% slower on the CPU, the same bits, each row being
    computed on its own)."""
    B, n_kv, rep, rows, K = x.shape
    x = x.reshape(B, n_kv, rep * rows, K)
    route = _route(x.dtype)
    if route == "floats":
        out = _float_product(x, planes, group_size, two)
    elif not two:
        out = _qmm(x, planes.upper_triple(), group_size)
    elif route == "eight":  # MLX's CPU 4-bit kernel costs 3x its 8-bit one per code
        out = _qmm(x, planes.target_triple(), group_size)
    else:
        out = (_qmm(x, planes.upper_triple(), group_size)
               + _qmm(x, planes.lower_triple(), group_size))
    return out.reshape(B, n_kv, rep, rows, -1)


def _segment_attention(q: mx.array, kv: HierarchicalKV, quantized: int, first: int,
                       causal: bool, mask: mx.array | None) -> mx.array:
    """Attention of query rows q (B, n_kv, rep, rows, D) at positions first.. over the codes of
    [0, quantized) and the buffer [quantized, end), tile by tile with a running softmax."""
    rows, dtype = q.shape[-2], q.dtype
    g, gv, bs = kv.group_size, kv.value_group_size, kv.block_size
    two = kv.view != "draft"
    head_dim = kv.buf_v_all.shape[-1]
    end = kv.start + kv.num
    tiles = [("q", a, min(a + bs, quantized)) for a in range(0, quantized, bs)]
    tiles += [("b", a, min(a + bs, end)) for a in range(quantized, end, bs)]
    m_run = l_run = o_run = None
    for kind, a, b in tiles:
        if kind == "q":
            blk = kv.blocks[a // bs]
            lo, hi = a - (a // bs) * bs, b - (a // bs) * bs
            s = _planes_product(q, blk.key_tile(lo, hi, g), g, two)
        else:
            keys = kv.buf_k_all[..., a - kv.buf_base : b - kv.buf_base, :]
            s = _heads_as_rows(q, keys.swapaxes(-1, -2))
        s = s.astype(mx.float32)
        if mask is not None:
            tile = mask[..., a:b]
            s = mx.where(tile, s, _NEG) if tile.dtype == mx.bool_ else mx.maximum(s + tile, _NEG)
        elif causal and b - 1 > first:
            visible = mx.arange(a, b)[None, :] <= mx.arange(first, first + rows)[:, None]
            s = mx.where(visible, s, _NEG)
        t_max = s.max(axis=-1, keepdims=True)
        if m_run is None:
            m_new = t_max
        else:
            m_new = mx.maximum(m_run, t_max)
        p = _exp_difference(s, m_new)
        if kind == "q":
            blk = kv.blocks[a // bs]
            o = _planes_product(p.astype(dtype), blk.value_tile(lo, hi), gv, two)
            if o.shape[-1] != head_dim:  # head_dim padded to the value group size
                o = o[..., :head_dim]
        else:
            values = kv.buf_v_all[..., a - kv.buf_base : b - kv.buf_base, :]
            o = _heads_as_rows(p.astype(dtype), values)
        o = o.astype(mx.float32)
        if m_run is None:
            l_run, o_run = p.sum(axis=-1, keepdims=True), o
        else:
            corr = _exp_difference(m_run, m_new)
            l_run = l_run * corr + p.sum(axis=-1, keepdims=True)
            o_run = o_run * corr + o
        m_run = m_new
    return (o_run / l_run).astype(dtype)


def _dequantized(planes: TwoPlane, group_size: int, two: bool) -> mx.array:
    """One tile of codes reconstructed in the view's planes (transient: see
    `_shared_tile_attention`), from the same affine triple the packed products read."""
    if two:
        return mx.dequantize(*planes.target_triple(), group_size=group_size, bits=8)
    return mx.dequantize(*planes.upper_triple(), group_size=group_size, bits=BITS)


def _shared_tile_attention(q: mx.array, kv: HierarchicalKV) -> mx.array:
    """Causal attention of many query rows (a prefill chunk) q (B, n_kv, rep, L, D).

    Every row at p reads the codes of [0, Q(p)) and the full-precision tokens [Q(p), p]. Rows
    are grouped by Q (G rows a group past min_recent; the chunk is padded to whole groups),
    and the groups are taken `SHARED_ROW_BLOCK` rows at a time:

    * full precision: the group with Q = jG reads the window [jG, jG + buffer_size) of the
      buffer, the same causal pattern in every group, so a block's groups are one batched
      product (rows x buffer_size, not rows x chunk);
    * codes: each tile of `block_size` tokens that any row reads quantized is reconstructed
      once for the chunk (a transient tile), and a block of rows takes one matrix product per
      tile, over the columns up to its largest Q only, the columns at or past a row's own Q
      masked. MLX's CPU `quantized_matmul` reconstructs every code once per query row
      (measured ~8x slower than the float product at 64+ rows), so reconstructing a tile once
      per chunk is far cheaper; a forward of few rows (a step, a verify) keeps the per-row
      computation on the packed codes. Stopping each block at its own Q also skips most of
      the causally masked scores, whose exponentials dominate attention on MLX's CPU backend.

    The running softmax goes over the window first (it always has a visible column), then the
    tiles. The rows get the same precisions as a single-token step, in another summation order
    (float rounding apart, the same result)."""
    B, n_kv, rep, L, D = q.shape
    dtype = q.dtype
    g, gv, bs = kv.group_size, kv.value_group_size, kv.block_size
    two = kv.view != "draft"
    window, recent = kv.buffer_size, kv.buffer_size - kv.group_size
    head_dim = kv.buf_v_all.shape[-1]
    start, end = kv.start, kv.start + kv.num
    n0 = min(L, max(0, recent - start))  # positions < min_recent (Q = 0; the first chunk only)
    pre = _segment_attention(q[..., :n0, :], kv, 0, start, True, None) if n0 else None
    if n0 == L:
        return pre
    first = start + n0
    j0, j1 = (first - recent) // g, (end - 1 - recent) // g
    groups = j1 - j0 + 1
    front, back = first - (recent + j0 * g), recent + (j1 + 1) * g - end
    qg = q[..., n0:, :]
    if front or back:
        qg = mx.pad(qg, [(0, 0)] * 3 + [(front, back), (0, 0)])
    qg = qg.reshape(B, n_kv, rep, groups, g, D)

    # The full-precision windows [jG, jG + window), gathered from the buffer.
    lo, want = j0 * g, j1 * g + window
    hi = min(end, want)
    idx = (mx.arange(groups)[:, None] * g + mx.arange(window)[None, :]).reshape(-1)

    def windows(a: mx.array) -> mx.array:
        src = a[..., lo - kv.buf_base : hi - kv.buf_base, :]
        if hi < want:
            src = mx.pad(src, [(0, 0), (0, 0), (0, want - hi), (0, 0)])
        return mx.take(src, idx, axis=2).reshape(B, n_kv, 1, groups, window, a.shape[-1])

    win_k, win_v = windows(kv.buf_k_all), windows(kv.buf_v_all)
    visible = mx.arange(window)[None, :] <= (recent + mx.arange(g))[:, None]

    # The tiles of codes any row reads, reconstructed once: [a, min(a + bs, Q of the last row)).
    tiles = []
    for a in range(0, j1 * g, bs):
        b, off = min(a + bs, j1 * g), (a // bs) * bs
        blk = kv.blocks[a // bs]
        tiles.append((a, _dequantized(blk.key_tile(a - off, b - off, g), g, two),
                      _dequantized(blk.value_tile(a - off, b - off), gv, two)[..., :head_dim]))

    per, outs = max(1, SHARED_ROW_BLOCK // g), []
    for t0 in range(0, groups, per):
        t1 = min(groups, t0 + per)
        n = t1 - t0
        qb = qg[..., t0:t1, :, :]
        s = (qb @ win_k[..., t0:t1, :, :].swapaxes(-1, -2)).astype(mx.float32)
        s = mx.where(visible, s, _NEG)  # (B, n_kv, rep, n, g, window)
        m_run = s.max(axis=-1, keepdims=True)
        p = _exp_difference(s, m_run)
        l_run = p.sum(axis=-1, keepdims=True)
        o_run = (p.astype(dtype) @ win_v[..., t0:t1, :, :]).astype(mx.float32)
        rows = qb.reshape(B, n_kv, rep, n * g, D)
        top = (j0 + t1 - 1) * g  # the block's largest Q: its columns end there
        for a, k_t, v_t in tiles:
            if a >= top:
                break
            w = min(top - a, k_t.shape[-1])
            s = (rows @ _expand_kv(k_t[..., :w])).astype(mx.float32).reshape(B, n_kv, rep, n, g, w)
            if (j0 + t0) * g < a + w:  # a group's Q falls inside: mask the columns >= its Q
                bound = (mx.arange(j0 + t0, j0 + t1) * g)[:, None, None]
                s = mx.where(mx.arange(a, a + w)[None, None, :] < bound, s, _NEG)
            m_new = mx.maximum(m_run, s.max(axis=-1, keepdims=True))
            p = _exp_difference(s, m_new)
            o = p.astype(dtype).reshape(B, n_kv, rep, n * g, w) @ _expand_kv(v_t[..., :w, :])
            corr = _exp_difference(m_run, m_new)
            l_run = l_run * corr + p.sum(axis=-1, keepdims=True)
            o_run = o_run * corr + o.astype(mx.float32).reshape(B, n_kv, rep, n, g, head_dim)
            m_run = m_new
        outs.append((o_run / l_run).astype(dtype).reshape(B, n_kv, rep, n * g, head_dim))
    out = (mx.concatenate(outs, axis=-2) if len(outs) > 1 else outs[0])[..., front : front + L - n0, :]
    return out if pre is None else mx.concatenate([pre, out], axis=-2)


def hierarchical_attention(queries: mx.array, kv: HierarchicalKV, scale: float,
                           mask: Any = None) -> mx.array:
    """Attention of queries (B, n_heads, L, D) over the hierarchical cache in kv.view: row
    segments of equal Q(p), each as a single-token step would compute it (module docstring)."""
    B, n_heads, L, D = queries.shape
    if L != kv.num:
        raise ValueError(f"{L} queries for {kv.num} new cache rows")
    n_kv = kv.buf_k_all.shape[1]
    rep = n_heads // n_kv
    q = (queries * scale).reshape(B, n_kv, rep, L, D)
    causal, arr = False, None
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unsupported mask {mask!r}")
        causal = True
    elif mask is None:
        causal = L > 1
    else:
        arr = mask
        if arr.ndim == 4:  # (B or 1, heads or 1, L, total) -> split the heads into GQA groups
            per_head = arr.shape[1] == n_heads
            arr = arr.reshape(arr.shape[0], n_kv if per_head else 1, rep if per_head else 1,
                              arr.shape[2], -1)
    if arr is None and causal and L > SHARED_TILE_ROWS:
        return _shared_tile_attention(q, kv).reshape(B, n_heads, L, -1)
    outs = []
    for i, j, quantized in kv.segments:
        m = None
        if arr is not None:
            m = arr if arr.shape[-2] == 1 else arr[..., i:j, :]
        rows = q if (i, j) == (0, L) else q[..., i:j, :]
        outs.append(_segment_attention(rows, kv, quantized, kv.start + i, causal, m))
    out = mx.concatenate(outs, axis=-2) if len(outs) > 1 else outs[0]
    return out.reshape(B, n_heads, L, -1)


# ----------------------------------------------------------------------------- mlx-lm adapter

_ADAPTER_FLAG = "_mlxspec_hierarchical_adapter"


def _wrap_sdpa(original):
    sig = inspect.signature(original)

    def scaled_dot_product_attention(queries, keys, values, *args, **kwargs):
        if isinstance(keys, HierarchicalKV):
            # mlx-lm passes everything after the arrays by keyword: skip `bind` (~12 us a layer)
            a = kwargs if not args and "scale" in kwargs else sig.bind(
                queries, keys, values, *args, **kwargs).arguments
            if a.get("sinks") is not None:
                raise MlxspecError("the hierarchical KV cache does not support attention sinks")
            return hierarchical_attention(queries, keys, a["scale"], a.get("mask"))
        return original(queries, keys, values, *args, **kwargs)

    setattr(scaled_dot_product_attention, _ADAPTER_FLAG, True)
    scaled_dot_product_attention.__wrapped__ = original
    scaled_dot_product_attention.__doc__ = (
        "mlx-lm's scaled_dot_product_attention, plus the hierarchical KV cache (mlxspec).")
    return scaled_dot_product_attention


def install_attention_adapter(model) -> list[str]:
    """Make the attention layers of `model` accept a `HierarchicalKVCache`.

    Replaces `scaled_dot_product_attention` in the namespace of each module that defines one of
    the model's classes (e.g. `mlx_lm.models.qwen2`), once, by a wrapper that only intercepts
    `HierarchicalKV` operands. Returns the patched module names. Raises for model types whose
    attention does not go through that function.
    """
    model_type = getattr(getattr(model, "args", None), "model_type", None) or getattr(
        model, "model_type", None)
    modules = {}
    for _, m in model.named_modules():
        mod = sys.modules.get(type(m).__module__)
        if mod is not None and callable(getattr(mod, "scaled_dot_product_attention", None)):
            modules[mod.__name__] = mod
    if not modules:
        raise MlxspecError(
            f"model type {model_type!r}: its attention does not call mlx-lm's "
            "scaled_dot_product_attention, so the hierarchical KV cache cannot plug in")
    for mod in modules.values():
        fn = mod.scaled_dot_product_attention
        if not getattr(fn, _ADAPTER_FLAG, False):
            mod.scaled_dot_product_attention = _wrap_sdpa(fn)
    return sorted(modules)


def _leaves(cache) -> list:
    out = []
    for c in cache:
        if isinstance(c, CacheList):
            out.extend(_leaves(c.caches))
        else:
            out.append(c)
    return out


def _family(model) -> str:
    args = getattr(model, "args", None)
    return getattr(args, "model_type", None) or type(model).__module__.rsplit(".", 1)[-1]


def check_hierarchical_support(model) -> None:
    """Refuse, with the reason and the modes that work, a model the hierarchical cache cannot
    serve: sliding-window layers (their window already bounds the KV cache, and a
    `RotatingKVCache` overwrites slots in place), or no attention layer at all (pure recurrent
    models such as Mamba have no KV cache to quantize)."""
    family = _family(model)
    kinds = {type(c).__name__ for c in _leaves(make_prompt_cache(model))}
    if "RotatingKVCache" in kinds:
        raise MlxspecError(
            f"quantspec (and kv='hierarchical') cannot run {family}: it has sliding-window "
            "attention layers (RotatingKVCache), whose window already bounds the KV cache, so a "
            "quantized cache saves little there and cannot replace a rotating window. "
            "Modes that are exact on it: none, ngram, draft, lookahead, auto")
    if "KVCache" not in kinds:
        raise MlxspecError(
            f"quantspec (and kv='hierarchical') cannot run {family}: it has no attention layers "
            f"(only {', '.join(sorted(kinds))} recurrent state), so there is no KV cache to "
            "quantize. Modes that are exact on it: none, ngram, draft, auto")
    other = kinds - {"KVCache", "ArraysCache", "MambaCache"}
    if other:
        raise MlxspecError(
            f"quantspec (and kv='hierarchical') cannot run {family}: its {', '.join(sorted(other))} "
            "layers are not plain KVCache or recurrent layers. Modes that are exact on it: none, "
            "ngram, draft, auto")


def _replace_kv(c, make):
    if isinstance(c, CacheList):
        c.caches = tuple(_replace_kv(x, make) for x in c.caches)
        return c
    if type(c) is KVCache:
        return make()
    return c  # recurrent state (ArraysCache): kept


def make_hierarchical_cache(model, group_size: int = 64, buffer_size: int | None = None,
                            value_group_size: int | None = None, auto_commit: bool = True,
                            block_size: int = BLOCK_SIZE) -> list:
    """The model's own cache (`make_prompt_cache`) with every attention layer's `KVCache`
    replaced by a `HierarchicalKVCache`, recurrent layers (`ArraysCache`, also inside a
    `CacheList`) kept; the attention adapter installed.

    Target view, auto-commit on: usable as-is for prefill, plain decoding and verification; wrap
    draft forwards in `draft_view(cache)` (and restore recurrent states afterwards)."""
    check_hierarchical_support(model)
    install_attention_adapter(model)
    return [_replace_kv(c, lambda: HierarchicalKVCache(group_size, buffer_size, value_group_size,
                                                       auto_commit, block_size))
            for c in make_prompt_cache(model)]


def make_reference_cache(model, group_size: int = 64, buffer_size: int | None = None,
                         value_group_size: int | None = None, **kwargs) -> list:
    """The cache for plain (non-speculative) decoding with the hierarchical cache, target view:
    the lossless reference `quantspec` is token-identical to at temperature 0 (the same cache
    `QuantSpecProposer.make_target_cache` makes)."""
    return make_hierarchical_cache(model, group_size, buffer_size, value_group_size,
                                   auto_commit=True, **kwargs)


def hierarchical_layers(caches) -> list[HierarchicalKVCache]:
    return [c for c in _leaves(caches) if isinstance(c, HierarchicalKVCache)]


def commit(caches) -> None:
    for c in hierarchical_layers(caches):
        c.commit()


@contextlib.contextmanager
def draft_view(caches, view: str = "draft") -> Iterator[None]:
    """Inside the block, every hierarchical cache in `caches` reads the draft (upper-plane) view
    (or `view`) and does not auto-commit (what the draft appends is speculative). Commits once
    on entry: the block must start with a cache of committed tokens only (as a proposer's
    `propose` does)."""
    saved = [(c, c.view, c.auto_commit) for c in hierarchical_layers(caches)]
    for c, _, _ in saved:
        c.commit()
        c.view, c.auto_commit = view, False
    try:
        yield
    finally:
        for c, v, a in saved:
            c.view, c.auto_commit = v, a


def set_view(caches, view: str) -> None:
    if view not in VIEWS:
        raise ValueError(f"view must be one of {VIEWS}, got {view!r}")
    for c in hierarchical_layers(caches):
        c.view = view
