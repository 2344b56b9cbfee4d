"""Helpers shared by test modules (no test module imports another): prompts, a raw cache's
prefill, a chi-square p-value, and a request decoded with a proposer on a raw cache."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
from conftest import decode
from mlx_lm.models.cache import make_prompt_cache
from scipy.stats import chisquare

from mlxspec.choose_k import RowOffer, survival
from mlxspec.policy import FixedK
from mlxspec.stats import Stats


def prompts(n: int, vocab: int = 256, seed: int = 0) -> list[list[int]]:
    """Half repetitive (n-gram lookup finds matches), half random."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 2:
            unit = [rng.randrange(1, vocab) for _ in range(rng.randint(2, 6))]
            out.append((unit * 8)[: rng.randint(8, 40)])
        else:
            out.append([rng.randrange(1, vocab) for _ in range(rng.randint(3, 40))])
    return out


def prefill(model, tokens: list[int]) -> list:
    cache = make_prompt_cache(model)
    if tokens:
        model(mx.array(tokens, mx.uint32)[None], cache=cache)
    return cache


def chi2_pvalue(observed: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit of counts to probabilities (cells expected < 5 pooled)."""
    expected = probs / probs.sum() * observed.sum()
    small = expected < 5
    obs, exp = observed[~small], expected[~small]
    if small.any():
        obs, exp = np.append(obs, observed[small].sum()), np.append(exp, expected[small].sum())
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def generate_with(model, proposer_factory, prompt, max_tokens, sampling, seed=0, num_draft=4,
                  stats=None):
    cache = prefill(model, prompt[:-1])
    proposer = proposer_factory()
    proposer.reset(prompt, sampling)
    out = []
    for new in decode(model, cache, list(prompt), proposer, FixedK(num_draft),
                                  sampling, max_tokens, seed,
                                  stats if stats is not None else Stats()):
        out += new
    return out


def offers(accept: float, rows: int, cap: int = 4, **kw) -> list[RowOffer]:
    """`rows` rows' offers at acceptance `accept` per position, up to `cap` tokens each."""
    return [RowOffer(survival([accept] * cap, cap), **kw) for _ in range(rows)]
