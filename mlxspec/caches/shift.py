"""Reuse of a cached prompt's chunks at shifted positions (llama.cpp's `--cache-reuse N`).

An editor's next request often holds most of the last one, moved: the cursor went down a line
and the 256-line window now starts a line later. Past the common prefix, the cached tokens are
scanned in order for runs of at least N tokens that continue the new prompt; each run's keys
are rotated by its shift (RoPE composes: rotating a key stored at position s by d gives the key
at s + d) and moved into place, the tokens between runs dropped. Values do not depend on the
position. The reused entries were computed attending to the old context, not the new one, so
the output is not the model's own on a fresh prefill: opt-in (`n_cache_reuse`, `--cache-reuse`).
Runs only move left, as in llama.cpp: moving the text after a typed word right was measured on
the llama.vim replay (9x sooner first suggestions, 1 answer in 10 still the exact one: the moved
states describe the old line; docs/SERVER.md).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from ..errors import MlxspecError

# Rotary embeddings that are a plain rotation of the stored key (scaled frequencies included);
# YaRN and LongRoPE also scale the key, and dynamic NTK derives its base from the length.
SHIFTABLE_ROPE = ("RoPE", "Llama3RoPE")


def reusable_chunks(cached: list[int], prompt: list[int], start: int,
                    min_chunk: int) -> list[tuple[int, int, int]]:
    """(cached position, prompt position, length) of each run of at least `min_chunk` cached
    tokens past `start` (the common prefix) that continues the prompt, in order (llama.cpp's
    scan: a run continues the prompt where the last one ended; other cached tokens drop)."""
    chunks: list[tuple[int, int, int]] = []
    head_c = head_p = start
    while head_c < len(cached) and head_p < len(prompt):
        n = 0
        while (head_c + n < len(cached) and head_p + n < len(prompt)
               and cached[head_c + n] == prompt[head_p + n]):
            n += 1
        if n >= min_chunk:
            chunks.append((head_c, head_p, n))
            head_c, head_p = head_c + n, head_p + n
        else:
            head_c += 1
    return chunks


def check_shiftable(model, cache: list) -> list:
    """The rotary embedding of every layer, or a clear error naming what refuses a shift."""
    from ..tree import rope_sites

    kinds = {type(c).__name__ for c in cache if type(c) is not KVCache}
    if kinds:
        raise MlxspecError(
            "cache reuse at shifted positions needs plain attention caches on every layer; this "
            f"model's cache has {', '.join(sorted(kinds))} layers (a sliding window, a recurrent "
            "state or a quantized cache cannot move its entries)")
    sites = rope_sites(model)
    ropes = [s.rope for s in sites]
    odd = {type(r).__name__ for r in ropes} - set(SHIFTABLE_ROPE)
    if odd:
        raise MlxspecError(f"cache reuse at shifted positions cannot re-rotate {', '.join(odd)} "
                           "keys (they are scaled as well as rotated)")
    if len(ropes) != len(cache):
        raise MlxspecError("cache reuse at shifted positions: the model's rotary layers do not "
                           "match its cache layers one to one")
    return ropes


def rotate(rope, keys: mx.array, shift: int) -> mx.array:
    """Keys (B, heads, n, dim) rotated by `shift` positions: each token moved into the batch
    axis of `mx.fast.rope`, so that all of them turn by the same angle. A left shift turns the
    keys back through a reflection (negating the second coordinate of every rotated pair turns
    a rotation by d into one by -d): MLX 0.32's CUDA rope computes negative offsets wrong
    (measured on an H200: keys off by ~4, every reused answer changed), so none reaches it."""
    if shift < 0:
        sign = _reflection(rope, keys.shape[-1], keys.dtype)
        return sign * rotate(rope, sign * keys, -shift)
    return rope(keys.transpose(2, 1, 0, 3), offset=shift).transpose(2, 1, 0, 3)


def _reflection(rope, head_dim: int, dtype) -> mx.array:
    """+-1 per dimension: -1 on the second coordinate of each pair the rope rotates (the odd
    ones for the interleaved layout, the second half of its dims otherwise)."""
    i = mx.arange(head_dim)
    second = (i % 2 == 1) if rope.traditional else (i >= rope.dims // 2)
    return mx.where(second & (i < rope.dims), -1, 1).astype(dtype)


def shift_chunks(model, cache: list, keep: int, chunks: list[tuple[int, int, int]]) -> int:
    """Rebuild `cache` as its first `keep` entries followed by each chunk moved to its prompt
    position; returns the new length (the prompt tokens it holds)."""
    ropes = check_shiftable(model, cache)
    length = chunks[-1][1] + chunks[-1][2]
    for c, rope in zip(cache, ropes):
        keys, values = [c.keys[..., :keep, :]], [c.values[..., :keep, :]]
        for src, dst, n in chunks:
            k = c.keys[..., src : src + n, :]
            keys.append(rotate(rope, k, dst - src) if dst != src else k)
            values.append(c.values[..., src : src + n, :])
        c.keys, c.values = mx.concatenate(keys, axis=2), mx.concatenate(values, axis=2)
        c.offset = length
    mx.eval([(c.keys, c.values) for c in cache])
    return length
