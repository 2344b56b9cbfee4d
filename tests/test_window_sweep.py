"""Requests that extend earlier ones on models whose caches are not all plain (issue 44): a
sliding window that has wrapped, then several new tokens, crashed every mode. Every family with
a window or recurrent state, every mode it is not refused, against mlx-lm's `generate_step`
from scratch, token for token at T = 0: extensions by 1, a few and many tokens over a cached
prefix shorter than, equal to and longer than the window; prompts at the window ± 1, twice the
window ± 1 and the prefill chunk ± 1; the same through the server's worker."""

from __future__ import annotations

import functools
import random

import mlx.core as mx
import pytest
from conftest import make_engine
from families import RECURRENT, SLIDING, VOCAB, WINDOW, build, expected_refusal, noisy_copy
from mlx_lm.generate import generate_step

from mlxspec import caches
from mlxspec.caches.prompt import PromptCache

MODES = ["none", "ngram", "ngram-tree", "draft", "lookahead", "auto", "quantspec"]
CHUNK = 7  # prefill_step_size: chunk boundaries inside every prompt
NEW = 6  # tokens generated per request


def stream(seed: int, n: int = 260) -> list[int]:
    """Token text that repeats itself in places (prompt lookup finds matches) and not in
    others."""
    rng = random.Random(seed)
    unit = [rng.randrange(1, VOCAB) for _ in range(9)]
    out: list[int] = []
    while len(out) < n:
        out += unit if rng.random() < 0.5 else [rng.randrange(1, VOCAB) for _ in range(9)]
    return out[:n]


def requests() -> list[list[int]]:
    """One engine's requests, in order: each pair extends a cached prefix shorter than, equal
    to and longer than the window by 1, a few and many tokens; then prompts (of another text,
    so nothing is reused) at the window and chunk boundaries."""
    text = stream(1)
    out = []
    for cached in (WINDOW - 6, WINDOW, 7 * WINDOW + 9):
        for extra in (1, 4, 5 * WINDOW + 3):
            out += [text[:cached], text[: cached + extra]]
    other = stream(2)
    for n in (WINDOW - 1, WINDOW + 1, 2 * WINDOW - 1, 2 * WINDOW + 1, CHUNK - 1, CHUNK + 1,
              3 * CHUNK + 1):
        out.append(other[:n])
    return out


REQUESTS = requests()


@pytest.fixture(autouse=True)
def small_growth_steps(monkeypatch):
    """Window buffers grow (and drop what no query sees) every 16 tokens, not 256: the
    sweep's short requests cross many growths, where a mask and its keys could disagree."""
    monkeypatch.setattr(caches.WindowedKVCache, "step", 16)


@functools.lru_cache(maxsize=1)  # the cases run family by family
def family(name: str):
    target = build(name, seed=3)
    draft = noisy_copy(target, name, seed=4)
    refs = {}
    for prompt in REQUESTS:
        if tuple(prompt) not in refs:
            refs[tuple(prompt)] = [t for t, _ in generate_step(mx.array(prompt), target,
                                                               max_tokens=NEW)]
    return target, draft, refs


def engine_for(target, draft, mode):
    options = {"tree": True} if mode == "ngram-tree" else {}
    return make_engine(target, "ngram" if mode == "ngram-tree" else mode, draft_model=draft,
                       vocab=VOCAB, num_draft=5, prefill_step_size=CHUNK, **options)


# (tests/test_families.py checks the refusals of the other pairs)
CASES = [(f, m) for f in SLIDING + RECURRENT for m in MODES if expected_refusal(f, m) is None]


@pytest.mark.parametrize("name, mode", CASES)
def test_requests_extending_earlier_ones_are_exact(name, mode):
    target, draft, refs = family(name)
    engine = engine_for(target, draft, mode)
    if mode == "quantspec":  # exact to the target reading its 8-bit KV view, from scratch
        reference = make_engine(target, "none", vocab=VOCAB, kv="hierarchical")
        refs = {p: reference.generate(list(p), max_tokens=NEW,
                                      prompt_cache=PromptCache()).tokens for p in refs}
    reused = 0
    for prompt in REQUESTS:
        want = refs[tuple(prompt)]
        # mostly right, so proposals are accepted and rejected whatever the model copies
        prediction = [t if i % 3 != 1 else (t + 1) % VOCAB for i, t in enumerate(want)]
        got = engine.generate(list(prompt), max_tokens=NEW, prediction=prediction)
        assert got.tokens == want, (name, mode, len(prompt))
        reused += got.stats.cached_tokens
    assert reused > 0  # the prompt cache was used, wrapped windows included


