"""Reuse of a cached prompt's chunks at shifted positions (llama.cpp's `--cache-reuse N`).

An editor's next request often holds most of the last one, moved: the cursor went down a line
and the 256-line window now starts a line later, or a word was typed and the 64 lines after the
cursor moved right by its tokens. Past the common prefix, runs of at least N cached tokens that
the new prompt also has, in the same order, are moved to where the prompt has them, their keys
rotated by the shift (RoPE composes: rotating a key stored at position s by d gives the key at
s + d); the cached tokens between runs drop and the prompt's tokens between them are computed
in place. llama.cpp only drops (its runs move left); computing what was inserted is what lets
the text after a typed word be reused. Values do not depend on the position. The reused entries were computed attending to the old context, not the new one, so
the output is not the model's own on a fresh prefill: opt-in (`n_cache_reuse`, `--cache-reuse`).
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
    """(cached position, prompt position, length) of runs of at least `min_chunk` cached tokens
    past `start` (the common prefix) that the prompt has past `start`, in order in both: the
    cached tokens between runs drop (llama.cpp's scan), and, beyond llama.cpp, the prompt's
    tokens between runs (the word just typed before the text after the cursor) are computed."""
    if min_chunk <= 0:
        return []
    first: dict[tuple, list[int]] = {}  # a run's first min_chunk tokens -> cached positions
    for i in range(start, len(cached) - min_chunk + 1):
        first.setdefault(tuple(cached[i : i + min_chunk]), []).append(i)
    chunks: list[tuple[int, int, int]] = []
    head_c = head_p = start
    while head_p + min_chunk <= len(prompt):
        src = next((i for i in first.get(tuple(prompt[head_p : head_p + min_chunk]), ())
                    if i >= head_c), None)
        if src is None:
            head_p += 1
            continue
        n = min_chunk
        while (src + n < len(cached) and head_p + n < len(prompt)
               and cached[src + n] == prompt[head_p + n]):
            n += 1
        chunks.append((src, head_p, n))
        head_c, head_p = src + n, head_p + n
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
    axis of `mx.fast.rope`, so that all of them turn by the same angle."""
    return rope(keys.transpose(2, 1, 0, 3), offset=shift).transpose(2, 1, 0, 3)


def shift_chunks(model, cache: list, keep: int, chunks: list[tuple[int, int, int]],
                 prompt: list[int], step: int = 2048) -> tuple[int, int]:
    """Rebuild `cache` as its first `keep` entries, then, in order, the prompt's tokens before
    each chunk computed at their places and the chunk moved to its prompt position; returns
    (prompt tokens it holds, how many of them were computed here)."""
    ropes = check_shiftable(model, cache)
    # the chunks' entries, taken (and evaluated) before anything is written over them
    moved = [[(rotate(rope, c.keys[..., src : src + n, :], dst - src),
               c.values[..., src : src + n, :]) for src, dst, n in chunks]
             for c, rope in zip(cache, ropes)]
    mx.eval(moved)
    for c in cache:
        c.trim(c.offset - keep)
    held = keep
    for i, (_, dst, n) in enumerate(chunks):
        while held < dst:  # the prompt's own tokens before this chunk
            todo = prompt[held : min(dst, held + step)]
            model(mx.array(todo, mx.uint32)[None], cache=cache)
            held += len(todo)
        for c, layer in zip(cache, moved):
            k, v = layer[i]
            c.keys = mx.concatenate([c.keys[..., : c.offset, :], k], axis=2)
            c.values = mx.concatenate([c.values[..., : c.offset, :], v], axis=2)
            c.offset += n
        held += n
        mx.eval([(c.keys, c.values) for c in cache])
    return held, held - keep - sum(n for _, _, n in chunks)
