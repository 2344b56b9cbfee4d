"""The batched speculative step (`mlxspec/batch_step.py`): B requests with their own sources
and k, one target forward, ragged acceptance; every request's output equals the request decoded
alone (greedy: token-identical in float32; sampled: exact in distribution, and seeded output
independent of the rest of the batch); requests join and leave between steps."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from batch_helpers import (
    CHEAP_WIDTH,
    REQUESTS,
    FrozenCost,
    OwnPlans,
    alone,
    drain,
    frozen_batch,
    joins_and_leaves,
    open_in,
)
from conftest import build_model, make_engine, next_output, observe_plain, observe_step

from mlxspec import caches
from mlxspec.batch_step import BatchSpeculator
from mlxspec.caches.ragged import RaggedKVCache
from mlxspec.engine import PromptCache
from mlxspec.errors import MlxspecError
from mlxspec.planning import BatchPolicy
from mlxspec.prefill import prefill
from mlxspec.proposers.base import Proposal
from mlxspec.sampling import SamplingParams
from mlxspec.step import decode_step

GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def pair():
    target, _ = build_model("llama", seed=1, scale=4.0)
    draft, _ = build_model("llama", seed=2, layers=1, scale=4.0)
    return target, draft


def greedy_path(model, prompt: list[int], n: int) -> list[int]:
    """The target's greedy continuation, by uncached forwards."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(mx.argmax(model(mx.array([seq]))[0, -1]).item()))
    return seq[len(prompt):]


def prefilled(engine, tokens: list[int]) -> list:
    """A single-request cache holding tokens[:-1]."""
    pc = PromptCache()
    prefill(engine.target, tokens, pc, None)
    return pc.cache


def test_one_forward_verifies_every_row_with_ragged_acceptance(pair):
    """Three rows in one step: the first two proposals are right for 2 of 4 and 0 of 3
    tokens, the third entirely (plus a row proposing nothing); each row keeps exactly its own
    accepted tokens and its cache equals a fresh prefill of what it committed."""
    target, _ = pair
    engine = make_engine(target)
    prompts = [[1, 2, 3, 4, 5], list(range(20, 50)), [9, 9, 8], [40, 41]]
    paths = [greedy_path(target, p, 5) for p in prompts]
    drafts = [paths[0][:2] + [(paths[0][2] + 1) % 256, 7],
              [(paths[1][0] + 3) % 256, 1, 2],
              paths[2][:4],
              []]
    cache = [RaggedKVCache() for _ in range(len(target.layers))]
    for p in prompts:
        for ragged, c in zip(cache, prefilled(engine, p)):
            ragged.add_row(c)
    proposals = [Proposal(mx.array(d, mx.uint32), source="test") if d else None for d in drafts]
    results = decode_step(target, cache, [p[-1] for p in prompts], proposals,
                          [GREEDY] * 4, [None] * 4, [None] * 4)
    assert [r.accepted for r in results] == [2, 0, 4, 0]
    assert [r.drafted for r in results] == [4, 3, 4, 0]
    for r, path in zip(results, paths):
        assert r.tokens == path[: r.accepted + 1]
    for b, (p, r) in enumerate(zip(prompts, results)):
        committed = p + r.tokens
        fresh = prefilled(engine, committed)
        assert cache[0].lengths[b] == len(committed) - 1
        for ragged, c in zip(cache, fresh):
            n = c.offset
            np.testing.assert_allclose(np.array(ragged.keys[b, :, :n]),
                                       np.array(c.keys[0, :, :n]), atol=1e-5)
            np.testing.assert_allclose(np.array(ragged.values[b, :, :n]),
                                       np.array(c.values[0, :, :n]), atol=1e-5)
    # max_accept caps a row (its budget), whatever the proposal
    row = [RaggedKVCache() for _ in range(len(target.layers))]
    for ragged, c in zip(row, prefilled(engine, prompts[2])):
        ragged.add_row(c)
    (r,) = decode_step(target, row, [prompts[2][-1]], [proposals[2]], [GREEDY], [None],
                             [1])
    assert (r.accepted, r.drafted, r.tokens) == (1, 1, paths[2][:2])








def test_batch_equals_each_request_alone_with_joins_and_leaves(pair):
    joins_and_leaves(pair)