def test_the_worker_serves_extending_requests_exactly():
    """The server's path: sliding-window and recurrent models run a batch of one per request
    on the worker's prompt caches, prefilled a chunk per step."""
    from mlxspec.server.protocol import GenRequest
    from mlxspec.server.worker import Done, Worker

    for name in ("gemma3_text", "qwen3_5"):
        target = build(name, seed=3)
        engine = make_engine(target, "auto", vocab=VOCAB, prefill_step_size=CHUNK)
        worker = Worker(engine, prefill_chunk=2 * CHUNK)
        assert not worker.batchable
        for prompt in REQUESTS[:12]:
            want = [t for t, _ in generate_step(mx.array(prompt), target, max_tokens=NEW)]
            job = worker.submit(GenRequest("completions", list(prompt), NEW))
            worker._admit(block=False)
            worker._open_job(job)
            while worker.jobs:
                worker._step_all()
            events = []
            while not job.events.empty():
                events.append(job.events.get())
            assert isinstance(events[-1], Done), (name, events[-1])
            text = "".join(e.text for e in events[:-1])
            assert text == engine.tokenizer.decode(want), (name, len(prompt))


def test_a_windowed_mask_matches_the_keys_its_update_returns():
    """The invariant the crash broke: whatever a `WindowedKVCache` holds, the mask it makes for
    N new tokens (before the update) has as many columns as the update returns keys, and marks
    exactly the keys inside each query's window."""
    rng = random.Random(0)
    for window in (4, 16):
        cache = caches.WindowedKVCache(window, margin=5)
        pos = 0
        for _ in range(200):
            n = rng.choice([1, 1, 2, 3, 7, window + 3, 2 * window + 1])
            mask = cache.make_mask(n, return_array=True)
            kv = mx.zeros((1, 1, n, 2))
            keys, _ = cache.update_and_fetch(kv, kv)
            first = pos + n - keys.shape[2]  # the absolute position of the first key returned
            if mask is None:  # one query that sees every key
                assert n == 1 and first == 0 and pos < window
                mask = mx.ones((1, keys.shape[2]), mx.bool_)
            assert mask.shape == (n, keys.shape[2]), (window, pos, n)
            for q in (0, n - 1):
                seen = [first + j for j in range(keys.shape[2]) if mask[q, j].item()]
                qpos = pos + q
                assert seen == list(range(max(0, qpos - window + 1), qpos + 1))
            pos += n
            back = rng.randrange(0, min(5, cache.trimmable()) + 1)
            assert cache.trim(back) == back
            pos -= back


# The lengths of issue 44's report, in its order: one engine, each request extending (or
# cutting back) the one before past a 512-token window; every mode crashed on one of them.
REPORTED = [520, 700, 1000, 1100, 1030, 1537, 2100]
WINDOW_MODES = ["none", "ngram", "ngram-tree", "draft", "lookahead", "auto"]


def _reported_sweep(target, draft, vocab: int, modes: list[str], max_tokens: int = 8):
    text = [random.Random(7).randrange(1, vocab) for _ in range(max(REPORTED))]
    text[1500:1600] = text[900:1000]  # something for prompt lookup to copy
    refs = {n: [t for t, _ in generate_step(mx.array(text[:n]), target, max_tokens=max_tokens)]
            for n in REPORTED}
    for mode in modes:
        options = {"tree": True} if mode == "ngram-tree" else {}
        engine = make_engine(target, "ngram" if mode == "ngram-tree" else mode,
                             draft_model=draft, vocab=vocab, num_draft=5, **options)
        for n in REPORTED:
            got = engine.generate(text[:n], max_tokens=max_tokens)
            assert got.tokens == refs[n], (mode, n)
            assert n == REPORTED[0] or got.stats.cached_tokens > 0


def test_the_reported_crash_lengths_are_exact_in_every_mode():
    """Issue 44's cases on a gemma3_text with a 512-token window (hidden 128, 6 layers, one
    global layer in 6) and a warm prompt cache, against mlx-lm from scratch."""
    cfg = dict(hidden_size=128, num_hidden_layers=6, sliding_window=512,
               sliding_window_pattern=6)
    target = build("gemma3_text", seed=3, **cfg)
    draft = noisy_copy(target, "gemma3_text", seed=4, **cfg)
    _reported_sweep(target, draft, VOCAB, WINDOW_MODES)


@pytest.mark.slow
def test_the_reported_crash_lengths_at_a_real_models_size():
    """The same at Gemma 3 270M's widths (hidden 640, 4 heads of 256, window 512; 12 of its 18
    layers and a 4k vocabulary, to keep CI short), random weights: no real sliding-window model
    is reachable here."""
    cfg = dict(hidden_size=640, num_hidden_layers=12, intermediate_size=2048,
               num_attention_heads=4, num_key_value_heads=1, head_dim=256,
               query_pre_attn_scalar=256, sliding_window=512, sliding_window_pattern=6,
               vocab_size=4096)
    target = build("gemma3_text", seed=3, **cfg)
    _reported_sweep(target, None, 4096, ["none", "auto"], max_tokens=6)
