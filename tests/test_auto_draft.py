"""`auto` and a draft model (issue 40, part 1): a sizeable draft of the target's family starts
from the acceptance such drafts earn, its catch-up on skipped context is not charged to its
steps, and each kind of request (plain text, chat, fill-in-the-middle, edit) learns its own
estimates, in memory and in the policy file."""

from __future__ import annotations

import pytest
from batch_helpers import drain
from conftest import build_model, make_engine, next_output, observe_plain, observe_step

from mlxspec.batch_step import BatchSpeculator
from mlxspec.policy import AdaptiveK
from mlxspec.policy_store import read_states
from mlxspec.proposers import auto
from mlxspec.proposers.auto import (
    SAME_FAMILY_ACCEPT,
    catch_up_pays,
    draft_policy,
    draft_priors,
)
from mlxspec.proposers.draft import CATCH_UP_APART, DraftModelProposer
from mlxspec.sampling import SamplingParams


def test_a_sizeable_draft_of_the_family_starts_optimistic():
    target, _ = build_model("llama", seed=1, hidden=64, layers=8)
    same, _ = build_model("llama", seed=2, hidden=64, layers=2)  # a third of its parameters
    tiny, _ = build_model("llama", seed=3, hidden=16, layers=1)
    other, _ = build_model("qwen3", seed=4, hidden=64, layers=2)
    priors = draft_priors(target, DraftModelProposer(same))
    assert priors["group_prior_accept"]["draft"] == SAME_FAMILY_ACCEPT
    assert 0.3 < priors["forward_prior"]["draft"] < 0.45  # its share of the parameters
    for weak in (tiny, other):
        assert "group_prior_accept" not in draft_priors(target, DraftModelProposer(weak))
    assert draft_priors(target, None) == {}
    # Such a draft is proposed from at once; the default prior probes it first.
    optimistic = draft_policy(target, DraftModelProposer(same))
    assert optimistic.cost.forward_prior["draft"] == priors["forward_prior"]["draft"]
    observe_plain(optimistic, 4, 4 * 0.1)
    assert optimistic.choose("draft") > 0
    assert AdaptiveK(cost=optimistic.cost).choose("draft") == 0


def test_a_draft_catching_up_times_it_apart():
    draft, _ = build_model("llama", seed=2)
    proposer = DraftModelProposer(draft, prefill_at_reset=False)
    context = list(range(1, 40))
    proposer.reset(context, SamplingParams())
    first = proposer.propose(context, 3, None)
    assert first.setup_seconds > 0 and len(context) - 1 > CATCH_UP_APART
    proposer.update(context + [int(t) for t in first.tokens.tolist()], 3)
    context = context + [int(t) for t in first.tokens.tolist()] + [7]
    assert proposer.propose(context, 3, None).setup_seconds == 0.0  # one token behind


def test_each_kind_of_request_learns_its_own_policy(tmp_path):
    target, _ = build_model("llama", seed=1)
    draft, _ = build_model("llama", seed=2, layers=1)
    engine = make_engine(target, "auto", draft_model=draft)
    # (ByteTokenizer has no special tokens: text, or an edit with a predicted output)
    assert engine.workload_signal([1, 2, 3], None) == ""
    assert engine.workload_signal([1, 2, 3], [1, 2]) == "edit"
    engine.signal_ids = {100: "fim", 101: "chat"}
    assert engine.workload_signal([5, 101, 6], None) == "chat"
    assert engine.workload_signal([5, 101, 100], None) == "fim"
    plain = engine.policy_for(engine.proposer)
    assert plain is engine.policy
    fim = engine.policy_for(engine.proposer, "fim")
    assert fim is not plain and fim is engine.policy_for(engine.proposer, "fim")
    engine.keep_policies(tmp_path / "policy.json")
    unit = [5, 9, 13, 17, 21, 25, 29]
    engine.generate(unit * 6, max_tokens=24)
    engine.generate(unit * 6, max_tokens=64, prediction=unit * 12)
    # a step costs what it costs whatever the kind of request: one cost model for all
    chat = engine.policy_for(engine.proposer, "chat")
    assert not chat.sources and chat.cost is plain.cost is fim.cost is engine.cost
    assert engine.cost.seconds > 0
    engine.save_policies()
    states = read_states(tmp_path / "policy.json")
    assert {"auto", "auto/edit", "step-cost"} <= set(states)
    # The next engine starts each kind from its own state.
    again = make_engine(target, "auto", draft_model=draft)
    again.keep_policies(tmp_path / "policy.json")
    assert set(again.policy_for(again.proposer, "edit").sources) == set(
        states["auto/edit"]["sources"])
    assert not again.policy_for(again.proposer, "fim").sources
    assert again.cost.groups == engine.cost.groups and 0 < again.cost.xx[0, 0] <= 8.0


