"""Figures the benchmark reports for QuantSpec: how far the hierarchical-cache target (and the
draft) are from the full-precision target, and the bytes each draft / verify step reads.

Teacher-forced cross-entropy through a hierarchical cache in chunks is exactly what token-by-token
decoding with that cache computes (a query's mix of precisions depends on its position only, see
`hierarchical_cache.py`), so it is a fair "quality of the lossless reference" figure.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from .hierarchical_cache import HierarchicalKVCache, make_hierarchical_cache, set_view
from .memory import model_kv_shape


def cross_entropy_bits(model, tokens: list[int], cache=None, chunk: int = 512) -> float:
    """Mean bits per predicted token of tokens[1:] given the prefix, teacher-forced in chunks."""
    cache = make_prompt_cache(model) if cache is None else cache
    total, count = 0.0, 0
    for start in range(0, len(tokens) - 1, chunk):
        x = mx.array(tokens[start : min(start + chunk, len(tokens) - 1)])[None]
        y = mx.array(tokens[start + 1 : start + 1 + x.shape[1]])
        logits = model(x, cache=cache)[0].astype(mx.float32)
        nll = nn.losses.cross_entropy(logits, y, reduction="sum")
        mx.eval(nll, [c.state for c in cache])
        total += nll.item()
        count += y.size
    return total / max(count, 1) / math.log(2)


def greedy_agreement(model_a, cache_a, model_b, cache_b, tokens: list[int],
                     chunk: int = 512) -> float:
    """Teacher-forced: the fraction of positions where both models' argmax agree."""
    same = count = 0
    for start in range(0, len(tokens) - 1, chunk):
        x = mx.array(tokens[start : min(start + chunk, len(tokens) - 1)])[None]
        a = mx.argmax(model_a(x, cache=cache_a)[0], axis=-1)
        b = mx.argmax(model_b(x, cache=cache_b)[0], axis=-1)
        same += (a == b).sum().item()
        count += x.shape[1]
    return same / max(count, 1)


def quality_report(model, draft_model, tokens: list[int], group_size: int = 64,
                   buffer_size: int | None = None, num_bytes: int | None = None) -> dict:
    """Bits per token (and per byte when `num_bytes` of text the tokens encode is given) of:
    the target with an fp cache, the target with the hierarchical cache (8-bit view, the
    reference `quantspec` is exact to), and the draft (4-bit weights, 4-bit view); and the
    greedy (teacher-forced argmax) agreement of the reference and of the draft with the
    fp-cache target. Keep `tokens` within the model's trained positions."""
    out = {"tokens": len(tokens)}
    out["greedy_agreement_reference_vs_fp"] = greedy_agreement(
        model, make_prompt_cache(model), model,
        make_hierarchical_cache(model, group_size, buffer_size), tokens)
    draft_cache = make_hierarchical_cache(model, group_size, buffer_size)
    set_view(draft_cache, "draft")
    out["greedy_agreement_draft_vs_fp"] = greedy_agreement(
        model, make_prompt_cache(model), draft_model, draft_cache, tokens)
    out["target_fp_cache"] = cross_entropy_bits(model, tokens)
    out["target_hierarchical"] = cross_entropy_bits(
        model, tokens, make_hierarchical_cache(model, group_size, buffer_size))
    cache = make_hierarchical_cache(model, group_size, buffer_size)
    set_view(cache, "draft")  # teacher-forced text is all committed: auto-commit stays on
    out["draft"] = cross_entropy_bits(draft_model, tokens, cache)
    if num_bytes:
        per_byte = (len(tokens) - 1) / num_bytes
        for k in ("target_fp_cache", "target_hierarchical", "draft"):
            out[k + "_bits_per_byte"] = out[k] * per_byte
    return out


def _weight_bytes(model, dtype=None) -> int:
    """Weight bytes one forward reads: every parameter, except that an untied embedding table
    is only gathered from (a row per token, counted as nothing). `dtype`: count floating
    parameters (weights, quantization scales and biases) as if stored in it (e.g. float16, as
    on Apple silicon); packed 4-bit codes count as they are."""
    params = dict(tree_flatten(model.parameters()))
    tied = not any(k.startswith("lm_head.") for k in params)

    def size(v):
        if dtype is not None and mx.issubdtype(v.dtype, mx.floating):
            return v.size * dtype.size
        return v.nbytes

    return sum(size(v) for k, v in params.items() if tied or "embed_tokens" not in k)


def step_bytes(model, draft_model, context_len: int, group_size: int = 64,
               buffer_size: int | None = None, kv_dtype=None, weight_dtype=None) -> dict:
    """Bytes read by one draft step, one verify step and one plain step at `context_len`
    (weights + KV). KV is measured on a filled hierarchical cache layer (its codes and live
    buffer, without free room) times the layer count; the plain step's KV is an fp cache in
    `kv_dtype` (default: the model's dtype); `weight_dtype` counts floating weights as if stored
    in it (default: as they are)."""
    n_kv, head_dim, layers = model_kv_shape(model)
    dtype = kv_dtype or next(v for _, v in tree_flatten(model.parameters())).dtype
    cache = HierarchicalKVCache(group_size, buffer_size)
    done = 0
    while done < context_len:
        n = min(1024, context_len - done)
        k = mx.random.normal((1, n_kv, n, head_dim)).astype(dtype)
        cache.update_and_fetch(k, k)
        cache.commit()
        mx.eval(cache.state)
        done += n
    parts = cache.nbytes_by_part(used=True)
    kv_target = sum(parts.values()) * layers
    kv_draft = (sum(parts.values()) - parts["lower_plane"]) * layers
    kv_fp = 2 * context_len * n_kv * head_dim * dtype.size * layers
    w_target, w_draft = _weight_bytes(model, weight_dtype), _weight_bytes(draft_model, weight_dtype)
    return dict(context=context_len,
                draft_weights=w_draft, draft_kv=kv_draft, draft_step=w_draft + kv_draft,
                verify_weights=w_target, verify_kv=kv_target, verify_step=w_target + kv_target,
                plain_weights=w_target, plain_kv=kv_fp, plain_step=w_target + kv_fp)
