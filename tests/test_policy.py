"""The adaptive-k policy against a simulated cost/acceptance model whose optimum is known."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from conftest import build_model, decode, make_engine, observe_plain, observe_step
from mlx_lm.models.cache import make_prompt_cache

import mlxspec.sampling as sampling_module
from mlxspec.choose_k import KEEP_DEFAULT, RowOffer, choose_ks, survival
from mlxspec.cost import StepCost
from mlxspec.policy import AdaptiveK, FixedK, Probe
from mlxspec.proposers.base import Proposal, Proposer
from mlxspec.sampling import SamplingParams
from mlxspec.stats import Stats


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
        if k:
            observe_step(policy, "draft", k, n, (plain + slope * k) * noise)
        else:  # a token of a pipelined plain stretch
            observe_plain(policy, 1, plain * noise)
        used.append(k)
    return used


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("accept,slope", [(0.8, 0.25), (0.9, 0.1), (0.6, 0.05), (0.95, 0.02)])
def test_chooses_the_rate_maximising_k(accept, slope, seed):
    policy = AdaptiveK(max_k=12)
    simulate(policy, accept, 0.01, 0.01 * slope, 3000, seed=seed)
    rates = [true_rate(accept, 1.0, slope, k) for k in range(13)]
    chosen = policy.choose("draft")
    # within the noise of ~100 steps of memory per draft position, and of a per-token cost
    # learned from the ks the row takes (it does not step around its best k to measure it)
    assert rates[chosen] >= 0.95 * max(rates), (chosen, rates.index(max(rates)))


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
    """Asking twice in a step changes nothing; a source that is off is probed again, more
    rarely after each probe that fails, and soon again after one that is all accepted."""
    policy = AdaptiveK(max_k=8, probe_every=4)
    simulate(policy, accept=0.0, plain=0.01, slope=0.005, steps=300)
    assert policy.choose("draft") == 0
    probes = []
    for step in range(3000):
        first = policy.plan({"draft": 8})
        assert policy.plan({"draft": 8}) == first
        source, k = first
        if k:
            probes.append(step)
            observe_step(policy, source, k, 0, 0.01 + 0.005 * k)
        else:
            observe_plain(policy, 1, 0.01)
    assert len(probes) >= 5  # never switched off for good
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] <= policy.probe_max + 1  # backs off, up to a cap
    # A probe that is all accepted brings the next one close.
    due = policy.probes["draft"].due - policy.clock
    observe_step(policy, "draft", 2, 2, 0.02)
    assert policy.probes["draft"].due - policy.clock <= policy.probe_every < due


def test_a_draft_model_starts_off_and_is_probed_at_once():
    """Before anything is measured, a draft model (a forward per drafted token) is not used
    at a guessed cost, but probed; an n-gram arm at the same prior acceptance is used."""
    policy = AdaptiveK(max_k=8)
    observe_plain(policy, 4, 0.04)
    assert policy.choose("draft") == 0 and policy.choose("ngram:4") > 0
    assert policy.plan({"draft": 8}) == ("draft", policy.probe_k)


def test_a_probe_that_cost_more_than_modelled_spaces_the_next_one_out():
    """A draft probe also pays its catch-up on the skipped tokens (invisible to the clipped
    cost line): the measured loss sets the next probe's distance, within the budget."""
    def next_gap(probe_seconds: float) -> float:
        policy = AdaptiveK(max_k=8, probe_every=4)
        simulate(policy, accept=0.0, plain=0.01, slope=0.005, steps=300)
        policy.probes.pop("draft", None)
        observe_step(policy, "draft", 2, 0, probe_seconds)
        return policy.probes["draft"].due - policy.clock

    modelled, slow = next_gap(0.02), next_gap(0.2)  # 20 plain tokens' time: 19 lost
    assert slow > 2 * modelled
    assert slow == pytest.approx(min(19 / 0.005, 4 * AdaptiveK.probe_max))


def test_the_arms_switched_off_share_one_probe_budget():
    """Every arm off is probed, but all of them together within `probe_budget`: with five
    arms off each probe is spaced five times as far as one arm's alone."""
    def gap(arms: int) -> float:
        policy = AdaptiveK(max_k=8, probe_every=4)
        simulate(policy, accept=0.0, plain=0.01, slope=0.005, steps=300)
        policy.probes = {f"ngram:{n}": Probe(16, 0) for n in range(1, arms)}  # the others off
        # (the draft's own backoff forgotten: the budget alone spaces its next probe)
        observe_step(policy, "draft", 2, 0, 0.02)  # ~1 plain token's time lost
        return policy.probes["draft"].due - policy.clock

    assert AdaptiveK.probe_every < gap(1) < 4 * AdaptiveK.probe_max / 5  # (no cap binds)
    assert gap(5) == pytest.approx(5 * gap(1))


