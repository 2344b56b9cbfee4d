"""Exactness of the acceptance rules at temperature > 0 (chi-square against the exact
distribution), with a deliberately broken rule shown to fail the same test."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import build_model, make_engine
from scipy.stats import chisquare

from mlxspec.sampling import SamplingParams, probs_from_logits, sample
from mlxspec.step import greedy_accepted, verify_sampled

RNG = np.random.default_rng(0)
V = 6
P = mx.array(RNG.dirichlet(np.ones(V), size=3).astype(np.float32))  # target rows 0, 1, 2
Q = mx.array(RNG.dirichlet(np.ones(V), size=2).astype(np.float32))  # draft rows 0, 1


def broken_verify(p, draft, q, key):
    """Wrong on purpose: ignores q in the acceptance test and resamples from p on rejection."""
    k = draft.size
    a, b = mx.random.split(key)
    p_x = mx.take_along_axis(p[:k], draft[:, None], axis=-1)[:, 0]
    n = mx.cumprod((mx.random.uniform(shape=(k,), key=a) < p_x).astype(mx.int32)).sum()
    return n, sample(p[n], b)


def p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    probs = np.asarray(probs, np.float64)
    expected = probs / probs.sum() * counts.sum()
    keep = expected >= 5  # merge rare cells so the chi-square approximation holds
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp).pvalue


def emitted_tokens(rule, with_q: bool, trials: int = 3000):
    """Run the rule on drafts drawn from Q (or fixed deterministic drafts); return the first
    emitted token of every trial and the second one where the first was accepted."""
    first, second = np.zeros(V, int), np.zeros(V, int)
    key = mx.random.key(1)
    for i in range(trials):
        key, k_draft, k_verify = mx.random.split(key, 3)
        if with_q:
            draft = mx.random.categorical(mx.log(Q), key=k_draft).astype(mx.uint32)
        else:
            draft = mx.array([i % V, (i // V) % V], mx.uint32)
        n, nxt = rule(P, draft, Q if with_q else None, k_verify)
        n, nxt, d = n.item(), nxt.item(), draft.tolist()
        first[d[0] if n >= 1 else nxt] += 1
        if n >= 1:
            second[d[1] if n >= 2 else nxt] += 1
    return first, second


@pytest.mark.parametrize("with_q", [True, False], ids=["draft-q", "deterministic"])
def test_sampled_rule_reproduces_target_distribution(with_q):
    first, second = emitted_tokens(verify_sampled, with_q)
    p = np.array(P)
    assert p_value(first, p[0]) > 1e-3
    assert p_value(second, p[1]) > 1e-3


def test_broken_rule_fails_the_same_test():
    first, _ = emitted_tokens(broken_verify, True)
    assert p_value(first, np.array(P)[0]) < 1e-6


def test_greedy_rule():
    target = [1, 0, 2]  # the target's argmax after [last token] + draft
    cases = {(1, 0): (2, 2), (1, 2): (1, 0), (0, 2): (0, 1)}
    for draft, (n, token) in cases.items():
        got = greedy_accepted(target, list(draft))
        assert (got, target[got]) == (n, token)
    assert greedy_accepted(target[:1], []) == 0


def test_sampling_transforms():
    logits = mx.log(mx.array([[0.5, 0.3, 0.15, 0.05]]))
    top_p = np.array(probs_from_logits(logits, SamplingParams(1.0, top_p=0.7)))[0]
    assert np.allclose(top_p, [0.5 / 0.8, 0.3 / 0.8, 0, 0], atol=1e-6)
    top_k = np.array(probs_from_logits(logits, SamplingParams(1.0, top_k=3)))[0]
    assert np.allclose(top_k, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0], atol=1e-6)
    min_p = np.array(probs_from_logits(logits, SamplingParams(1.0, min_p=0.5)))[0]
    assert np.allclose(min_p, [0.625, 0.375, 0, 0], atol=1e-6)
    hot = np.array(probs_from_logits(logits, SamplingParams(2.0)))[0]
    want = np.sqrt([0.5, 0.3, 0.15, 0.05])
    assert np.allclose(hot, want / want.sum(), atol=1e-6)


def exact_two_token_distribution(model, prompt, params):
    """p(t1, t2) for the model, by enumeration over the tiny vocabulary."""
    vocab = model.args.vocab_size
    p1 = np.array(probs_from_logits(model(mx.array(prompt)[None])[0, -1], params))
    batch = mx.array([prompt + [t] for t in range(vocab)])
    p2 = np.array(probs_from_logits(model(batch)[:, -1], params))
    return (p1[:, None] * p2).reshape(-1)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["none", "ngram", "draft"])
def test_engine_sampling_is_exact(mode):
    target, _ = build_model("llama", seed=7, vocab=8, scale=3.0)
    draft, _ = build_model("llama", seed=8, vocab=8, layers=1, scale=3.0)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]  # repetitive, so n-gram lookup proposes
    params = SamplingParams(temperature=1.0)
    exact = exact_two_token_distribution(target, prompt, params)
    engine = make_engine(target, mode, draft_model=draft, vocab=8, num_draft=3)
    counts = np.zeros(64, int)
    drafted = 0
    for seed in range(1500):
        r = engine.generate(prompt, max_tokens=2, temperature=1.0, seed=seed)
        counts[r.tokens[0] * 8 + r.tokens[1]] += 1
        drafted += r.stats.drafted
    if mode != "none":
        assert drafted > 0
    assert p_value(counts, exact) > 1e-3
