"""Exact on the model families people run (issue 11): every mode, greedy, token for token
against mlx-lm's own `generate_step`, on plain-attention, sliding-window and hybrid recurrent
architectures; with partial acceptance (a draft that is the target plus noise), sliding windows
wrapped several times, and a second call that reuses the prompt cache. What cannot be exact is
refused before generation with a message naming the family and the modes that work."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from conftest import make_engine
from families import CONFIGS, RECURRENT, SLIDING, VOCAB, WINDOW, build, expected_refusal, noisy_copy
from mlx_lm.generate import generate_step

from mlxspec import caches
from mlxspec.errors import MlxspecError

FAMILIES = list(CONFIGS)
MODES = ["none", "ngram", "ngram-tree", "draft", "lookahead", "auto", "quantspec"]
MAX_TOKENS = 3 * WINDOW + 8  # the window wraps several times during generation


def family_prompts(seed: int) -> list[list[int]]:
    """A prompt that repeats itself (the n-gram source finds matches) and a random one."""
    rng = random.Random(seed)
    unit = [rng.randrange(1, VOCAB) for _ in range(7)]
    return [(unit * 4)[:26], [rng.randrange(1, VOCAB) for _ in range(20)]]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    target = build(request.param, seed=3)
    draft = noisy_copy(target, request.param, seed=4)
    refs = {}
    for prompt in family_prompts(5):
        refs[tuple(prompt)] = [t for t, _ in generate_step(mx.array(prompt), target,
                                                           max_tokens=MAX_TOKENS)]
    return request.param, target, draft, refs


def engine_for(target, draft, mode):
    options = {"tree": True} if mode == "ngram-tree" else {}
    real_mode = "ngram" if mode == "ngram-tree" else mode
    return make_engine(target, real_mode, draft_model=draft, vocab=VOCAB, num_draft=5,
                       **options)


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_is_exact_or_refused(family, mode):
    name, target, draft, refs = family
    refusal = expected_refusal(name, mode)
    if refusal is not None:
        with pytest.raises(MlxspecError) as e:
            engine_for(target, draft, mode).generate(list(next(iter(refs))), max_tokens=8)
        message = str(e.value)
        assert refusal in message.lower()
        assert name in message or mode == "quantspec", message
        return
    engine = engine_for(target, draft, mode)
    accepted = drafted = 0
    for prompt, want in refs.items():
        # A predicted output that is right most of the time: n-gram sources propose from it,
        # so acceptance and rejection both happen whatever the random model copies.
        prediction = [t if i % 7 != 3 else (t + 1) % VOCAB for i, t in enumerate(want)]
        got = engine.generate(list(prompt), max_tokens=MAX_TOKENS, prediction=prediction)
        assert got.tokens == want, (name, mode, prompt)
        accepted, drafted = accepted + got.stats.accepted, drafted + got.stats.drafted
        # The prompt-cache path: the next call extends this one, then one shares only a prefix.
        follow = list(prompt) + got.tokens + [5, 9, 5]
        again = engine.generate(follow, max_tokens=WINDOW)
        fresh = [t for t, _ in generate_step(mx.array(follow), target, max_tokens=WINDOW)]
        assert again.tokens == fresh, (name, mode, "extended prompt")
        assert again.stats.cached_tokens >= len(prompt)
        branch = list(prompt) + got.tokens[:5] + [7, 7]
        other = engine.generate(branch, max_tokens=WINDOW)
        fresh = [t for t, _ in generate_step(mx.array(branch), target, max_tokens=WINDOW)]
        assert other.tokens == fresh, (name, mode, "shared prefix")
        assert other.stats.cached_tokens <= len(branch) - 1
    if mode in ("ngram", "draft", "ngram-tree", "auto"):
        assert 0 < accepted < drafted, (name, mode)  # accepted and rolled back


def test_families_cover_both_kinds_of_cache():
    kinds = {f: {type(c).__name__ for c in caches.leaves(caches.make_cache(build(f)))}
             for f in SLIDING + RECURRENT}
    assert all("WindowedKVCache" in kinds[f] for f in SLIDING)
    assert all("ArraysCache" in kinds[f] or "MambaCache" in kinds[f] for f in RECURRENT)


def near_tie(target, sequence: list[int], position: int, tolerance: float) -> bool:
    """Whether the target's top-2 logits before `sequence[position]` are within `tolerance`
    (computed in the model's own dtype, uncached): a batched verify and a one-token step may
    round such a tie differently in half precision."""
    logits = target(mx.array(sequence[:position])[None])[0, -1].astype(mx.float32)
    top2 = mx.sort(logits)[-2:]
    return (top2[1] - top2[0]).item() <= tolerance


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "fp16"])
# (gpt_oss is MoE: MLX's CPU backend runs gather_mm in float32 only)
@pytest.mark.parametrize("name", ["gemma3_text", "qwen3_5", "lfm2", "nemotron_h"])
def test_half_precision_is_exact_up_to_rounding_ties(name, dtype):
    """Metal runs fp16/bf16: speculative output equals `none` in the same dtype, except where
    the reference itself sits on a rounding tie."""
    target = build(name, seed=3, dtype=dtype)
    draft = noisy_copy(target, name, seed=4)
    plain = make_engine(target, "none", vocab=VOCAB)
    identical = 0
    for mode in ("ngram", "draft"):
        spec = make_engine(target, mode, draft_model=draft, vocab=VOCAB, num_draft=5)
        for prompt in family_prompts(11):
            want = plain.generate(prompt, max_tokens=MAX_TOKENS).tokens
            got = spec.generate(prompt, max_tokens=MAX_TOKENS, prediction=want[::2]).tokens
            if got == want:
                identical += 1
                continue
            first = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            assert near_tie(target, prompt + want, len(prompt) + first, 0.25), (name, mode)
    assert identical >= 3


def test_prompt_cache_checkpoint_restores_a_recurrent_prefix_and_is_counted():
    """A hybrid model's prompt cache cannot trim; its checkpoint at the end of the prefill lets
    the same prompt (a retry, an editor's repeated request) skip the prefill, exactly."""
    target = build("qwen3_5", seed=3)
    engine = make_engine(target, "ngram", vocab=VOCAB)
    prompt = family_prompts(2)[1]
    first = engine.generate(prompt, max_tokens=12)
    assert engine.prompt_cache.checkpoint is not None
    held = engine.prompt_cache.nbytes()
    assert held > sum(c.nbytes for c in caches.leaves(engine.prompt_cache.cache))
    again = engine.generate(prompt, max_tokens=12)
    assert again.stats.cached_tokens == len(prompt) - 1 and again.tokens == first.tokens
    # a prompt that leaves the checkpointed prefix cannot be restored: prefilled, said so
    other = engine.generate(prompt[:5] + [1, 2, 3], max_tokens=4)
    assert other.stats.cached_tokens == 0