def test_plan_picks_the_better_source_within_what_is_offered():
    policy = AdaptiveK(max_k=8)
    observe_plain(policy, 4, 0.04)
    for _ in range(300):  # ngram: always accepted; draft: never
        for source, accept in (("ngram", True), ("draft", False)):
            observe_step(policy, source, 4, 4 if accept else 0, 0.012 + 0.001 * 4)
        observe_plain(policy, 2, 0.02)
    assert policy.plan({"ngram": 3, "draft": 8})[0] == "ngram"
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
    assert auto.policy is auto.policy_for(auto.proposer) and auto.policy.sources
    assert auto.policy.cost is auto.cost and auto.cost.seconds > 0  # the engine's, learning
    default = make_engine(target, "auto")
    assert default.policy.max_k == 8


def test_the_engine_reprobes_a_switched_off_source():
    """Through the engine: a draft that is never right gets switched off (plain stretches
    take over) and is still probed now and then, more rarely as probes keep failing."""
    target, _ = build_model("llama", seed=21, scale=4.0)
    draft, _ = build_model("llama", seed=23, layers=1, scale=4.0)
    engine = make_engine(target, "draft", draft_model=draft, num_draft=4, adaptive=True)
    policy = engine.policy
    policy.probe_every, policy.probe_max, policy.probe_budget = 8, 64, 0.05
    drafted_at = []
    observe = policy.observe

    def spy(source, drafted, accepted, seconds):
        if drafted:
            drafted_at.append(policy.clock)
        observe(source, drafted, accepted, seconds)

    policy.observe = spy
    rng = random.Random(5)
    total = 0
    for _ in range(12):
        prompt = [rng.randrange(1, 256) for _ in range(8)]
        out = engine.generate(prompt, max_tokens=60)
        total += out.stats.generated_tokens
    assert policy.choose("draft") == 0  # off
    late = [c for c in drafted_at if c > total / 2]
    assert len(late) >= 3  # ... and probed again, in the second half too
    assert len(drafted_at) < total / 8  # mostly plain


# ----------------------------------------------------------------------------- exactness at T > 0

from exact import SAMPLING, VOCAB, N, exact_distribution, min_pvalue  # noqa: E402

PROMPT = [1, 2, 3, 0, 1, 2]


class OnZero(Proposer):
    """Offers a fixed guess only right after a 0: plain stretches end on a sampled token."""

    name = "onzero"

    def available(self, context, cap):
        return {"onzero": cap} if context[-1] == 0 else {}

    def propose(self, context, num_draft, key, source=None):
        return Proposal(tokens=[1, 2, 3, 1][:num_draft], source="onzero")


def sample_counts(run, runs: int):
    counts = np.zeros((VOCAB,) * N)
    for seed in range(runs):
        counts[tuple(run(seed))] += 1
    return counts


@pytest.fixture(scope="module")
def tiny():
    target, _ = build_model("llama", seed=31, vocab=VOCAB, scale=2.0)
    draft, _ = build_model("llama", seed=32, layers=1, vocab=VOCAB, scale=2.0)
    return target, draft, exact_distribution(target, PROMPT)


def run_forced(target, seed, totals=None):
    cache = make_prompt_cache(target)
    target(mx.array(PROMPT[:-1])[None], cache=cache)
    context = list(PROMPT)
    stats = Stats()
    for _ in decode(target, cache, context, OnZero(), FixedK(4),
                                SamplingParams(**SAMPLING), N, seed, stats):
        pass
    if totals is not None:
        totals["drafted"] += stats.drafted
        totals["accepted"] += stats.accepted
    return context[len(PROMPT):]


def test_stretch_handoffs_are_exact_at_temperature(tiny, monkeypatch):
    """Stretches that end on a sampled token, the queued token read back, then a verified
    proposal: the distribution of the output is exact; noise not keyed by position breaks it."""
    target, _, exact = tiny
    totals = {"drafted": 0, "accepted": 0}  # PROMPT ends in 2: every run starts plain
    counts = sample_counts(lambda s: run_forced(target, s, totals), 800)
    assert min_pvalue(counts, exact, adjacent=True) > 1e-4
    assert totals["drafted"] > 400 and 0 < totals["accepted"] < totals["drafted"]
    salts = sampling_module.position_salts  # every position drawn with one position's noise
    monkeypatch.setattr(sampling_module, "position_salts",
                        lambda seed, positions: salts(seed, [0] * len(positions)))
    broken = sample_counts(lambda s: run_forced(target, s), 300)  # (far off: fewer runs)
    assert min_pvalue(broken, exact, adjacent=True) < 1e-4


def test_auto_is_exact_at_temperature_through_the_engine(tiny):
    target, draft, exact = tiny
    engine = make_engine(target, "auto", draft_model=draft, vocab=VOCAB, num_draft=4)

    def run(seed):
        return engine.generate(PROMPT, max_tokens=N, seed=seed, **SAMPLING).tokens

    assert min_pvalue(sample_counts(run, 800), exact, adjacent=True) > 1e-4
    assert engine.policy.sources  # it did speculate