def test_rows_leave_empty_slots_that_joiners_fill_and_the_batch_compacts(pair):
    """A row that leaves empties its slot (no copy of the batch), the next request is
    written into it, and once half the slots are empty the batch is compacted; outputs equal
    each request alone throughout."""
    target, draft = pair
    base = make_engine(target, mode="ngram", draft_model=draft)

    def started(reqs, opened):
        """The batch after `opened` of `reqs` ran 3 rounds; the others open later."""
        batch, rows, outs = BatchSpeculator(target), [], [[] for _ in reqs]
        opener = open_in(batch, lambda i: base.clone(), reqs, rows)
        for i in range(opened):
            opener(i)()
        drain(batch, rows, outs, rounds=3)
        return alone(base, reqs), batch, rows, outs, opener

    want, batch, rows, outs, opener = started([REQUESTS[i] for i in (0, 2, 4, 5, 7)], 4)
    batch.close(rows[1])  # leaves: its slot empties, the batch is not copied
    assert batch.slots[1] is None and len(batch.slots) == 4
    assert batch.cache.layers[0].keys.shape[0] == 4
    opener(4)()  # the next request takes the empty slot, at its first read (its prefill)
    assert batch.slots[1] is None
    outs[4].extend(next_output(batch, rows[4]).tokens)
    assert batch.slots[1] is rows[4] and len(batch.slots) == 4
    batch.close(rows[2])
    batch.close(rows[3])  # half the slots empty: compacted to the two rows left
    assert batch.slots == [rows[0], rows[4]] and batch.cache.layers[0].keys.shape[0] == 2
    drain(batch, rows, outs)
    assert outs[0] == want[0] and outs[4] == want[4]
    for i in (1, 2, 3):
        assert outs[i] == want[i][: len(outs[i])]

    # In a pipelined plain stretch: a request joining in a new slot, then two leaving (the
    # batch compacts): the rows left decode on as alone.
    plain = [(list(range(3, 30)), "none", 20, {}), ([7, 1, 9, 4], "none", 12, {}),
             (list(range(100, 120)), "none", 18, {}), ([50, 60, 70], "none", 15, {})]
    want, batch, rows, outs, opener = started(plain, 3)
    opener(3)()
    outs[3].extend(next_output(batch, rows[3]).tokens)  # its first token: from its prefill
    assert len(batch.slots) == 4
    batch.close(rows[0])
    batch.close(rows[1])
    assert batch.slots == [rows[2], rows[3]]
    drain(batch, rows, outs)
    assert outs[2:] == want[2:] and batch.pipelined > 0


def test_a_request_alone_in_the_batch_and_its_prompt_cache(pair):
    """One row runs the engine's own loop (the same steps: the same forwards); closing it
    gives its cache back holding all but the last token, and the next request reuses it as
    a prompt-cache prefix."""
    target, _ = pair
    base = make_engine(target, mode="ngram")
    prompt = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2]
    alone = base.clone().generate(prompt, max_tokens=20)
    want = alone.tokens
    batch = BatchSpeculator(target)
    engine = base.clone()
    pc = PromptCache()
    row = engine.join(batch, prompt, max_tokens=20, prompt_cache=pc)
    outs = [list(next_output(batch, row).tokens)]  # alone in its round: prefilled as the engine does
    assert batch.cache.alone and pc.cache is None  # on its own cache, held by the batch
    drain(batch, [row], outs)
    assert outs[0] == want
    assert row.stats.target_forwards == alone.stats.target_forwards
    assert pc.tokens == (prompt + want)[:-1] and caches.offset(pc.cache) == len(pc.tokens)
    follow = prompt + want + [7, 8]
    again = engine.generate(follow, max_tokens=10, prompt_cache=pc)
    assert again.stats.cached_tokens == len(prompt) + len(want) - 1
    assert again.tokens == base.clone().generate(follow, max_tokens=10).tokens


def test_a_lone_row_moves_into_the_batch_when_another_joins(pair):
    """A row runs alone (on its own cache, planned by its own policy) for a few steps, then
    another joins: both continue in the batch, planned by the batch's policy, each output
    equal to the request alone (the first row's cache moved in holding exactly its tokens but
    the last); once both leave, a next row would run on its own cache again."""
    target, _ = pair
    base = make_engine(target, mode="auto")
    reqs = [(list(range(3, 40)), "auto", 30, {}), ([1, 2, 3, 4, 5, 6] * 3, "ngram", 20, {})]
    want = alone(base, reqs)
    batch = BatchSpeculator(target)
    rows = [base.clone().join(batch, reqs[0][0], max_tokens=30, mode="auto")]
    outs = [[], []]
    for _ in range(5):
        outs[0].extend(next_output(batch, rows[0]).tokens)
    assert batch.slots == rows[:1] and batch.cache.alone  # on its own cache
    assert batch.regime.own_row is rows[0] and batch.regime.plans_by_row
    rows.append(base.clone().join(batch, reqs[1][0], max_tokens=20, mode="ngram"))
    outs[1].extend(next_output(batch, rows[1]).tokens)  # its prefill; the lone row moves in
    assert not batch.cache.alone
    assert batch.regime.own_row is None and not batch.regime.plans_by_row
    assert not batch.regime.replans_each_step and not batch.regime.trees
    assert batch.slots == rows  # two rows wide: no empty slot fed padding every step
    drain(batch, rows, outs)
    assert outs == want
    assert batch.steps > 0
    assert not batch.rows and batch.cache.alone and batch.regime.plans_by_row


def test_two_rows_cannot_share_a_prompt_cache_even_while_one_prefills_in_chunks(pair):
    """A second request on the prompt cache of a row still prefilling a chunk per step would
    trim that cache under it: refused, and the first row decodes as alone."""
    target, _ = pair
    base = make_engine(target, mode="none")
    prompt = list(range(3, 60))
    want = alone(base, [(prompt, "none", 6, {})])
    batch, pc = BatchSpeculator(target), PromptCache()
    row = base.clone().join(batch, prompt, max_tokens=6, prompt_cache=pc, prefill_chunk=8)
    assert batch.admission.prefilling == [row]
    with pytest.raises(MlxspecError, match="cannot share a prompt cache"):
        base.clone().join(batch, [5, 6, 7], max_tokens=4, prompt_cache=pc)
    outs = [[]]
    drain(batch, [row], outs)
    assert outs == want


def test_one_token_prompts_have_nothing_cached(pair):
    """A one-token prompt joins with an empty cache, first alone, then beside others."""
    target, _ = pair
    base = make_engine(target, mode="ngram")
    reqs = [([5], "ngram", 12, {}), ([6], "none", 9, {}), (list(range(30, 60)), "ngram", 10, {})]
    want = alone(base, reqs)
    batch = BatchSpeculator(target)
    rows, outs = [], [[] for _ in reqs]

    opener = open_in(batch, lambda i: base.clone(), reqs, rows)

    opener(0)()
    opener(1)()
    drain(batch, rows, outs, join={2: opener(2)})
    assert outs == want