def test_a_catch_up_the_rest_of_the_request_cannot_repay_is_not_started():
    """The coder pair on this CPU: a plain token 0.33 s, the target's prefill 27 ms a token,
    the draft a third of it. A 40-token fill-in-the-middle answer after 1,400 prompt tokens
    cannot repay the draft's catch-up (13 s); a chat answer after 300 can, and so can a
    request whose draft is a few tokens behind."""
    target, _ = build_model("llama", seed=1, hidden=64, layers=8)
    same, _ = build_model("llama", seed=2, hidden=64, layers=2)
    policy = draft_policy(target, DraftModelProposer(same))
    assert 0.3 < policy.draft_ratio < 0.4
    # no step's cost measured yet: a plain step is judged at its lower bound (8 x 27 ms)
    assert not catch_up_pays(policy, 1400, 40, 0.027) and catch_up_pays(policy, 140, 40, 0.027)
    observe_plain(policy, 4, 4 * 0.33)
    assert policy.choose("draft") > 0  # a same-family draft: on from its priors
    assert not catch_up_pays(policy, 1400, 40, 0.027)
    assert catch_up_pays(policy, 300, 128, 0.027) and catch_up_pays(policy, 20, 2, 0.027)
    # not measured yet, it is judged as a draft that pays would: a 40-token chat answer after a
    # 300-token prompt is worth it (judged at the prior it was not, and nothing measured)
    assert catch_up_pays(policy, 300, 40, 0.027)
    # measured at 94 % acceptance it saves more per token: a longer catch-up pays
    for _ in range(20):
        observe_step(policy, "draft", 4, 4, 0.6)
    assert catch_up_pays(policy, 1400, 256, 0.027) and not catch_up_pays(policy, 1400, 40, 0.027)
    # a draft the estimates keep off is probed only for a catch-up within 2 % of the request
    off = AdaptiveK(draft_ratio=0.34)
    observe_plain(off, 4, 4 * 0.33)
    assert off.choose("draft") == 0
    assert catch_up_pays(off, 60, 256, 0.027) and not catch_up_pays(off, 300, 128, 0.027)
    assert catch_up_pays(AdaptiveK(), 1400, 40, 0.027)  # no draft model: nothing to refuse


def test_auto_offers_its_draft_only_where_the_catch_up_pays(monkeypatch):
    target, _ = build_model("llama", seed=1, hidden=64, layers=4)
    draft, _ = build_model("llama", seed=2, hidden=64, layers=2)
    prompt = [(7 * i) % 251 for i in range(56)]  # nothing for prompt lookup to match
    seen = []

    def judged(policy, behind, remaining, prefill_per_token):
        seen.append((behind, remaining, prefill_per_token))
        return pays

    monkeypatch.setattr(auto, "catch_up_pays", judged)
    for pays in (False, True):
        seen.clear()
        engine = make_engine(target, "auto", draft_model=draft)  # (no store of the last run)
        assert engine.policy.draft_ratio > 0.3
        stats = engine.generate(prompt + [3], max_tokens=24).stats
        drafted = sum(n for s, n in stats.drafted_by_source.items() if "draft" in s)
        assert seen and (drafted > 0) == pays, (pays, stats.drafted_by_source)
        behind, remaining, per_token = seen[0]
        assert behind >= len(prompt) - 1 and 0 < remaining <= 24 and per_token > 0
    # a prompt its cache already holds: judged at the engine's last prefill rate
    seen.clear()
    engine.generate(prompt + [3], max_tokens=4)
    assert seen and seen[0][2] == engine.prefill_seconds_per_token > 0


