"""QuantSpec's hierarchical INT8/INT4 KV cache, shared by the 4-bit draft and the target.

Layout (one `HierarchicalKVCache` per layer; KIVI):

* keys are quantized per channel along the token axis, in groups of G tokens, and stored
  transposed, (B, kv_heads, head_dim, tokens), so that `mx.quantized_matmul(q, keys_t, s, b,
  transpose=False)` gives the scores directly from the packed codes;
* values are quantized per token along head_dim (groups of `value_group_size`), stored
  (B, kv_heads, tokens, head_dim), and the output is `mx.quantized_matmul(p, values, s, b,
  transpose=False)`;
* each quantized element has two 4-bit planes (see `kvquant.py`): the draft view reads the upper
  plane only (~INT4), the target view adds the lower plane (~INT8); the target's product is the
  sum of two `mx.quantized_matmul` calls, never a dequantized copy of the cache;
* the most recent tokens live in a full-precision buffer. New keys/values land there.

Which tokens a query sees quantized is a function of the query's *position* only:
a query at position p sees keys [0, Q(p)) quantized and [Q(p), p] in full precision, with
Q(p) = G * floor(max(0, p - (buffer_size - G)) / G). With the default buffer_size = 2G the
full-precision part of every query holds between G+1 and 2G tokens - the "flush the oldest G when
the buffer holds 2G" rule evaluated per token. Because it depends on the position only, a prompt
prefilled in one chunk or many, a verify over k+1 tokens, or k+1 single-token steps see exactly
the same mix of precisions: speculative decoding with this cache is token-identical (up to float
rounding of batched vs. single-row matmuls) to plain decoding with it. Within one forward over
several positions, the rows that need a group the store has not flushed yet get it quantized on
the fly (the same deterministic codes the later flush stores).

Physical flushes (moving groups from the buffer into the packed store) happen only in `commit()`,
which may only run when every token in the cache is committed. With `auto_commit=True` (the
default of `make_hierarchical_cache`) the cache commits at the start of every `update_and_fetch`:
that is right for a prefill chunk, a plain decoding step and a verify forward (the cache then
holds committed tokens only; the new rows are not flushed before the next forward), and wrong
only while a draft appends speculative tokens one forward after another - so `draft_view(caches)`
switches auto-commit off for its duration. Speculative tokens therefore only ever live in the
buffer and rollback is a trim of the buffer; `trim` refuses (trims less) to cut below what a
flushed group requires (offset must stay >= quantized_tokens + buffer_size - G).

Plugging into mlx-lm: `update_and_fetch(k, v)` returns a `HierarchicalKV` handle in place of each
of the (keys, values) arrays, and `install_attention_adapter(model)` replaces the module-global
`scaled_dot_product_attention` of the model's own module (e.g. `mlx_lm.models.llama`) by a thin
wrapper that sends `HierarchicalKV` operands to `hierarchical_attention` and everything else,
unchanged, to mlx-lm's function. The wrapper is installed once per module, is idempotent, and
does not change behaviour for any other cache. `cache.view` ("target" or "draft", or the
`draft_view(caches)` context manager) selects the planes the attention reads.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import _BaseCache

from ..errors import MlxspecError
from .kvquant import (
    BITS,
    SUPPORTED_GROUP_SIZES,
    TwoPlane,
    concat_two_plane,
    dequantize_two_plane,
    lower_triple,
    quantize_two_plane,
)

VIEWS = ("target", "draft")
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


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


class HierarchicalKVCache(_BaseCache):
    """One layer's hierarchical KV cache (see the module docstring)."""

    def __init__(self, group_size: int = 64, buffer_size: int | None = None,
                 value_group_size: int | None = None, auto_commit: bool = False):
        if group_size not in SUPPORTED_GROUP_SIZES:
            raise ValueError(f"group_size must be one of {SUPPORTED_GROUP_SIZES}, got {group_size}")
        buffer_size = 2 * group_size if buffer_size is None else int(buffer_size)
        if buffer_size < 2 * group_size:
            raise ValueError(f"buffer_size must be >= 2 * group_size = {2 * group_size}, "
                             f"got {buffer_size}")
        self.group_size = group_size
        self.buffer_size = buffer_size
        self.value_group_size = value_group_size
        self.auto_commit = auto_commit
        self.view = "target"
        self.offset = 0
        self.q_len = 0  # tokens in the packed store (a multiple of G)
        self.keys_q: TwoPlane | None = None  # (B, H, D, q_len / 8) codes, (B, H, D, q_len / G) s/min
        self.values_q: TwoPlane | None = None  # (B, H, q_len, D / 8), (B, H, q_len, D / gv)
        self.buf_k: mx.array | None = None  # (B, H, offset - q_len, D)
        self.buf_v: mx.array | None = None

    # -- the position rule
    @property
    def min_recent(self) -> int:
        """Tokens every query sees in full precision at least (buffer_size - G)."""
        return self.buffer_size - self.group_size

    def quantized_before(self, position: int) -> int:
        """Q(p): how many of the first tokens a query at `position` reads quantized."""
        g = self.group_size
        return g * (max(0, position - self.min_recent) // g)

    # -- mlx-lm cache protocol
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[HierarchicalKV, HierarchicalKV]:
        """Append the new rows to the buffer; returns (kv, kv) - one `HierarchicalKV` handle in
        both slots, since mlx-lm's attention unpacks `keys, values = ...` and passes both on."""
        if self.auto_commit:
            self.commit()
        if self.value_group_size is None:
            self.value_group_size = default_value_group_size(values.shape[-1])
        start = self.offset
        if self.buf_k is None:
            self.buf_k, self.buf_v = keys, values
        else:
            self.buf_k = mx.concatenate([self.buf_k, keys], axis=-2)
            self.buf_v = mx.concatenate([self.buf_v, values], axis=-2)
        self.offset += keys.shape[-2]
        kv = HierarchicalKV(self, start, keys.shape[-2], self.view)
        return kv, kv

    def commit(self) -> int:
        """Declare every cached token committed: flush the groups no future query reads in full
        precision into the packed planes. Returns the number of tokens flushed."""
        target = self.quantized_before(self.offset)
        n = target - self.q_len
        if n <= 0:
            return 0
        kq = quantize_keys(self.buf_k[..., :n, :], self.group_size)
        vq = quantize_values(self.buf_v[..., :n, :], self.value_group_size)
        self.keys_q = concat_two_plane(self.keys_q, kq, axis=-1)
        self.values_q = concat_two_plane(self.values_q, vq, axis=-2)
        self.buf_k = self.buf_k[..., n:, :]
        self.buf_v = self.buf_v[..., n:, :]
        self.q_len = target
        return n

    @property
    def buffer_len(self) -> int:
        return self.offset - self.q_len

    def is_trimmable(self) -> bool:
        return True

    def trimmable(self) -> int:
        """How many tokens `trim` can remove now (never into what a flushed group requires)."""
        floor = self.q_len + self.min_recent if self.q_len else 0
        return max(0, self.offset - floor)

    def trim(self, n: int) -> int:
        n = max(0, min(n, self.trimmable()))
        if n:
            self.offset -= n
            self.buf_k = self.buf_k[..., : self.buffer_len, :]
            self.buf_v = self.buf_v[..., : self.buffer_len, :]
        return n

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.buf_k is None

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if window_size is not None:
            raise MlxspecError("the hierarchical KV cache has no sliding-window support")
        if N == 1:
            return None
        if return_array:
            return create_causal_mask(N, self.offset)
        return "causal"

    @property
    def state(self):
        arrays = [] if self.buf_k is None else [self.buf_k, self.buf_v]
        if self.keys_q is not None:
            arrays += list(self.keys_q) + list(self.values_q)
        return arrays

    @state.setter
    def state(self, v):
        v = list(v)
        self.buf_k, self.buf_v = (v[0], v[1]) if v else (None, None)
        if len(v) > 2:
            self.keys_q, self.values_q = TwoPlane(*v[2:6]), TwoPlane(*v[6:10])
        else:
            self.keys_q = self.values_q = None

    @property
    def meta_state(self):
        return tuple(map(str, (self.offset, self.q_len, self.group_size, self.buffer_size,
                               self.value_group_size or 0, int(self.auto_commit))))

    @meta_state.setter
    def meta_state(self, v):
        offset, q_len, g, b, gv, auto = map(int, v)
        self.offset, self.q_len, self.group_size, self.buffer_size = offset, q_len, g, b
        self.value_group_size, self.auto_commit, self.view = gv or None, bool(auto), "target"

    @property
    def nbytes(self) -> int:
        """Bytes held: both planes, scales and minima of keys and values, and the buffer."""
        return sum(a.nbytes for a in self.state)

    def nbytes_by_part(self) -> dict[str, int]:
        parts = {"upper_plane": 0, "lower_plane": 0, "scales": 0, "buffer": 0}
        for q in (self.keys_q, self.values_q):
            if q is not None:
                parts["upper_plane"] += q.upper.nbytes
                parts["lower_plane"] += q.lower.nbytes
                parts["scales"] += q.scales.nbytes + q.mins.nbytes
        if self.buf_k is not None:
            parts["buffer"] = self.buf_k.nbytes + self.buf_v.nbytes
        return parts

    # -- for tests and accounting
    def dequantized(self, view: str | None = None) -> tuple[mx.array, mx.array]:
        """The whole cache (keys, values), (B, H, offset, D), as the stored planes and buffer
        reconstruct it in `view` ("target": both planes, "draft": upper). The rows a query at
        position p reads are [:Q(p)] from here only if Q(p) == q_len (call `commit` first)."""
        planes = 1 if (view or self.view) == "draft" else 2
        ks, vs = [], []
        if self.keys_q is not None:
            ks.append(dequantize_two_plane(self.keys_q, self.group_size, planes).swapaxes(-1, -2))
            v = dequantize_two_plane(self.values_q, self.value_group_size, planes)
            vs.append(v[..., : self.buf_v.shape[-1]])
        if self.buf_k is not None:
            ks.append(self.buf_k)
            vs.append(self.buf_v)
        return mx.concatenate(ks, axis=-2), mx.concatenate(vs, axis=-2)


@dataclass
class HierarchicalKV:
    """What `HierarchicalKVCache.update_and_fetch` returns to the attention layer: a snapshot of
    the layer's store and buffer, and the positions of the new rows (start .. start + num - 1)."""

    cache: HierarchicalKVCache
    start: int
    num: int
    view: str

    def __post_init__(self):
        c = self.cache
        self.q_len = c.q_len
        self.keys_q, self.values_q = c.keys_q, c.values_q
        self.buf_k, self.buf_v = c.buf_k, c.buf_v
        self.group_size, self.value_group_size = c.group_size, c.value_group_size
        # Q(p) of each row, and how many buffer tokens some row needs quantized on the fly.
        self.row_q = [c.quantized_before(self.start + i) for i in range(self.num)]
        self.pending = max(0, self.row_q[-1] - self.q_len)
        if self.row_q[0] < self.q_len:
            raise RuntimeError(
                "hierarchical KV cache: a query precedes a flushed group (trimmed below the "
                "committed part?)")

    @property
    def shape(self):  # so that generic code that only inspects shapes does not break
        return (*self.buf_k.shape[:2], self.q_len + self.buf_k.shape[2], self.buf_k.shape[3])


def _qmm(x, triple, group_size):
    return mx.quantized_matmul(x, *triple, transpose=False, group_size=group_size, bits=BITS)


def _expand_kv(a):
    """(B, H, ...) -> (B, H, 1, ...) to broadcast over the query heads of a GQA group."""
    return mx.expand_dims(a, 2)


def hierarchical_attention(queries: mx.array, kv: HierarchicalKV, scale: float,
                           mask: Any = None) -> mx.array:
    """Attention of queries (B, n_heads, L, D) over the hierarchical cache in kv.view.

    Scores: the packed store via `mx.quantized_matmul` on the upper plane (+ the lower plane in
    the target view), the buffer in full precision; rows whose Q(p) reaches into the buffer take
    those columns from an on-the-fly quantization of the buffer's oldest groups. One softmax over
    all columns, then the same split for the values.
    """
    B, n_heads, L, D = queries.shape
    if L != kv.num:
        raise ValueError(f"{L} queries for {kv.num} new cache rows")
    n_kv = kv.buf_k.shape[1]
    rep = n_heads // n_kv
    two = kv.view != "draft"
    g, gv = kv.group_size, kv.value_group_size
    dtype = queries.dtype
    q = (queries * scale).reshape(B, n_kv, rep, L, D)

    def key_scores(planes: TwoPlane) -> mx.array:
        s = _qmm(q, tuple(map(_expand_kv, planes.upper_triple())), g)
        if two:
            s = s + _qmm(q, tuple(map(_expand_kv, lower_triple(planes.lower, planes.scales))), g)
        return s

    def value_out(p: mx.array, planes: TwoPlane) -> mx.array:
        o = _qmm(p, tuple(map(_expand_kv, planes.upper_triple())), gv)
        if two:
            o = o + _qmm(p, tuple(map(_expand_kv, lower_triple(planes.lower, planes.scales))), gv)
        return o

    buf_k, buf_v = _expand_kv(kv.buf_k), _expand_kv(kv.buf_v)
    t_buf = kv.buf_k.shape[2]
    s_buf = q @ buf_k.swapaxes(-1, -2)  # (B, n_kv, rep, L, t_buf)
    use_q = None
    m = kv.pending
    if m:
        pk = quantize_keys(kv.buf_k[..., :m, :], g)
        row_need = mx.array([rq - kv.q_len for rq in kv.row_q])[:, None]  # (L, 1)
        use_q = mx.arange(m)[None, :] < row_need  # (L, m): column read quantized by that row
        s_pend = key_scores(pk)
        s_buf = mx.concatenate([mx.where(use_q, s_pend, s_buf[..., :m]), s_buf[..., m:]], axis=-1)
    parts = [key_scores(kv.keys_q), s_buf] if kv.q_len else [s_buf]
    scores = mx.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
    total = kv.q_len + t_buf

    if isinstance(mask, str) or (mask is None and L > 1):
        if isinstance(mask, str) and mask != "causal":
            raise ValueError(f"unsupported mask {mask!r}")
        rows = mx.arange(kv.start, kv.start + L)[:, None]
        mask = rows >= mx.arange(total)[None, :]
    if mask is not None:
        if mask.ndim == 4:  # (B or 1, heads or 1, L, total) -> split the heads into GQA groups
            mask = mask.reshape(mask.shape[0], n_kv if mask.shape[1] == n_heads else 1,
                                rep if mask.shape[1] == n_heads else 1, L, -1)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    probs = mx.softmax(scores, axis=-1, precise=True).astype(dtype)

    p_buf = probs[..., kv.q_len:]
    head_dim = kv.buf_v.shape[-1]
    out = value_out(probs[..., : kv.q_len], kv.values_q)[..., :head_dim] if kv.q_len else None
    if m:
        pv = quantize_values(kv.buf_v[..., :m, :], gv)
        zero = mx.zeros((), dtype)
        o_pend = value_out(mx.where(use_q, p_buf[..., :m], zero), pv)[..., :head_dim]
        out = o_pend if out is None else out + o_pend
        p_buf = mx.concatenate([mx.where(use_q, zero, p_buf[..., :m]), p_buf[..., m:]], axis=-1)
    o_buf = p_buf @ buf_v
    out = o_buf if out is None else out + o_buf
    return out.reshape(B, n_heads, L, -1)


# ----------------------------------------------------------------------------- mlx-lm adapter

_ADAPTER_FLAG = "_mlxspec_hierarchical_adapter"


def _wrap_sdpa(original):
    sig = inspect.signature(original)

    def scaled_dot_product_attention(queries, keys, values, *args, **kwargs):
        if isinstance(keys, HierarchicalKV):
            bound = sig.bind(queries, keys, values, *args, **kwargs)
            a = bound.arguments
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


def make_hierarchical_cache(model, group_size: int = 64, buffer_size: int | None = None,
                            value_group_size: int | None = None,
                            auto_commit: bool = True) -> list[HierarchicalKVCache]:
    """One `HierarchicalKVCache` per layer of `model`, with the attention adapter installed.

    Target view, auto-commit on: usable as-is for prefill, plain decoding and verification; wrap
    draft forwards in `draft_view(cache)`."""
    if hasattr(model, "make_cache"):
        kinds = {type(c).__name__ for c in model.make_cache()}
        if kinds - {"KVCache"}:
            family = getattr(getattr(model, "args", None), "model_type", type(model).__name__)
            raise MlxspecError(
                f"quantspec (and kv='hierarchical') cannot run {family}: it uses "
                f"{', '.join(sorted(kinds - {'KVCache'}))} layers (sliding windows or recurrent "
                "state), and the hierarchical KV cache replaces plain KVCache layers only. "
                "Modes that are exact on it: none, ngram, draft, auto"
                + ("" if "ArraysCache" in kinds else ", lookahead"))
    install_attention_adapter(model)
    layers = getattr(model, "layers", None)
    if layers is None:
        raise MlxspecError("model has no .layers")
    return [HierarchicalKVCache(group_size, buffer_size, value_group_size, auto_commit)
            for _ in layers]


def make_reference_cache(model, group_size: int = 64, buffer_size: int | None = None,
                         value_group_size: int | None = None) -> list[HierarchicalKVCache]:
    """The cache for plain (non-speculative) decoding with the hierarchical cache, target view:
    the lossless reference `quantspec` is token-identical to at temperature 0 (the same cache
    `QuantSpecProposer.make_target_cache` makes)."""
    return make_hierarchical_cache(model, group_size, buffer_size, value_group_size,
                                   auto_commit=True)


def commit(caches) -> None:
    for c in caches:
        if isinstance(c, HierarchicalKVCache):
            c.commit()


@contextlib.contextmanager
def draft_view(caches) -> Iterator[None]:
    """Inside the block, every hierarchical cache in `caches` reads the draft (upper-plane) view
    and does not auto-commit (what the draft appends is speculative). Commits once on entry: the
    block must start with a cache of committed tokens only (as a proposer's `propose` does)."""
    saved = [(c, c.view, c.auto_commit) for c in caches if isinstance(c, HierarchicalKVCache)]
    for c, _, _ in saved:
        c.commit()
        c.view, c.auto_commit = "draft", False
    try:
        yield
    finally:
        for c, v, a in saved:
            c.view, c.auto_commit = v, a


def set_view(caches, view: str) -> None:
    if view not in VIEWS:
        raise ValueError(f"view must be one of {VIEWS}, got {view!r}")
    for c in caches:
        if isinstance(c, HierarchicalKVCache):
            c.view = view