def test_seeded_sampling_does_not_depend_on_the_rest_of_the_batch(pair):
    target, draft = pair
    base = make_engine(target, mode="draft", draft_model=draft)
    kw = dict(max_tokens=24, temperature=0.8, top_p=0.9, seed=11)
    prompt = list(range(10, 40)) * 2

    def run(companions):
        batch = BatchSpeculator(target)
        rows = [base.clone().join(batch, prompt, **kw)]
        for p, m, n, extra in companions:
            rows.append(base.clone().join(batch, p, max_tokens=n, mode=m, temperature=1.0,
                                   seed=len(rows), **extra))
        outs = [[] for _ in rows]
        drain(batch, rows, outs)
        return outs[0]

    first = run([])
    assert len(first) == 24
    assert run(REQUESTS[:3]) == first
    assert run(REQUESTS[3:7]) == first


class Counting:
    """The model, counting its forwards (the shapes of their inputs)."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def __call__(self, inputs, cache=None):
        self.calls.append(tuple(inputs.shape))
        return self.model(inputs, cache=cache)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_the_joiners_of_a_round_prefill_together_in_one_forward(pair):
    """Rows opened before the batch's next step prefill in one forward over what their prompts
    have not cached (the last token too): each row's first token is the target's after its
    whole prompt, read without a batched step, and its cache then holds the whole prompt. A
    prompt with more than GROUP_PREFILL_MAX tokens left prefills alone, at `open`. Outputs
    equal each request alone."""
    from mlxspec.prefill import GROUP_CACHED_MAX, GROUP_PREFILL_MAX

    target, _ = pair
    counted = Counting(target)
    base = make_engine(counted, mode="none")
    long_prompt = list(range(1, GROUP_PREFILL_MAX + 3))
    much_cached = [(7 * i) % 250 + 1 for i in range(GROUP_CACHED_MAX + 10)]
    reqs = [(list(range(3, 40)), "none", 9, {}), ([7, 1, 9], "none", 7, {}),
            ([5], "none", 6, {}), (list(range(50, 85)), "none", 8, {}),
            (much_cached, "none", 6, {}), (long_prompt, "none", 5, {})]
    want = alone(base, reqs)
    cached = [PromptCache(), PromptCache()]  # 30 tokens of the fourth prompt; all but 4 of
    prefill(base.clone().target, reqs[3][0][:31], cached[0], None)  # the fifth
    prefill(base.clone().target, much_cached[:-3], cached[1], None)
    batch = BatchSpeculator(counted)
    counted.calls.clear()
    rows = [base.clone().join(batch, p, max_tokens=n,
                       prompt_cache=cached[i - 3] if i in (3, 4) else None)
            for i, (p, _, n, _) in enumerate(reqs)]
    # the first by itself at open (the batch was empty: all but its last token), the long one
    # at open too
    assert counted.calls == [(1, len(reqs[0][0]) - 1), (1, len(long_prompt) - 1)]
    assert not rows[0].waiting and not rows[5].waiting
    assert all(r.waiting for r in rows[1:5])
    outs = [[]] + [list(next_output(batch, r).tokens) for r in rows[1:5]]
    # the row with much cached alone on its own cache (4 tokens), the others in one forward:
    # 3, 1 and 35 - 30 tokens, padded to the widest
    assert counted.calls[2:4] == [(1, 4), (3, 5)]
    assert [o[0] for o in outs[1:]] == [greedy_path(target, p, 1)[0] for p, _, _, _ in reqs[1:5]]
    assert rows[3].stats.cached_tokens == 30
    assert rows[4].stats.cached_tokens == len(much_cached) - 4
    for row, (p, _, _, _) in zip(rows[1:5], reqs[1:5]):
        b = batch.slots.index(row)
        assert batch.cache.layers[0].lengths[b] >= len(p)  # (and what its steps added)
        fresh = prefilled(base, p + [0])  # holds p
        assert mx.allclose(batch.cache.layers[0].keys[b : b + 1, :, : len(p), :],
                           fresh[0].keys[..., : len(p), :], atol=1e-4).item()
    outs.append([])
    drain(batch, rows, outs)
    assert outs == want


def test_a_long_prompt_prefills_a_chunk_per_step_while_the_others_decode(pair):
    """With `prefill_chunk`, a long prompt is prefilled that many tokens per step while the
    batch's other rows decode (fed every round); its rest then joins as a round's joiner; its
    answer and cached count are as alone. One closed mid-prefill leaves its prompt cache
    holding what was prefilled; alone (`Engine.stream_steps`) each chunk's step yields None."""
    target, _ = pair
    counted = Counting(target)
    base = make_engine(counted, mode="none")
    long_prompt = [(5 * i) % 200 + 1 for i in range(100)]
    reqs = [([7, 1, 9], "none", 12, {}), (long_prompt, "none", 6, {})]
    want = alone(base, reqs)
    pc = PromptCache()
    prefill(base.clone().target, long_prompt[:20], pc, None)  # 19 tokens cached
    batch = BatchSpeculator(counted)
    rows, outs = [base.clone().join(batch, reqs[0][0], max_tokens=12)], [[], []]

    def one_round():
        produced = batch.step()
        for row, out in zip(rows, outs):
            got = row.output(produced)
            if got is not None:
                out.extend(got.tokens)

    one_round()
    counted.calls.clear()
    rows.append(base.clone().join(batch, long_prompt, max_tokens=6, prompt_cache=pc,
                           prefill_chunk=32))
    assert counted.calls == [] and rows[1] in batch.admission.prefilling  # nothing prefilled at open
    fed = len(outs[0])
    one_round()
    one_round()
    assert [c for c in counted.calls if c[1] > 1] == [(1, 32), (1, 32)]  # 19 + 64 cached
    assert len(outs[0]) == fed + 2 and outs[1] == []
    one_round()  # the last 16 and the last token, as a joiner: its first token
    assert [c for c in counted.calls if c[1] > 1][2] == (1, 17) and len(outs[1]) >= 1
    for _ in range(40):
        if all(r.ended for r in rows):
            break
        one_round()
    assert outs == want and rows[1].stats.cached_tokens == 19
    for r in rows:
        batch.close(r)

    pc = PromptCache()
    row = base.clone().join(batch, long_prompt, max_tokens=6, prompt_cache=pc,
                     prefill_chunk=32)
    batch.step()
    batch.close(row)  # mid-prefill: the cache keeps the chunk
    assert pc.tokens == long_prompt[:32] and caches.offset(pc.cache) == 32
    assert not batch.admission.prefilling and not batch.rows

    steps = list(base.clone().stream_steps(long_prompt, max_tokens=6, prefill_chunk=32))
    assert steps[:3] == [None] * 3 and None not in steps[3:]  # 3 chunks of 32, then the rest
    assert [t for out in steps[3:] for t in out.tokens] == want[1]


