"""Exact distributions for chi-square tests at temperature > 0: the distribution of the first
`N` generated tokens computed without any cache, by one batched forward over every prefix (a
vocabulary of 4 keeps that small), the engine's sample counts, and the test's p-value."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
from families import build, noisy_copy

from mlxspec.sampling import SamplingParams, probs_from_logits

VOCAB = 4
N = 5  # tokens per generation: k = 4 draft positions are verified in the first step
SAMPLING = dict(temperature=1.0, top_k=3, top_p=0.95)
PROMPT = [1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3]  # longer than the window: it has wrapped


def exact_distribution(model, prompt: list[int]) -> np.ndarray:
    """P(t_1..t_N) as an array of shape (VOCAB,) * N, from uncached forwards."""
    sp = SamplingParams(**SAMPLING)
    prefixes = [()]
    probs = {(): 1.0}
    for _ in range(N):
        rows = mx.array([prompt + list(p) for p in prefixes])
        p_next = np.array(probs_from_logits(model(rows)[:, -1], sp), dtype=np.float64)
        grown = []
        for p, dist in zip(prefixes, p_next):
            for t in range(VOCAB):
                probs[p + (t,)] = probs[p] * dist[t]
                grown.append(p + (t,))
        prefixes = grown
    out = np.zeros((VOCAB,) * N)
    for seq in itertools.product(range(VOCAB), repeat=N):
        out[seq] = probs[seq]
    return out


def sample_counts(engine, runs: int, drafted: list | None = None, keyed: bool = True,
                  **kwargs) -> np.ndarray:
    """Counts of the generated N-token sequences over `runs` seeds: requests with the seed (the
    keyed rule), or without one (the rejection rule; MLX's generator seeded per run, so the
    test is reproducible); `drafted` (if given) receives the draft positions verified."""
    counts = np.zeros((VOCAB,) * N)
    for seed in range(runs):
        mx.random.seed(seed)
        out = engine.generate(PROMPT, max_tokens=N, seed=seed if keyed else None, **SAMPLING,
                              **kwargs)
        counts[tuple(out.tokens)] += 1
        if drafted is not None:
            drafted.append(out.stats.drafted)
    return counts


def min_pvalue(counts: np.ndarray, exact: np.ndarray, adjacent: bool = False) -> float:
    """Smallest p-value over the per-position marginals and the joint of the last two
    positions (`adjacent`: of every two consecutive ones) (Pearson; cells expected < 5 times
    pooled)."""
    from scipy import stats

    tests = []
    for i in range(N):
        axes = tuple(j for j in range(N) if j != i)
        tests.append((counts.sum(axis=axes), exact.sum(axis=axes)))
    for i in range(N - 2 if not adjacent else 0, N - 1):  # pairs of consecutive positions
        axes = tuple(j for j in range(N) if j not in (i, i + 1))
        tests.append((counts.sum(axis=axes).ravel(), exact.sum(axis=axes).ravel()))
    pvalues = []
    for obs, p in tests:
        expected = p / p.sum() * obs.sum()
        small = expected < 5
        o = np.append(obs[~small], obs[small].sum())
        e = np.append(expected[~small], expected[small].sum())
        if e[-1] == 0:
            o, e = o[:-1], e[:-1]
        pvalues.append(stats.chisquare(o, e * o.sum() / e.sum()).pvalue)
    return min(pvalues)


# (output scale, draft noise): distributions peaked enough that a broken rollback shows
MODEL = {"gemma3_text": (1.0, 0.5), "qwen3_5": (2.5, 1.0)}


def setup(family: str, mode: str):
    window = {"sliding_window": 4} if family == "gemma3_text" else {}
    scale, noise = MODEL[family]
    target = build(family, seed=7, scale=scale, vocab_size=VOCAB, **window)
    draft = noisy_copy(target, family, noise=noise, seed=8, vocab_size=VOCAB, **window)
    # ngram proposes from a fixed predicted output, right at some positions only
    kwargs = {"prediction": [1, 2, 3, 0, 1, 2]} if mode == "ngram" else {}
    return target, draft, exact_distribution(target, PROMPT), kwargs


RUNS = 300  # enough: a broken rollback gives p < 1e-30 at 500 draws
