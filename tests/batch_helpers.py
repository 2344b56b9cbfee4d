"""Helpers of the batched-step tests (`tests/test_batch_step.py` and the tests that run its
checks with other models): requests, a batch whose costs are frozen, and draining rows."""

from __future__ import annotations

from conftest import make_engine, next_output

from mlxspec.batch_step import BatchSpeculator
from mlxspec.cost import StepCost
from mlxspec.engine import PromptCache
from mlxspec.planning import BatchPolicy


def drain(batch, rows, outs, close_at: dict | None = None, join: dict | None = None, rounds=10_000):
    """Read every row round robin until all finish; close_at[i] = n closes row i after n
    outputs (a client going away); join[r] = callable run before round r (a new request)."""
    live = list(range(len(rows)))
    counts = [0] * len(rows)
    for rnd in range(rounds):
        if join and rnd in join:
            i = join[rnd]()
            live.append(i)
            counts.append(0)
        if not live:
            break
        for i in list(live):
            try:
                out = next_output(batch, rows[i])
            except StopIteration:
                live.remove(i)
                continue
            outs[i].extend(out.tokens)
            counts[i] += 1
            if out.finish_reason or (close_at and counts[i] == close_at.get(i)):
                batch.close(rows[i])
                live.remove(i)


# (prompt, mode, max_tokens, extra): n-gram with a repetitive prompt, a predicted output, a
# draft model, plain, auto, a small k
REQUESTS = [
    ([1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2], "ngram", 40, {}),
    (list(range(10, 40)) * 2, "draft", 24, {}),
    ([7, 8, 9], "none", 17, {}),
    ([5] * 20, "auto", 33, {}),
    ([30, 31, 32, 33], "ngram", 28, {"prediction": "this is predicted text, " * 3}),
    (list(range(60, 75)), "ngram", 21, {"num_draft": 2}),
    ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], "draft", 30, {"num_draft": 3}),
    ([100, 101, 102] * 5, "auto", 26, {}),
]


class OwnPlans(BatchPolicy):
    """A batch policy under which every row plans its own k, as if alone."""

    def plan_rows(self, rows, *args, **kwargs):
        return [r.planner.plan(r.available(), r.context) for r in rows]


class FrozenCost(StepCost):
    """A cost model that does not learn: decisions independent of timing."""

    def add(self, *args, **kwargs) -> None:
        pass


# prior costs under which width is nearly free (as on a GPU): the rows speculate in the batch
CHEAP_WIDTH = (1.0, 0.3, 0.01, 0.0, 0.01, 0.3)


def frozen_batch(target, engine, prior=CHEAP_WIDTH) -> BatchSpeculator:
    """A batch whose frozen cost model is also `engine`'s (and its clones'), as the server's
    batch shares its engine's: every row's policy decides by these costs, never by timing."""
    batch = BatchSpeculator(target, policy=BatchPolicy(FrozenCost(prior=prior)))
    engine.cost = batch.policy.cost
    return batch


def alone(base, requests):
    return [base.clone().generate(p, max_tokens=n, mode=m, **kw).tokens
            for p, m, n, kw in requests]


def open_in(batch, engines, requests, rows, pcs=None):
    """opener(i)() opens request i in the batch (on engines(i)) and appends its row to
    `rows` (and a fresh prompt cache to `pcs` when given); returns i, as `drain`'s join
    callables do."""
    def open_request(i):
        def go():
            p, m, n, kw = requests[i]
            if pcs is not None:
                pcs.append(PromptCache())
                kw = {**kw, "prompt_cache": pcs[-1]}
            rows.append(engines(i).join(batch, p, max_tokens=n, mode=m, **kw))
            return i
        return go
    return open_request


def joins_and_leaves(pair) -> None:
    """8 requests of different lengths and sources; three join mid-generation, one leaves
    early (a disconnect): every output equals the request decoded alone by the engine."""
    target, draft = pair
    base = make_engine(target, mode="ngram", draft_model=draft)
    want = alone(base, REQUESTS)
    batch = frozen_batch(target, base)
    rows, outs = [], [[] for _ in REQUESTS]

    opener = open_in(batch, lambda i: base.clone(), REQUESTS, rows)

    for i in range(5):
        opener(i)()
    drain(batch, rows, outs, close_at={2: 3}, join={2: opener(5), 4: opener(6), 7: opener(7)})
    assert outs[2] == want[2][: len(outs[2])] and 0 < len(outs[2]) < len(want[2])
    for i in (0, 1, 3, 4, 5, 6, 7):
        assert outs[i] == want[i], f"request {i} ({REQUESTS[i][1]})"
    assert not batch.rows and not batch.cache.lengths
    # one forward served several rows, and speculation was accepted in the batch
    assert batch.rows_stepped > 2 * batch.steps
    assert sum(r.stats.accepted for r in rows) > 10
    assert {r.stats.accepted for r in rows[:2]} != {0}  # ragged: rows accepted differently