def test_a_joiner_whose_queued_step_lost_every_row_still_decodes(pair):
    """A row joins while a plain step is queued for others, and all of those leave before
    reading it: the joiner runs the queued step itself (it used to answer empty outputs for
    ever, the server's worker spinning)."""
    target, _ = pair
    base = make_engine(target, mode="none")
    reqs = [(list(range(3, 30)), "none", 20, {}), ([7, 1, 9, 4], "none", 20, {}),
            ([50, 60, 70], "none", 12, {})]
    want = alone(base, reqs)
    batch = BatchSpeculator(target)
    rows = [base.clone().join(batch, p, max_tokens=n) for p, _, n, _ in reqs[:2]]
    outs = [[], [], []]
    drain(batch, rows, outs, rounds=3)
    rows.append(base.clone().join(batch, reqs[2][0], max_tokens=reqs[2][2]))
    outs[2].extend(next_output(batch, rows[2]).tokens)  # its prefill's token
    batch.close(rows[0])
    batch.close(rows[1])
    for _ in range(reqs[2][2] + 2):  # bounded: a livelock fails here, not hangs
        try:
            outs[2].extend(next_output(batch, rows[2]).tokens)
        except StopIteration:
            break
    assert outs[2] == want[2]


def test_a_joiner_that_fails_or_leaves_before_its_prefill_affects_no_other(pair, monkeypatch):
    """Of the rows opened in one round, one closes before the prefill (its prompt cache then
    holds what it reused) and one fails after it (its read raises the error, its cache is not
    kept); the others decode as alone, and the batch holds only them."""
    target, _ = pair
    base = make_engine(target, mode="none")
    reqs = [([7, 1, 9], "none", 8, {}), (list(range(3, 20)), "none", 7, {}),
            ([40, 41, 42, 43], "none", 9, {}), ([5, 6], "none", 6, {})]
    want = alone(base, reqs)
    batch = BatchSpeculator(target)
    pcs = [PromptCache() for _ in reqs]
    prefill(base.clone().target, reqs[1][0][:10], pcs[1], None)
    failing = base.clone()
    from mlxspec import admission

    start_proposer = admission.start_proposer

    def broken(target, req, seconds, cached, **kw):
        if req.pc is pcs[2]:  # the third request's
            raise MemoryError("no memory for the draft")
        start_proposer(target, req, seconds, cached, **kw)

    monkeypatch.setattr(admission, "start_proposer", broken)
    engines = [base.clone(), base.clone(), failing, base.clone()]
    rows = [e.join(batch, p, max_tokens=n, prompt_cache=pc)
            for e, (p, _, n, _), pc in zip(engines, reqs, pcs)]
    batch.close(rows[1])
    assert pcs[1].tokens == reqs[1][0][:9] and caches.offset(pcs[1].cache) == 9
    outs = [list(next_output(batch, rows[0]).tokens), [], [], []]
    with pytest.raises(MemoryError, match="no memory"):
        next_output(batch, rows[2])
    assert pcs[2].cache is None and pcs[2].tokens == []
    batch.close(rows[2])
    assert batch.rows == [rows[0], rows[3]] and rows[2] not in batch.slots
    drain(batch, [rows[0], rows[3]], [outs[0], outs[3]])
    assert outs[0] == want[0] and outs[3] == want[3]


