"""Exact distributions at temperature > 0, through the real engine, with k >= 4 and top-k/top-p
on, on a sliding-window model (window smaller than the prompt) and a hybrid recurrent one.

The exact distribution of the first `N` generated tokens is computed without any cache, by one
batched forward over every prefix (a vocabulary of 4 keeps that small). A chi-square test then
compares the engine's samples against it, per position and for the last two positions jointly;
the same test must reject a deliberately broken rollback (rejected tokens left in the state)."""

from __future__ import annotations

import pytest
from conftest import make_engine
from exact import (
    PROMPT,
    RUNS,
    SAMPLING,
    VOCAB,
    N,
    exact_distribution,
    min_pvalue,
    sample_counts,
    setup,
)
from families import build, noisy_copy

from mlxspec import caches


def broken_rollback(model, cache, ckpt, fed, keep):
    """Rolls back attention layers only: rejected tokens stay in recurrent states (what
    mlx-lm's trim_prompt_cache silently does there)."""
    for c in caches.leaves(cache):
        if not caches.is_recurrent(c):
            c.trim(len(fed) - keep)


def silent_trim(model, cache, ckpt, fed, keep):
    """mlx-lm's rollback: a wrapped RotatingKVCache trims nothing, silently."""
    from mlx_lm.models.cache import trim_prompt_cache

    trim_prompt_cache(cache, len(fed) - keep)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_5"])
@pytest.mark.parametrize("mode", ["draft", "ngram"])
def test_sampling_is_exact_on_windows_and_recurrent_state(family, mode):
    target, draft, exact, kwargs = setup(family, mode)
    engine = make_engine(target, mode, draft_model=draft, vocab=VOCAB, num_draft=4)
    counts = sample_counts(engine, RUNS, **kwargs)
    stats = engine.generate(PROMPT, max_tokens=N, seed=0, **SAMPLING, **kwargs).stats
    assert len(stats.drafted_by_position) >= 4  # k >= 4 positions were verified
    assert 0 < stats.accepted < stats.drafted or mode == "ngram"
    assert min_pvalue(counts, exact) > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_5"])
def test_the_same_test_rejects_a_broken_rollback(family, monkeypatch):
    target, draft, exact, kwargs = setup(family, "draft")
    if family == "gemma3_text":
        from mlx_lm.models.cache import make_prompt_cache

        monkeypatch.setattr("mlxspec.caches.make_cache", make_prompt_cache)
        monkeypatch.setattr("mlxspec.caches.rows.rollback", silent_trim)
        monkeypatch.setattr("mlxspec.proposers.draft.caches.rollback", silent_trim)
    else:
        monkeypatch.setattr("mlxspec.caches.rows.rollback", broken_rollback)
        monkeypatch.setattr("mlxspec.proposers.draft.caches.rollback", broken_rollback)
    broken = make_engine(target, "draft", draft_model=draft, vocab=VOCAB, num_draft=4)
    assert min_pvalue(sample_counts(broken, RUNS), exact) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ngram-tree", "lookahead", "auto"])
def test_sampling_is_exact_for_trees_and_auto(mode):
    """Tree proposals (n-gram tree, lookahead) and auto's choice between sources, with k = 4,
    against the exact distribution, through the engine."""
    target = build("llama", seed=7, scale=1.5, vocab_size=VOCAB)
    draft = noisy_copy(target, "llama", noise=0.5, seed=8, vocab_size=VOCAB)
    exact = exact_distribution(target, PROMPT)
    options = {"tree": True} if mode == "ngram-tree" else {}
    engine = make_engine(target, "ngram" if mode == "ngram-tree" else mode, draft_model=draft,
                         vocab=VOCAB, num_draft=4, **options)
    kwargs = {} if mode == "lookahead" else {"prediction": [1, 2, 3, 0, 1, 2]}
    drafted: list[int] = []
    counts = sample_counts(engine, RUNS, drafted, **kwargs)
    assert min_pvalue(counts, exact) > 1e-4
    assert sum(drafted) > 0  # speculation happened (auto decides per run, from timing)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["draft-tree", "suffix", "quantspec"])
def test_keyed_sampling_is_exact_for_the_other_sources(mode):
    """The keyed rule (every run here has a seed) for the sources not tested above: a draft
    tree, the suffix store (its proposals learnt from the runs before), QuantSpec's 4-bit
    self-draft."""
    target = build("llama", seed=7, scale=1.5, vocab_size=VOCAB)
    draft = noisy_copy(target, "llama", noise=0.5, seed=8, vocab_size=VOCAB)
    exact = exact_distribution(target, PROMPT)
    name, options = {"draft-tree": ("draft", {"tree_width": 2}), "suffix": ("suffix", {}),
                     "quantspec": ("quantspec", {"group_size": 32})}[mode]
    engine = make_engine(target, name, draft_model=draft, vocab=VOCAB, num_draft=4, **options)
    drafted: list[int] = []
    assert min_pvalue(sample_counts(engine, RUNS, drafted), exact) > 1e-4
    assert sum(drafted) > 0


@pytest.mark.slow
def test_the_same_test_rejects_noise_not_keyed_by_position(monkeypatch):
    """Noise keyed by the seed alone (every position drawn with the same noise): each token is
    still an exact draw, the sequence is not (its joint distribution fails)."""
    import mlxspec.sampling as sampling

    target = build("llama", seed=7, scale=1.5, vocab_size=VOCAB)
    draft = noisy_copy(target, "llama", noise=0.5, seed=8, vocab_size=VOCAB)
    exact = exact_distribution(target, PROMPT)
    salts = sampling.position_salts
    monkeypatch.setattr(sampling, "position_salts",
                        lambda seed, positions: salts(seed, [0] * len(positions)))
    engine = make_engine(target, "draft", draft_model=draft, vocab=VOCAB, num_draft=4)
    assert min_pvalue(sample_counts(engine, RUNS), exact) < 1e-4