class Recorder(FixedK):
    """FixedK(2) that keeps every step plain for `plain` plans, then proposes."""

    def __init__(self, plain: int):
        super().__init__(2)
        self.plain = plain

    def plan(self, available):
        self.plain -= 1
        return ("onzero", 2) if self.plain < 0 else ("", 0)


class Always(OnZero):
    def available(self, context, cap):
        return {"onzero": cap}


def primed_with_cost_spy(tiny, monkeypatch):
    """The tiny target, a cache holding PROMPT but its last token, and the list of what the
    loop tells the cost model, (proposed, synced, seconds) per step: where a stretch's timing
    shows."""
    target, _, _ = tiny
    cache = make_prompt_cache(target)
    target(mx.array(PROMPT[:-1])[None], cache=cache)
    added, add = [], StepCost.add

    def spy(self, rows, width, proposed, forwards, seconds, span=0, synced=True):
        added.append((proposed, synced, seconds))
        add(self, rows, width, proposed, forwards, seconds, span, synced)

    monkeypatch.setattr(StepCost, "add", spy)
    return target, cache, added


def test_a_plain_stretch_teaches_the_cost_model_steady_times_only(tiny, monkeypatch):
    """In a pipelined plain stretch each token's time is the wait between two tokens read
    back. Its first step is synced and learnt as such; its last (computed while the host
    planned, nothing queued after it) is not learnt: timed, it made plain decoding look
    several times cheaper than it is, and `auto` proposed too little."""
    target, cache, added = primed_with_cost_spy(tiny, monkeypatch)
    policy = Recorder(plain=6)
    steps = decode(target, cache, list(PROMPT), Always(), policy, SamplingParams(), 12,
                   0, Stats())
    tokens = 0
    for out in steps:
        tokens += len(out)
        if policy.plain < 0:  # the plan that ended the stretch was made
            break
    steps.close()
    plains = [(synced, s) for proposed, synced, s in added if not proposed]
    assert not any(proposed for proposed, _, _ in added)  # (nothing proposed yet)
    assert plains[0][0]  # the stretch's first step, synced
    assert all(not synced and s > 0 for synced, s in plains[1:])  # the pipelined ones
    assert len(plains) == tokens - 1 >= 5  # the token delivered as the stretch ended: unlearnt


def test_a_stretchs_first_step_is_not_charged_the_next_ones_queuing(tiny, monkeypatch):
    """A stretch's first step queues the next before reading its own tokens back; on MLX's
    CPU backend queuing runs most of that forward (`async_eval` waits while too many of the
    graph's tasks are in flight). Charged to the first step, it read as two forwards, and the
    cost model priced every synced step (speculative ones too) far above a plain one."""
    import time

    from mlxspec.batch_step import BatchSpeculator

    target, cache, added = primed_with_cost_spy(tiny, monkeypatch)
    queue = BatchSpeculator._queue

    def slow_queue(self, *args, **kwargs):  # a forward that blocks as the CPU backend's does
        time.sleep(0.2)
        queue(self, *args, **kwargs)

    monkeypatch.setattr(BatchSpeculator, "_queue", slow_queue)
    steps = decode(target, cache, list(PROMPT), Always(), Recorder(plain=4), SamplingParams(),
                   6, 0, Stats())
    for _ in steps:
        pass
    first = next(s for proposed, synced, s in added if synced and not proposed)
    assert 0.2 <= first < 0.38  # its own queuing, not the next step's too (>= 0.4)
    pipelined = [s for proposed, synced, s in added if not synced and not proposed]
    assert pipelined and all(0.2 <= s < 0.38 for s in pipelined)  # one queuing each


def test_a_row_alone_keeps_the_default_k_unless_another_pays_clearly_more():
    """`KEEP_DEFAULT`: where speculating pays, k = 4 unless another k's expected rate beats
    it by 3 %; the rate-maximising k otherwise (and plain decoding where nothing pays)."""
    cost = StepCost()
    seen = set()
    for accept in (0.2, 0.6, 0.75, 0.8, 0.85, 0.9, 0.99):
        offer = RowOffer(survival([accept] * 8, 8))
        (best,), best_rate = choose_ks(cost, [offer])
        (kept,), _ = choose_ks(cost, [offer], default=4)
        rate4 = (1 + sum(offer.survive[:4])) / cost.time(1, 5, 4)
        if best == 0:
            want = 0
        elif rate4 >= (1 - KEEP_DEFAULT) * best_rate:
            want = 4
        else:
            want = best
        assert kept == want, (accept, best, kept)
        seen.add("off" if not best else "kept" if want == 4 != best else "moved" if want != 4
                 else "same")
    assert {"kept", "moved"} <= seen, seen  # both sides of the rule were exercised