def test_plain_stretches_run_pipelined_and_stay_exact(pair):
    """Where no row proposes, the next batched forward is queued before the tokens are read
    back. Outputs equal each request alone while rows join, finish and leave mid-stretch; the
    cache a row gives back (leaving with a step queued) holds exactly its tokens but the last;
    sampled rows draw the same tokens as without pipelining."""
    target, _ = pair
    base = make_engine(target, mode="none")
    reqs = [(list(range(3, 40)), "none", 30, {}), ([7, 1, 9, 4], "none", 12, {}),
            (list(range(100, 130)), "ngram", 25, {}), ([50, 60, 70], "none", 20, {}),
            ([11, 12], "none", 16, {})]
    want = alone(base, reqs)
    batch = BatchSpeculator(target)
    rows, outs, pcs = [], [[] for _ in reqs], []

    opener = open_in(batch, lambda i: base.clone(), reqs, rows, pcs)

    for i in range(3):
        opener(i)()
    drain(batch, rows, outs, close_at={0: 9}, join={4: opener(3), 11: opener(4)})
    # (an output may carry two tokens: a row that did not read before the next step)
    assert outs[0] == want[0][: len(outs[0])] and 9 <= len(outs[0]) < len(want[0])
    assert outs[1:] == want[1:]
    # pipelined stretches: rows reaching their ends and leaving do not break one; a round of
    # joiners ends it (two here), the ngram row's proposals too
    assert batch.pipelined > 10 and batch.pipelined >= 0.75 * batch.steps
    context = reqs[0][0] + outs[0]  # left with a step queued: trimmed back
    assert pcs[0].tokens == context[:-1] and caches.offset(pcs[0].cache) == len(context) - 1
    fresh = prefilled(base, context)
    assert mx.allclose(pcs[0].cache[0].keys[..., : len(context) - 1, :],
                       fresh[0].keys[..., : len(context) - 1, :], atol=1e-4).item()

    # A row that joins while a step is queued, read before the others (as a server may):
    # its first token at once (from its prefill, no step run for it), then it joins the next.
    batch = BatchSpeculator(target)
    first = [base.clone().join(batch, p, max_tokens=n) for p, _, n, _ in reqs[:2]]
    got = [[] for _ in reqs[:3]]
    for _ in range(3):
        for i, r in enumerate(first):
            got[i].extend(next_output(batch, r).tokens)
    late = base.clone().join(batch, reqs[2][0], max_tokens=reqs[2][2])
    got[2].extend(next_output(batch, late).tokens)
    assert len(got[2]) == 1
    drain(batch, first + [late], got)
    assert got == alone(base, [(p, "none", n, kw) for p, _, n, kw in reqs[:3]])

    def sampled(pipeline: bool) -> list[list[int]]:
        b = BatchSpeculator(target, pipeline=pipeline)
        rs = [base.clone().join(b, p, max_tokens=n, temperature=1.0, seed=i)
              for i, (p, _, n, _) in enumerate(reqs)]
        got = [[] for _ in rs]
        drain(b, rs, got)
        assert (b.pipelined > 0) == pipeline
        return got

    assert sampled(True) == sampled(False)


def test_a_plain_stretch_of_shared_rows_asks_the_policy_less_often_while_none_would_propose(
        pair):
    """Shared rows in a plain stretch ask the policy after 4 steps, then at gaps doubling to
    16 while no row would propose (asking reads every row's offer, not hidden by the forward
    on the CPU); the outputs stay each request's alone."""
    target, _ = pair
    base = make_engine(target, mode="ngram")
    reqs = [(list(range(3, 20)), "ngram", 60, {}), (list(range(40, 52)), "ngram", 60, {}),
            (list(range(70, 90)), "ngram", 60, {})]
    want = alone(base, reqs)
    batch = BatchSpeculator(target)
    asked = []  # the pipelined step count at each asking within the stretch
    plans = batch._plans

    def no_proposals(rows, commit=True):
        plans(rows, commit)
        if not commit:
            asked.append(batch.pipelined)
        return [("", 0)] * len(rows)

    batch._plans = no_proposals
    rows, outs = [], [[] for _ in reqs]
    opener = open_in(batch, lambda i: base.clone(), reqs, rows)
    for i in range(3):
        opener(i)()
    drain(batch, rows, outs)
    assert outs == want
    gaps = [b - a for a, b in zip(asked, asked[1:])]
    assert asked and gaps[:3] == [8, 16, 16] and set(gaps) == {8, 16}, asked


def test_refuses_what_it_cannot_batch():
    from families import build

    from mlxspec.errors import MlxspecError

    gemma = build("gemma3_text", seed=0, sliding_window=4)
    assert not make_engine(gemma, mode="ngram").accepts()
    llama, _ = build_model("llama", seed=3)
    assert make_engine(llama, mode="ngram").accepts()
    assert not make_engine(llama, mode="lookahead").accepts()
    # by itself a request of any kind decodes in a batch (on its own cache); company is refused
    batch = BatchSpeculator(gemma)
    make_engine(gemma, mode="ngram").join(batch, [1, 2, 3, 4, 5, 6, 7], max_tokens=4)
    with pytest.raises(MlxspecError, match="cannot run in the batched step"):
        make_engine(gemma, mode="ngram").join(batch, [3, 4, 5], max_tokens=4)
    batch = BatchSpeculator(llama)
    make_engine(llama, mode="ngram").join(batch, [1, 2, 3], max_tokens=4)
    with pytest.raises(MlxspecError, match="cannot run in the batched step"):
        make_engine(llama, mode="lookahead").join(batch, [3, 4, 5], max_tokens=4)


