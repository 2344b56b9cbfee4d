"""Reuse of a cached prompt's chunks at shifted positions (`caches/shift.py`, llama.cpp's
`--cache-reuse`): which chunks, where their keys land, what a request then computes, and the
models that refuse it with a clear message."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from conftest import build_model, make_engine
from families import build as build_family

from mlxspec.caches.prompt import PromptCache, PromptCacheStore
from mlxspec.caches.shift import reusable_chunks, rotate
from mlxspec.errors import MlxspecError

# An editor's window moving down: the first lines leave, the rest is the old prompt shifted.
HEADER = [7, 8, 9, 10]
LINES = [[20 + 3 * i, 21 + 3 * i, 22 + 3 * i, 1] for i in range(12)]


def window(start: int, end: int, tail: list[int]) -> list[int]:
    return HEADER + [t for line in LINES[start:end] for t in line] + tail


def test_chunks_follow_llama_cpp_scan():
    cached = [1, 2, 3, 4, 5, 6, 7, 8]
    # the prompt lost "3": the run 4..8 continues it one place earlier
    assert reusable_chunks(cached, [1, 2, 4, 5, 6, 7, 8, 11], 2, 3) == [(3, 2, 5)]
    # runs shorter than the minimum are not reused, and a prompt token the cache lacks stops it
    assert reusable_chunks(cached, [1, 2, 4, 5, 9, 6, 7, 8], 2, 3) == []
    assert reusable_chunks(cached, [1, 2, 4, 5, 9, 6, 7, 8], 2, 2) == [(3, 2, 2)]
    # two runs in order, the cached tokens between them dropped
    assert reusable_chunks(cached, [1, 3, 4, 6, 7, 8], 1, 2) == [(2, 1, 2), (5, 3, 3)]
    # a word typed before the rest: nothing moves right (see the next test's docstring)
    assert reusable_chunks(cached, [1, 2, 3, 50, 51, 4, 5, 6, 7, 8, 9], 3, 3) == []
    assert reusable_chunks(cached, cached, 8, 1) == []


class OffsetsSeen(nn.RoPE):
    """A rope that records the offsets it is asked for."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.offsets = []

    def __call__(self, x, offset=0):
        self.offsets.append(offset)
        return super().__call__(x, offset)


