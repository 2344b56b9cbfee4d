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
        source, k = policy.plan({"draft": policy.max_k})
        assert source == ("draft" if k else "")
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


def test_plan_is_idempotent_and_probes_a_switched_off_source():
    """Asking twice in a step changes nothing; a source that is off is probed again."""
    policy = AdaptiveK(max_k=8, probe_every=4)
    simulate(policy, accept=0.0, plain=0.01, slope=0.005, steps=300)
    assert policy.choose("draft") == 0
    probes = 0
    for _ in range(40):
        first = policy.plan({"draft": 8})
        assert policy.plan({"draft": 8}) == first
        source, k = first
        probes += k > 0
        policy.observe(source, k, 0, 0.01 + 0.005 * k)
    assert 4 <= probes <= 12


def test_plan_picks_the_better_source_within_what_is_offered():
    policy = AdaptiveK(max_k=8)
    for _ in range(300):  # ngram: always accepted; draft: never
        for source, accept in (("ngram", True), ("draft", False), ("", False)):
            k = 0 if not source else 4
            policy.observe(source, k, k if accept else 0, 0.01 + 0.001 * k)
    assert policy.plan({"ngram": 3, "draft": 8}) == ("ngram", 3)
    assert policy.plan({"draft": 8})[1] in (0, policy.probe_k)
    assert policy.plan({}) == ("", 0)


def test_auto_respects_k_and_per_call_num_draft():
    """-k caps auto's adaptive k; a per-call num_draft caps it without replacing the policy."""
    target, _ = build_model("llama", seed=21, scale=4.0)
    auto = make_engine(target, "auto", num_draft=3)
    assert isinstance(auto.policy, AdaptiveK) and auto.policy.max_k == 3
    unit = [5, 9, 13, 17, 21, 25, 29]
    out = auto.generate(unit * 6, max_tokens=40, num_draft=2)
    assert max(len(out.stats.drafted_by_position), 0) <= 2
    assert auto.policy is auto.policy_for(auto.proposer) and auto.policy.plain_weight > 0
    default = make_engine(target, "auto")
    assert default.policy.max_k == 8