def test_a_policy_choosing_k_keeps_every_request_exact(pair):
    """The 8 mixed requests under a batch policy with fixed costs (width nearly free, as on
    a GPU; frozen: no timing): a random-weight draft is cut while the n-gram rows speculate where it pays, and
    the batch steps plainly where nothing does; every output equals the request alone."""
    target, draft = pair
    base = make_engine(target, mode="ngram", draft_model=draft)
    want = alone(base, REQUESTS)
    batch = frozen_batch(target, base)
    rows = [base.clone().join(batch, p, max_tokens=n, mode=m, **kw) for p, m, n, kw in REQUESTS]
    outs = [[] for _ in REQUESTS]
    drain(batch, rows, outs)
    assert outs == want
    drafted = {i: rows[i].stats.drafted for i in range(len(rows))}
    assert drafted[1] + drafted[6] < 10  # the draft rows (0 % accepted alone) were cut
    assert rows[0].stats.accepted > 5  # while the repetitive n-gram row speculated
    assert 0 < batch.plain_steps < batch.steps  # some steps all plain (W = 1), some wide


# ----------------------------------------------------------------------------- batched draft

DRAFT_REQUESTS = [
    (list(range(10, 40)) * 2, "draft", 24, {}),
    ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], "draft", 30, {"num_draft": 3}),
    ([7, 8, 9], "draft", 17, {}),
    ([5] * 20, "auto", 33, {}),
    ([1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2], "ngram", 20, {}),
    ([9], "draft", 12, {"num_draft": 2}),
]


@pytest.mark.parametrize("same", [False, True], ids=["random-draft", "target-as-draft"])
def test_batched_draft_rows_equal_each_request_alone(pair, same):
    """Draft rows of different lengths draft together (one draft forward per position for
    all), joining and leaving mid-generation, each row's plan its own (`OwnPlans`): every
    output, and every row's drafted and accepted counts, equal the request alone (the draft
    tokens are the same: with the target as its own draft, all are accepted); each row's
    draft cache, given back on leaving, holds exactly its `cached` tokens."""
    target, draft = pair
    base = make_engine(target, mode="ngram", draft_model=target if same else draft)
    slots = [base.clone() for _ in DRAFT_REQUESTS]
    single = [base.clone().generate(p, max_tokens=n, mode=m, **kw)
              for p, m, n, kw in DRAFT_REQUESTS]
    batch = BatchSpeculator(target, policy=OwnPlans())
    rows, outs = [], [[] for _ in DRAFT_REQUESTS]

    opener = open_in(batch, lambda i: slots[i], DRAFT_REQUESTS, rows)

    for i in range(3):
        opener(i)()
    drain(batch, rows, outs, join={1: opener(3), 3: opener(4), 5: opener(5)})
    for i, (one, out, row) in enumerate(zip(single, outs, rows)):
        assert out == one.tokens, f"request {i}"
        if DRAFT_REQUESTS[i][1] == "draft":
            # (a joiner's first token comes from its round's prefill, not a proposing step:
            # at most one step fewer than alone)
            assert 0 <= one.stats.drafted - row.stats.drafted <= 8, f"request {i}"
            if same:
                assert row.stats.accepted == row.stats.drafted > 0
    assert batch.batched_drafts >= 20 and not batch.drafts
    engine = make_engine(base.draft_model)
    for i, slot in enumerate(slots):
        proposer = slot.proposer_for(DRAFT_REQUESTS[i][1])
        d = getattr(proposer, "draft", proposer)
        if d is None or not hasattr(d, "cached"):
            continue
        p, _, n, _ = DRAFT_REQUESTS[i]
        assert d.cached == (p + outs[i])[: len(d.cached)] and not d.pending
        assert caches.offset(d.cache) == len(d.cached)
        if len(d.cached) > 1:
            fresh = prefilled(engine, d.cached + [0])
            np.testing.assert_allclose(np.array(d.cache[0].keys[..., : len(d.cached), :]),
                                       np.array(fresh[0].keys[..., : len(d.cached), :]),
                                       atol=1e-5)


def test_batched_draft_proposes_what_each_row_would_alone(pair):
    """Shared draft rows against DraftModelProposer.propose/update (a batch of one on its own
    cache), row by row, at T > 0 over three
    rounds (rows of different lengths and k, a row sitting a round out): the same draft
    tokens from the same seeds, and the same `cached` tokens after."""
    from mlxspec.proposers.draft import DraftModelProposer, DraftRows

    _, draft = pair
    sampling = SamplingParams(temperature=0.8, top_p=0.9)
    prompts = [list(range(10, 40)), [3, 1, 4, 1, 5], [9]]
    alone_, batched = [], []
    for p in prompts:
        for group in (alone_, batched):
            d = DraftModelProposer(draft)
            d.reset(p, sampling)
            group.append(d)
    batch = DraftRows(draft)
    for d in batched:
        batch.join(d)
    contexts = [list(p) for p in prompts]
    plans = [[4, 2, 3], [3, 0, 1], [2, 4, 4]]  # k per row per round (0: sits out)
    accepted = [[1, 0, 3], [3, 0, 0], [0, 2, 4]]
    for rnd in range(3):
        seeds = [100 * rnd + b for b in range(3)]
        want = [d.propose(c, plans[rnd][b], seeds[b]) if plans[rnd][b] else None
                for b, (d, c) in enumerate(zip(alone_, contexts))]
        who = [b for b in range(3) if plans[rnd][b]]
        got = batch.propose([(batched[b], contexts[b], plans[rnd][b], seeds[b]) for b in who])
        for b, g in zip(who, got):
            np.testing.assert_array_equal(np.array(g.tokens), np.array(want[b].tokens))
            # keyed draws: deterministic proposals (the target draws with the same noise)
            assert g.draft_probs is None and want[b].draft_probs is None
            n = accepted[rnd][b]
            contexts[b] += np.array(want[b].tokens).tolist()[:n] + [7 + b]
            alone_[b].update(contexts[b], n)
            batch.update(batched[b], contexts[b], n)
            assert batched[b].cached == alone_[b].cached
    for d, one in zip(batched, alone_):
        batch.leave(d)
        assert caches.offset(d.cache) == caches.offset(one.cache) == len(d.cached)
    assert batch.rows is None