@pytest.mark.parametrize("dims,traditional", [(16, False), (16, True), (8, False), (8, True)])
def test_rotation_composes_with_rope(dims, traditional):
    """Rotating by d moves a key by d positions, left too, with partial rotary dims and either
    layout; no negative offset reaches the rope (MLX 0.32's CUDA rope gets them wrong)."""
    rope = OffsetsSeen(dims, traditional=traditional)
    x = mx.random.normal((1, 2, 5, 16))
    at_10 = rope(x, offset=10)
    assert mx.allclose(rotate(rope, at_10, -7), rope(x, offset=3), atol=1e-5).item()
    assert mx.allclose(rotate(rope, rotate(rope, at_10, 4), -4), at_10, atol=1e-5).item()
    assert mx.allclose(rotate(rope, at_10, -10), rope(x, offset=0), atol=1e-5).item()
    assert min(rope.offsets) >= 0
    # the reflection of the other layout does not pass: the test tells the layouts apart
    i = mx.arange(16)
    wrong = (i >= dims // 2) if traditional else (i % 2 == 1)
    bad = mx.where(wrong & (i < dims), -1.0, 1.0)
    assert not mx.allclose(bad * rotate(rope, bad * at_10, 7), rope(x, offset=3),
                           atol=1e-3).item()


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_one_layer_model_shifted_cache_equals_a_fresh_prefill(model_type):
    """With one layer a key depends only on its token and position: the shifted cache equals
    the new prompt's fresh prefill (to rounding), values exactly, and the answers agree."""
    model, _ = build_model(model_type, seed=5, layers=1, scale=4.0)
    engine = make_engine(model)
    old = window(0, 10, [99, 98, 97])
    new = window(2, 12, [96, 95])  # two lines left the window, two came
    pc = PromptCache()
    engine.generate(old, max_tokens=4, prompt_cache=pc)
    got = engine.generate(new, max_tokens=12, prompt_cache=pc, cache_reuse=4)
    reused = len(HEADER) + 8 * 4  # the header, then lines 2..9 moved 8 places left
    assert got.stats.cached_tokens == reused
    fresh = PromptCache()
    want = engine.generate(new, max_tokens=12, prompt_cache=fresh)
    assert got.tokens == want.tokens
    n = len(pc.tokens)
    for a, b in zip(pc.cache, fresh.cache):
        assert mx.allclose(a.keys[..., :n, :], b.keys[..., :n, :], atol=1e-4).item()
        assert mx.array_equal(a.values[..., :reused, :], b.values[..., :reused, :]).item()


def test_text_after_a_typed_word_is_computed_again():
    """Runs only move left, as in llama.cpp. Moving the text after a typed word right was tried
    (the word computed in place): on the llama.vim replay the first suggestion came 9x sooner,
    but 1 answer in 10 matched the exact one (bench-results/editor-reuse/
    coder-0.5b-right-shifts.md): the moved suffix's states still describe the old line, and a
    FIM model then completes the old line, repeating what was just typed."""
    model, _ = build_model("llama", seed=4, scale=4.0)
    engine = make_engine(model)
    old = window(0, 10, [99, 98])
    new = window(0, 5, [61, 62, 63]) + window(5, 10, [99, 97])[len(HEADER):]
    pc = PromptCache()
    engine.generate(old, max_tokens=2, prompt_cache=pc)
    got = engine.generate(new, max_tokens=10, prompt_cache=pc, cache_reuse=4)
    assert got.stats.cached_tokens == len(HEADER) + 5 * 4  # the common prefix only
    assert got.tokens == engine.generate(new, max_tokens=10, prompt_cache=PromptCache()).tokens


def test_deep_model_reuses_and_then_computes_the_rest_at_its_positions():
    """Two layers: the reused entries saw the old context, so they are not a fresh prefill's;
    the cache still holds every token at its place and the rest is computed after them."""
    model, _ = build_model("qwen3", seed=6, scale=4.0)
    engine = make_engine(model)
    old, new = window(0, 10, [99]), window(3, 12, [96, 95])
    pc = PromptCache()
    engine.generate(old, max_tokens=3, prompt_cache=pc)
    got = engine.generate(new, max_tokens=8, prompt_cache=pc, cache_reuse=4)
    assert got.stats.cached_tokens == len(HEADER) + 7 * 4 and len(got.tokens) == 8
    assert pc.tokens == (new + got.tokens)[:-1] and pc.cache[0].offset == len(pc.tokens)
    # off (the default): only the common prefix, and the answer is the fresh one exactly
    again = PromptCache()
    engine.generate(old, max_tokens=3, prompt_cache=again)
    exact = engine.generate(new, max_tokens=8, prompt_cache=again)
    assert exact.stats.cached_tokens == len(HEADER)
    assert exact.tokens == engine.generate(new, max_tokens=8, prompt_cache=PromptCache()).tokens


def test_the_store_takes_the_entry_with_the_most_reusable_tokens():
    model, _ = build_model("llama", seed=7)
    engine = make_engine(model)
    store = PromptCacheStore()
    for prompt in (window(0, 10, [99]), HEADER + [5, 5, 5, 5, 5, 5]):
        pc = PromptCache()
        engine.generate(prompt, max_tokens=2, prompt_cache=pc)
        store.put(pc)
    moved = window(1, 11, [96])
    assert store.take(moved, min_chunk=4).tokens[:8] == window(0, 10, [])[:8]


@pytest.mark.parametrize("family", ["qwen3_5", "gemma3_text"])
def test_models_that_cannot_shift_refuse_with_a_clear_message(family):
    """Recurrent layers (a state, not entries) and sliding windows (a rotating buffer whose
    entries wrap) cannot move their cache: refused before any work, saying why."""
    engine = make_engine(build_family(family, seed=3), vocab=64)
    with pytest.raises(MlxspecError, match="cache reuse at shifted positions needs plain"):
        engine.generate(list(range(1, 30)), max_tokens=2, cache_reuse=4)
    assert engine.generate(list(range(1, 30)), max_tokens=2).tokens  # without it: fine


def test_quantspec_cache_refuses():
    model, _ = build_model("llama", seed=8)
    engine = make_engine(model, "quantspec")
    with pytest.raises(MlxspecError, match="HierarchicalKVCache"):
        engine.generate(list(range(1, 40)), max_tokens=2, cache_reuse=4)


def test_server_reuses_shifted_chunks_when_asked():
    """`/completion` with `n_cache_reuse` (or the server's --cache-reuse): the moved window is
    reused (`timings.cache_n`), not without it; a model that cannot shift refuses the option at
    start."""
    import json

    from server_helpers import post, start, stop

    model, _ = build_model("llama", seed=9, layers=1, scale=4.0)
    srv = start(make_engine(model))
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        def cached(prompt, **extra):
            status, payload, _ = post(url, "/completion", {"prompt": prompt, "n_predict": 2,
                                                           "temperature": 0, **extra})
            assert status == 200, payload
            return json.loads(payload)["timings"]["cache_n"]

        old, new = window(0, 10, [99]), window(2, 12, [96])
        cached(old)
        assert cached(new) == len(HEADER)  # the default: the common prefix only
        # (the store holds `new` now; a window one line down reuses the old prompt's lines)
        assert cached(window(1, 11, [96]), n_cache_reuse=4) == len(HEADER) + 9 * 4
        status, payload, _ = post(url, "/completion", {"prompt": old, "n_cache_reuse": -1})
        assert status == 400 and b"n_cache_reuse" in payload
    finally:
        stop(srv)
    with pytest.raises(MlxspecError, match="cache reuse at shifted positions"):
        start(make_engine(build_family("qwen3_5", seed=3), vocab=64), cache_reuse=4)