def test_a_draft_that_will_pay_reads_the_prompt_with_the_targets_prefill(monkeypatch):
    """Where the policy expects the draft to repay its catch-up over the request, `auto`'s
    draft reads the prompt at the start (prefill time, as the `draft` mode's does), not at its
    first proposal (decode time); where not, it stays behind. A fresh engine's first request
    too (judged at a plain step's lower bound, `DECODE_OVER_PREFILL`)."""
    target, _ = build_model("llama", seed=1, hidden=64, layers=4)
    draft, _ = build_model("llama", seed=2, hidden=64, layers=2)
    prompts = [[(k * i) % 251 for i in range(60)] + [3] for k in (7, 11, 13)]
    caught = []
    real = DraftModelProposer.catch_up

    def spy(self, prompt):
        real(self, prompt)
        caught.append((len(prompt), list(self.cached)))

    monkeypatch.setattr(DraftModelProposer, "catch_up", spy)
    engine = make_engine(target, "auto", draft_model=draft)
    want = make_engine(target, "none").generate(prompts[1], max_tokens=12).tokens
    monkeypatch.setattr(auto, "catch_up_pays", lambda policy, *a: True)
    assert not engine.cost.seconds  # nothing measured yet
    result = engine.generate(prompts[1], max_tokens=12)
    assert caught == [(len(prompts[1]), prompts[1][:-1])]
    assert result.tokens == want and result.stats.prefill_seconds > 0
    monkeypatch.setattr(auto, "catch_up_pays", lambda policy, *a: False)
    caught.clear()
    engine.generate(prompts[2], max_tokens=12)
    assert not caught

    # A request joining rows already decoding leaves it to its first draft proposal: a
    # shared batch rarely takes a draft (a wider step costs every row).
    monkeypatch.setattr(auto, "catch_up_at_start", lambda policy, *a: True)
    batch = BatchSpeculator(target)
    first = engine.clone().join(batch, prompts[0], max_tokens=12)
    next_output(batch, first)
    caught.clear()
    joiner = engine.clone().join(batch, prompts[1], max_tokens=12)
    next_output(batch, joiner)
    assert not caught
    outs = [[], []]
    drain(batch, [first, joiner], outs)
    assert joiner.context[len(prompts[1]):] == want


@pytest.mark.parametrize("batched", [False, True])
def test_a_free_source_is_measured_while_the_draft_runs(batched):
    """Where `auto` runs its draft, what the free source that offered most would have proposed
    is compared with what the row commits (`RowPolicy.plan`): prompt lookup, as right as the
    draft and free, takes over; without it the draft's same-family prior alone kept the draft
    on (the coder pair on a prompt its answer copies: 0.40x the commit before, 4 draft
    forwards a step for what lookup proposes for nothing). `batched`: a row of a batch, which
    offers its source (`RowPolicy.offer`) and proposes what it offered."""
    from mlxspec.planning import RowPolicy

    target, _ = build_model("llama", seed=1, hidden=64, layers=8)
    same, _ = build_model("llama", seed=2, hidden=64, layers=2)
    text = list(range(10, 90))

    class Lookup:  # prompt lookup, right every time: the text's continuation
        def peek(self, context, k, source):
            return text[len(context) : len(context) + k]

    chosen = {}
    for watching in (True, False):
        policy = draft_policy(target, DraftModelProposer(same), max_k=4)
        observe_plain(policy, 4, 4 * 0.1)
        planner = RowPolicy(policy, Lookup(), cost=policy.cost)
        context = text[:10]
        sources = []
        while len(context) < 60:
            available, seen = {"draft": 4, "ngram:4": 4}, context if watching else None
            if batched:
                source, offer = planner.offer(available, seen)
                k = len(offer.survive)
            else:
                source, k = planner.plan(available, seen)
            sources.append(source)
            context = text[: len(context) + k + 1]  # every proposal accepted
            planner.observe(source, k, k, None, context)
        chosen[watching] = sources
    assert chosen[True][0] == "draft" and set(chosen[False]) == {"draft"}
    assert chosen[True][-1] == "ngram:4" and chosen[True].count("draft") <= 3