def test_rows_force_nothing_but_a_due_probe(pair):
    """What rows offer the batch's policy: a fixed-k draft row forces nothing, sampled or
    greedy (no output depends on k); an adaptive row whose draft arm is switched off forces a
    probe when one is due, else offers without forcing."""
    from mlxspec.policy import AdaptiveK

    target, draft = pair
    base = make_engine(target, mode="draft", draft_model=draft)
    batch = BatchSpeculator(target)
    prompt = list(range(10, 40))
    hot = base.clone().join(batch, prompt, max_tokens=20, temperature=0.8, seed=3)
    cold = base.clone().join(batch, prompt, max_tokens=20)
    for row in (hot, cold):  # (its shadow's probe of the draft may be due)
        source, offer = row.offer()
        assert source == "draft" and (offer.forced == 0 or offer.probe)
    policy = AdaptiveK(max_k=4)
    observe_plain(policy, 4, 0.04)
    for _ in range(20):  # the draft rejected at once, every time: the arm goes off
        observe_step(policy, "draft", 4, 0, 0.02)
    auto = base.clone().join(batch, prompt, max_tokens=20, mode="auto", policy=policy)
    assert policy.choose("draft") == 0
    policy.clock = policy.probes["draft"].due  # a probe is due
    source, offer = auto.offer()
    assert (source, offer.forced) == ("draft", policy.probe_k) and offer.group == "draft"
    policy.clock = policy.probes["draft"].due - 1  # not yet
    assert auto.offer()[1].forced == 0
    for row in (hot, cold, auto):
        batch.close(row)


def test_a_source_the_batch_keeps_plain_is_still_measured(pair):
    """Where the batch's cost keeps rows plain, what their free source would have proposed is
    compared with what they commit (`BatchRow.watch`): a prediction equal to the answer
    measures as mostly accepted, one wrong at every other token as mostly rejected, and no
    step speculated."""
    from mlxspec.policy import AdaptiveK

    target, _ = pair
    base = make_engine(target, mode="ngram")
    prompt = [5, 9, 2, 7, 11, 3]
    answer = base.clone().generate(prompt, max_tokens=24, mode="none").tokens
    dear = (1.0, 0.3, 3.0, 2.0, 0.01, 3.0)  # width never pays
    batch = BatchSpeculator(target, policy=BatchPolicy(FrozenCost(prior=dear)))
    right, wrong = AdaptiveK(max_k=4), AdaptiveK(max_k=4)
    rows = [base.clone().join(batch, prompt, max_tokens=24, prediction=answer, policy=right),
            base.clone().join(batch, prompt, max_tokens=24,
                       prediction=[t ^ (i % 2) for i, t in enumerate(answer)], policy=wrong)]
    outs = [[], []]
    drain(batch, rows, outs)
    assert outs == [answer, answer] and all(r.stats.drafted == 0 for r in rows)

    def measured(policy):
        est = [e for source, e in policy.sources.items() if source.startswith("prediction")]
        return sum(e.reached[0] for e in est), sum(e.accepted[0] for e in est)

    # at least three watches each (decayed counts: three are 2.97)
    reached, accepted = measured(right)  # (a repeated n-gram may point elsewhere)
    assert reached > 2.5 and accepted / reached > 0.6
    reached, accepted = measured(wrong)
    # a watch starting where the prediction is right reaches 2 and accepts 1, one starting
    # where it is wrong reaches 1 and accepts none: a third over both alignments
    assert reached > 2.5 and accepted / reached < 0.4


# ----------------------------------------------------------------------------- T > 0

