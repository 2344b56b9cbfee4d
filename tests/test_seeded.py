"""Seeded sampling is reproducible: a sampled request with a seed draws each token from noise
keyed by (seed, absolute position), so every mode, alone or batched with any other requests,
gives exactly the tokens `none` gives with that seed (`sampling.keyed_draw`)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_engine
from families import build, noisy_copy

from mlxspec.batch_step import BatchSpeculator
from mlxspec.sampling import SamplingParams, keyed_draw, position_salts, probs_from_logits

VOCAB = 128
# (mode, options): every proposal source, chains and trees
MODES = [("ngram", {}), ("ngram", {"tree": True}), ("draft", {}), ("draft", {"tree_width": 3}),
         ("lookahead", {}), ("suffix", {}), ("auto", {})]
SETTINGS = [dict(temperature=0.7), dict(temperature=1.0),
            dict(temperature=1.0, top_k=20, top_p=0.9, min_p=0.02)]


def repetitive_prompt(seed: int, n: int = 40) -> list[int]:
    """Text that repeats itself, so that the lookup sources find proposals."""
    rng = np.random.default_rng(seed)
    block = rng.integers(1, VOCAB, size=8).tolist()
    return (block * (n // 8 + 1))[:n]


@pytest.fixture(scope="module")
def llama():
    # peaked enough at T = 1 that proposals are often accepted
    target = build("llama", seed=3, scale=3.0, vocab_size=VOCAB)
    draft = noisy_copy(target, "llama", noise=0.3, seed=4, vocab_size=VOCAB)
    return target, draft


def test_a_keyed_draw_depends_on_seed_and_position_only():
    logits = mx.random.normal((6, VOCAB), key=mx.random.key(0)) * 3
    sp = SamplingParams(temperature=1.0)
    at_5 = keyed_draw(logits, sp, 9, 5).tolist()
    # one position at a time, or within another span, the same draw at the same position
    assert [keyed_draw(logits[i : i + 1], sp, 9, 5 + i).item() for i in range(6)] == at_5
    assert keyed_draw(logits[2:], sp, 9, [7, 8, 9, 10]).tolist() == at_5[2:]
    # another seed or other positions draw afresh
    others = [keyed_draw(logits, sp, s, 5).tolist() for s in range(10, 20)]
    assert sum(o == at_5 for o in others) == 0
    assert position_salts(9, [5]) != position_salts(9, [6]) != position_salts(10, [5])


@pytest.mark.parametrize("settings", SETTINGS)
def test_keyed_draws_are_exact_samples(settings):
    """Over many positions the keyed draws follow p (after temperature, top-k, top-p, min-p):
    chi-square; noise that ignores the position (one draw repeated) fails the same test."""
    from scipy import stats

    vocab = 12
    logits = mx.array(np.random.default_rng(1).normal(size=vocab) * 1.5, mx.float32)
    sp = SamplingParams(**settings)
    p = np.array(probs_from_logits(logits[None], sp)[0], np.float64)
    p /= p.sum()
    draws = 6000
    tokens = keyed_draw(mx.broadcast_to(logits, (draws, vocab)), sp, 77, 1000)
    counts = np.bincount(np.array(tokens), minlength=vocab)
    assert counts[p == 0].sum() == 0
    keep = p > 0
    expected = p[keep] / p[keep].sum() * draws
    assert stats.chisquare(counts[keep], expected).pvalue > 1e-4
    one = keyed_draw(logits[None], sp, 77, 1000).item()  # a broken key: the same noise
    broken = np.bincount(np.full(draws, one), minlength=vocab)
    assert stats.chisquare(broken[keep], expected).pvalue < 1e-4


@pytest.mark.parametrize("mode,options", MODES, ids=lambda m: str(m))
def test_every_mode_draws_nones_tokens_with_a_seed(llama, mode, options):
    target, draft = llama
    reference = make_engine(target, "none", vocab=VOCAB)
    engine = make_engine(target, mode, draft_model=draft, vocab=VOCAB, num_draft=5, **options)
    drafted = accepted = 0
    for i, settings in enumerate(SETTINGS):
        for seed in (1, 2):
            prompt = repetitive_prompt(10 * i + seed)
            want = reference.generate(prompt, max_tokens=24, seed=seed, **settings).tokens
            got = engine.generate(prompt, max_tokens=24, seed=seed, **settings)
            assert got.tokens == want, (settings, seed)
            drafted, accepted = drafted + got.stats.drafted, accepted + got.stats.accepted
    # the same request twice: the same answer (the policy and suffix store learnt meanwhile,
    # and the suffix source now proposes the first answer)
    again = engine.generate(repetitive_prompt(1), max_tokens=24, seed=1, **SETTINGS[0])
    assert again.tokens == reference.generate(repetitive_prompt(1), max_tokens=24, seed=1,
                                              **SETTINGS[0]).tokens
    drafted, accepted = drafted + again.stats.drafted, accepted + again.stats.accepted
    assert drafted > 0  # speculation ran (the suffix source's matches here are short)
    assert accepted > 0 or mode == "suffix"


def test_quantspec_draws_the_hierarchical_references_tokens_with_a_seed():
    target = build("qwen2", seed=5, scale=3.0, vocab_size=VOCAB)
    reference = make_engine(target, "none", vocab=VOCAB, kv="hierarchical", kv_group_size=32)
    engine = make_engine(target, "quantspec", vocab=VOCAB, num_draft=4, group_size=32)
    for seed, settings in enumerate(SETTINGS):
        prompt = repetitive_prompt(seed, 50)
        want = reference.generate(prompt, max_tokens=40, seed=seed, **settings).tokens
        got = engine.generate(prompt, max_tokens=40, seed=seed, **settings)
        assert got.tokens == want and got.stats.accepted > 0


@pytest.mark.parametrize("mode", ["ngram", "draft", "suffix", "auto"])
def test_a_seeded_row_draws_the_same_in_any_batch(llama, mode):
    """A seeded request alone and with 7 others (greedy, sampled, seeded, unseeded, other
    modes and lengths, joining at different steps): the same tokens, equal to `none`'s."""
    target, draft = llama
    base = make_engine(target, mode, draft_model=draft, vocab=VOCAB, num_draft=4)
    prompt, kw = repetitive_prompt(5), dict(max_tokens=24, temperature=1.0, top_p=0.95, seed=42)
    want = make_engine(target, "none", vocab=VOCAB).generate(prompt, **kw).tokens
    others = [(m, dict(temperature=t, seed=s)) for m, t, s in [
        ("none", 0.0, 0), ("ngram", 1.0, None), ("draft", 0.8, 3), ("suffix", 1.0, 9),
        ("auto", 0.0, 0), ("none", 1.0, None), ("draft", 1.0, None)]]

    def run(n_others: int, join_at: int) -> list[int]:
        batch = BatchSpeculator(target)
        rows, outs = [], {}
        pending = [(prompt, dict(kw, mode=mode))] + [
            (repetitive_prompt(20 + j), dict(max_tokens=12 + 3 * j, mode=m, **o))
            for j, (m, o) in enumerate(others[:n_others])]
        step = 0
        while pending or any(r.live for r in rows):
            if pending and step >= join_at * len(rows):
                p, options = pending.pop(0)
                rows.append(base.clone().join(batch, p, **options))
            for r, out in batch.step().items():
                outs.setdefault(id(r), []).extend(out.tokens)
            step += 1
        for r in rows:
            batch.close(r)
        return outs[id(rows[0])]

    assert run(0, 0) == want
    assert run(7, 0) == want
    assert run(7, 2) == want


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_5"])
@pytest.mark.parametrize("mode", ["ngram", "draft", "auto"])
def test_seeded_modes_match_none_on_windows_and_recurrent_state(family, mode):
    window = {"sliding_window": 8} if family == "gemma3_text" else {}
    target = build(family, seed=7, scale=3.0, vocab_size=VOCAB, **window)
    draft = noisy_copy(target, family, noise=0.3, seed=8, vocab_size=VOCAB, **window)
    reference = make_engine(target, "none", vocab=VOCAB)
    engine = make_engine(target, mode, draft_model=draft, vocab=VOCAB, num_draft=4)
    for seed, settings in enumerate(SETTINGS[:2]):
        prompt = repetitive_prompt(seed, 30)
        want = reference.generate(prompt, max_tokens=24, seed=seed, **settings).tokens
        assert engine.generate(prompt, max_tokens=24, seed=seed, **settings).tokens == want


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_seeded_modes_match_none_in_half_precision(dtype):
    """The model kept in float16 / bfloat16 (as on Metal): the keyed draws of a verify equal
    the single steps' (the keyed scores are float32 over the model's logits)."""
    target = build("llama", seed=3, scale=3.0, vocab_size=VOCAB, dtype=dtype)
    draft = noisy_copy(target, "llama", noise=0.3, seed=4, vocab_size=VOCAB)
    draft.set_dtype(dtype)
    reference = make_engine(target, "none", vocab=VOCAB)
    accepted = 0
    for mode in ("ngram", "draft"):
        engine = make_engine(target, mode, draft_model=draft, vocab=VOCAB, num_draft=4)
        for seed in range(4):
            settings = SETTINGS[seed % 2]
            prompt = repetitive_prompt(seed)
            want = reference.generate(prompt, max_tokens=24, seed=seed, **settings).tokens
            got = engine.generate(prompt, max_tokens=24, seed=seed, **settings)
            assert got.tokens == want, (mode, settings)
            accepted += got.stats.accepted
    assert accepted > 0
