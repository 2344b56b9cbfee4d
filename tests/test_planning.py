"""`planning.py`: a batch's k per row (`BatchPolicy`) and a row's side of it (`RowPolicy`)."""

import pytest
from batch_helpers import CHEAP_WIDTH, FrozenCost
from helpers import offers

from mlxspec.choose_k import RowOffer, survival
from mlxspec.planning import BatchPolicy


def test_plain_steps_alone_teach_the_batch_the_price_of_width():
    """Measured plain steps at different batch sizes and context lengths, no wide step ever
    taken: a query row costs 50 % of the intercept plus 50 % per 1024 keys. The fit prices a
    wide step from them (a padded position costs a row), and 60 % acceptance stops paying."""
    def seconds(rows, width, span):
        n = rows * width
        return 0.01 * (1 + 0.5 * n + 0.5 * n * (span + width) / 1024)

    learned = BatchPolicy()
    assert learned.decide(offers(0.6, 4), span=800) != [0, 0, 0, 0]  # the prior speculates
    for _ in range(10):
        for b in (2, 4, 6, 8):
            for span in (100, 400, 800, 1600):
                learned.cost.add(b, 1, 0, None, seconds(b, 1, span), span, synced=False)
    assert learned.cost.time(4, 3, 8, span=800, synced=False) == pytest.approx(
        seconds(4, 3, 800), rel=0.1)
    assert learned.decide(offers(0.6, 4), span=800, pipelined=True) == [0, 0, 0, 0]
    assert min(learned.decide(offers(0.99, 1, cap=8), span=100)) >= 6  # near-certain: pays


def test_a_probe_is_forced_only_where_its_arm_could_pay_in_the_batch():
    """A due probe widens the batch (forced) when the probed arm could pay at this batch's
    cost were it accepted at OPTIMISTIC; where width is dear (8 rows, a query row costing a
    whole intercept) it is offered unforced; and at most one forced step per probe_gap. (A
    lone draft row's probe does not pay even where width is cheap: its draft forwards
    serve one row of eight.)"""
    probe = ("ngram", RowOffer(survival([0.2] * 4, 4), forced=4, probe=True))
    others = [("ngram", RowOffer(survival([0.1] * 4, 4))) for _ in range(7)]
    dear = (1.0, 0.3, 1.0, 2.0, 0.01, 3.0)
    for prior, forced in ((CHEAP_WIDTH, 4), (dear, 0)):
        policy = BatchPolicy(FrozenCost(prior=prior))
        offers = policy.limit_probes([probe] + others, step=0, rows=8, span=100)
        assert offers[0][1].forced == forced and offers[1:] == others
        again = policy.limit_probes([probe] + others, step=1, rows=8, span=100)
        assert again[0][1].forced == 0  # the gap
    policy = BatchPolicy(FrozenCost(prior=CHEAP_WIDTH))
    lone_draft = ("draft", RowOffer(probe[1].survive, group="draft", forced=4, probe=True))
    assert policy.limit_probes([lone_draft] + others, step=0, rows=8,
                               span=100)[0][1].forced == 0


def test_a_row_alone_watches_a_free_arm_instead_of_probing_it():
    """A due probe of a free source (an n-gram arm switched off) is not proposed by a row
    alone: its plan stays plain, and the tokens the source would have proposed are compared
    with what the row commits, at most once every `probe_every` tokens; a source found right
    comes back on, a wrong one stays off without a proposal. A draft model's probe (it costs
    forwards, it cannot be watched) is still taken."""
    from mlxspec.planning import RowPolicy
    from mlxspec.policy import AdaptiveK

    text = list(range(100, 400))

    class Lookup:  # what the n-gram arm would propose: the text's continuation, or a miss
        def __init__(self, right):
            self.right, self.peeks = right, 0

        def peek(self, context, k, source):
            self.peeks += 1
            start = len(context) + (0 if self.right else 1)
            return text[start : start + k]

    for right in (True, False):
        policy = AdaptiveK(max_k=4)
        for _ in range(10):  # the arm measured wrong: off
            policy.observe_acceptance("ngram:2", 2, 0)
        assert policy.choose("ngram:2") == 0
        policy.probes.clear()  # its probe due now
        lookup = Lookup(right)
        planner = RowPolicy(policy, lookup, cost=policy.cost)
        context, plans = text[:10], []
        while len(context) < 210:
            source, k = planner.plan({"ngram:2": 4}, context)
            plans.append(source)
            if k:
                break
            context = text[: len(context) + 1]  # a plain step
            planner.observe("", 0, 0, None, context)
        assert lookup.peeks <= len(plans) / policy.probe_every + 1  # a watch per 16 tokens
        if right:  # back on after a few watches all right
            assert plans[-1] == "ngram:2" and len(plans) < 100
        else:  # never proposed
            assert set(plans) == {""} and policy.choose("ngram:2") == 0
    policy = AdaptiveK(max_k=4)
    assert RowPolicy(policy, Lookup(True), cost=policy.cost).plan({"draft": 4}, text[:10]) == (
        "draft", policy.probe_k)  # a draft's probe: taken
