"""The adaptive-k policy against a simulated cost/acceptance model whose optimum is known."""

from __future__ import annotations

import random

import pytest
from conftest import build_model, make_engine

from mlxspec.policy import AdaptiveK


def true_rate(accept: float, plain: float, slope: float, k: int) -> float:
    expected = sum(accept**i for i in range(k + 1))  # 1 + a + ... + a^k
    return expected / (plain + slope * k)


def simulate(policy: AdaptiveK, accept: float, plain: float, slope: float, steps: int, seed=0):
    rng = random.Random(seed)
    used = []
    for _ in range(steps):
        k = policy.cap("draft")
        n = 0
        while n < k and rng.random() < accept:
            n += 1
        noise = 1 + rng.uniform(-0.05, 0.05)  # timings are noisy
        policy.observe("draft" if k else "", k, n, (plain + slope * k) * noise)
        used.append(k)
    return used


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("accept,slope", [(0.8, 0.25), (0.9, 0.1), (0.6, 0.05), (0.95, 0.02)])
def test_chooses_the_rate_maximising_k(accept, slope, seed):
    policy = AdaptiveK(max_k=12)
    simulate(policy, accept, 0.01, 0.01 * slope, 3000, seed=seed)
    rates = [true_rate(accept, 1.0, slope, k) for k in range(13)]
    chosen = policy.choose("draft")
    assert rates[chosen] >= 0.98 * max(rates), (chosen, rates.index(max(rates)))


def test_switches_off_when_speculation_does_not_pay():
    policy = AdaptiveK(max_k=8)
    used = simulate(policy, accept=0.1, plain=0.01, slope=0.005, steps=2000)
    assert policy.choose("draft") == 0
    late = used[500:]
    # Mostly plain steps; a few probes keep the estimate fresh.
    assert 0 < sum(1 for k in late if k) < 0.1 * len(late)


def test_follows_content_that_becomes_predictable():
    policy = AdaptiveK(max_k=8)
    simulate(policy, accept=0.05, plain=0.01, slope=0.004, steps=800, seed=1)
    assert policy.choose("draft") == 0
    simulate(policy, accept=0.95, plain=0.01, slope=0.004, steps=800, seed=2)
    assert policy.choose("draft") >= 4


def test_auto_mode_is_lossless_and_uses_ngram_on_repetitive_text():
    target, _ = build_model("llama", seed=21, scale=4.0)
    draft, _ = build_model("llama", seed=22, layers=1, scale=4.0)
    plain = make_engine(target, "none")
    auto = make_engine(target, "auto", draft_model=draft, num_draft=6)
    rng = random.Random(3)
    drafted = 0
    for i in range(20):
        unit = [rng.randrange(1, 256) for _ in range(4)]
        prompt = unit * 5 if i % 2 else [rng.randrange(1, 256) for _ in range(12)]
        want = plain.generate(prompt, max_tokens=30).tokens
        got = auto.generate(prompt, max_tokens=30)
        assert got.tokens == want
        drafted += got.stats.drafted_by_source.get("ngram", 0)
    assert drafted > 0