@pytest.mark.slow
@pytest.mark.parametrize("mode,seeded", [("draft", True), ("draft", False), ("ngram", True)])
def test_sampling_is_exact_for_one_row_of_a_mixed_batch(mode, seeded, monkeypatch):
    """Chi-square (the pattern of test_exact_sampling.py) for one row whose companions use
    other sources and k, seeded (keyed draws) or not (the rejection rule, MLX's global
    generator); the same test rejects a deliberately wrong rejection rule (every drafted token
    accepted)."""
    import exact as ex

    import mlxspec.step as step
    from mlxspec.sampling import probs_from_logits, sample

    target, _ = build_model("llama", seed=7, vocab=ex.VOCAB)
    draft, _ = build_model("llama", seed=8, vocab=ex.VOCAB, layers=1)
    exact = ex.exact_distribution(target, ex.PROMPT)
    base = make_engine(target, mode=mode, draft_model=draft, vocab=ex.VOCAB, num_draft=4)
    kwargs = {"prediction": [1, 2, 3, 0, 1, 2]} if mode == "ngram" else {}
    companions = [([2, 1, 0, 3, 2, 1], "ngram", 7), ([3, 3, 3], "draft", 4)]
    slots = [base.clone() for _ in range(3)]
    # costs under which width is nearly free: every row proposes its k (a sharp test)
    cost = BatchPolicy(FrozenCost(prior=CHEAP_WIDTH)).cost
    for s in slots:
        s.cost = cost
    drafted = []

    def counts(runs: int) -> np.ndarray:
        out = np.zeros((ex.VOCAB,) * ex.N)
        # seeds 0..299 fall in the test's 1e-3 tail for the draft row (p 1.2e-4; seeds
        # 0..1499 give p 0.14): a fixed draw like any other, taken from 1000 on
        for seed in range(1000, 1000 + runs):
            mx.random.seed(seed)  # (the unseeded row's generator: a fixed draw too)
            batch = BatchSpeculator(target, policy=BatchPolicy(cost))
            rows = [slots[0].join(batch, ex.PROMPT, max_tokens=ex.N,
                               seed=seed if seeded else None, **ex.SAMPLING,
                               **kwargs)]
            for j, (p, m, n) in enumerate(companions[: 1 + seed % 2]):
                rows.append(slots[1 + j].join(batch, p, max_tokens=n, mode=m, seed=10_000 + seed,
                                       temperature=1.0))
            outs = [[] for _ in rows]
            drain(batch, rows, outs)
            out[tuple(outs[0])] += 1
            drafted.append(rows[0].stats.drafted)
        return out

    assert ex.min_pvalue(counts(ex.RUNS), exact) > 1e-3
    assert sum(drafted) > ex.RUNS // 2  # the row proposed in many runs
    if mode != "draft" or seeded:  # the power check runs once, on the unseeded draft row
        return  # (the keyed rule's: test_exact_sampling.py)

    def wrong(logits, draft_tokens, q, sampling):
        # accepts every drafted token whatever p says
        k = draft_tokens.size
        p = probs_from_logits(logits, sampling)
        return mx.array(k, mx.int32), sample(p[k], None)

    monkeypatch.setattr(step, "verify_chain", wrong)
    assert ex.min_pvalue(counts(ex.RUNS), exact) < 1e-3


@pytest.mark.slow
def test_unseeded_rows_of_a_plain_stretch_draw_together_exactly(monkeypatch):
    """Unseeded sampled rows with the same sampling draw their pipelined plain steps in one
    categorical over the batch: chi-square of one row's tokens against the exact
    distribution; the same test rejects a draw that ignores top-k and top-p."""
    import exact as ex

    import mlxspec.step as step

    target, _ = build_model("llama", seed=7, vocab=ex.VOCAB)
    exact = ex.exact_distribution(target, ex.PROMPT)
    base = make_engine(target, mode="none", vocab=ex.VOCAB)
    slots = [base.clone() for _ in range(3)]

    def counts() -> np.ndarray:
        out, pipelined = np.zeros((ex.VOCAB,) * ex.N), 0
        for run in range(ex.RUNS):
            batch = BatchSpeculator(target)
            rows = [slots[0].join(batch, ex.PROMPT, max_tokens=ex.N, seed=None,
                               **ex.SAMPLING)]
            rows += [slots[j].join(batch, [j, 3, 1, 2][: 2 + run % 3], max_tokens=ex.N + j,
                                seed=None, **ex.SAMPLING) for j in (1, 2)]
            outs = [[] for _ in rows]
            drain(batch, rows, outs)
            out[tuple(outs[0])] += 1
            pipelined += batch.pipelined
        assert pipelined > ex.RUNS  # the grouped draw ran
        return out

    assert ex.min_pvalue(counts(), exact) > 1e-3
    monkeypatch.setattr(step, "probs_from_logits",
                        lambda logits, sampling: mx.softmax(logits.astype(mx.float32), axis=-1))
    assert ex.min_pvalue(counts(), exact) < 1e-3


def test_serve_batch_spec_answers_equal_single_requests():
    """`serve --batch-spec`: concurrent greedy requests share batched forwards and each answer
    equals the same request served alone."""
    import threading

    from server_helpers import post, start, stop

    prompts = [f"def step_{i}(self, tokens):\n    return {i} + " for i in range(4)]

    import mlxspec

    engine = mlxspec.load(None, mode="ngram")
    alone = {p: engine.generate(p, max_tokens=24).text for p in prompts}
    srv = start(engine.clone(), batch_spec=True)
    try:
        answers = {}

        def ask(prompt):
            status, payload, _ = post(srv.url, "/v1/completions",
                                      {"prompt": prompt, "max_tokens": 24, "temperature": 0})
            answers[prompt] = (status, json.loads(payload)["choices"][0]["text"])

        threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert {p: a for p, (s, a) in answers.items() if s == 200} == alone
        assert srv.worker.spec_batch is not None  # the batched step really ran
    finally:
        stop(srv)


def test_a_long_prompt_opened_while_a_plain_step_is_queued_joins_at_the_next_step(pair):
    """A request with a long prompt (prefilled at `open`, no chunks) opened while a plain
    step is queued for the batch's rows joins at the next step, after that step is read: it
    used to join at once, the queued step then fed one row fewer than the cache held (a
    failed step for every row: the server at 8 clients)."""
    target, _ = pair
    base = make_engine(target, mode="none")
    reqs = [([7, 1, 9, 4], "none", 24, {}), ([50, 60, 70], "none", 24, {}),
            ([11, 12], "none", 24, {}), (list(range(3, 83)), "none", 12, {})]
    want = alone(base, reqs)
    batch = BatchSpeculator(target)
    rows = [base.clone().join(batch, p, max_tokens=n) for p, _, n, _ in reqs[:3]]
    outs = [[] for _ in reqs]
    drain(batch, rows, outs, rounds=3)
    rows.append(base.clone().join(batch, reqs[3][0], max_tokens=reqs[3][2]))
    drain(batch, rows, outs)
    assert outs == want
