"""The decode loop, for one request or many: rows of one batch, one target forward per step.

Each row proposes with its own source and k (possibly 0), one forward runs over the rows padded
to 1 + max k (`step.py`, the same kernel for k = 0), each row keeps its own accepted tokens;
where no row proposes, plain steps run pipelined. The batch's cache is rows (`caches.rows`):
a first request keeps its own cache of any kind (`RowCache`, no copy), and plain-attention
rows move into `RaggedRows` when a second joins. Each row's cache holds every committed token
but the last, and its output equals the request decoded by itself. See docs/HOW_IT_WORKS.md,
"Several requests".
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx

from . import caches
from .admission import Admission
from .caches.rows import RaggedRows, RowCache
from .errors import MlxspecError
from .policy import BatchPolicy, forward_group, plan_rows
from .proposal import Proposal
from .proposers.draft import DraftRows
from .row import BatchRow
from .sampling import SamplingParams
from .step import StartedStep, decode_step, finish_step, start_step
from .stopstrings import StepOutput

if TYPE_CHECKING:
    from .engine import Engine

GREEDY = SamplingParams()  # what an empty slot of the batch is "sampled" with


@dataclass
class QueuedPlainStep:
    """A plain step started for `rows` (None: left since) before the previous step's tokens
    were read; `step.out` (lazy) their next tokens."""

    rows: list
    step: StartedStep

    @property
    def tokens(self) -> mx.array:
        return self.step.out


class BatchSpeculator:
    """The rows decoding together on one model; one `step()` = one target forward for all."""

    def __init__(self, model, policy: BatchPolicy | None = None, row_plans: bool = False,
                 pipeline: bool = True, sync=None):
        """`policy`: chooses every row's k and learns the steps' cost (default a fresh
        `BatchPolicy`; the engine's cost model: `BatchPolicy(engine.cost)`); `row_plans`: each
        row plans its own k (a request by itself, `Engine.open`: prefilled at `open`).
        `pipeline`: plain stretches pipelined. `sync`: a sharded target's (rank 0's tokens on
        every rank)."""
        self.model = model
        self.sync = sync
        self.policy = policy or BatchPolicy()
        self.row_plans = row_plans
        self.rows: list[BatchRow] = []
        # Row b of the cache holds slots[b]; a row leaving leaves None (fed padding, trimmed at
        # once) for the next to join: neither joining nor leaving copies the cache (`_compact`).
        self.slots: list[BatchRow | None] = []
        self.cache: RowCache | RaggedRows | None = None
        self.drafts: dict[int, DraftRows] = {}  # id(draft model) -> its rows' draft caches
        self.steps = 0  # batched forwards run
        self.rows_stepped = 0  # row-steps run (steps * mean batch size)
        self.plain_steps = 0  # batched forwards in which no row proposed
        self.batched_drafts = 0  # proposals drafted in shared draft rows (proposers/draft.py)
        self.pipeline = pipeline
        self.pipelined = 0  # plain steps whose forward was queued before the previous read
        # A plain stretch asks the policy every `replan_gap` steps (and when a row joins): on
        # MLX's CPU backend `async_eval` returns near the forward's end, so nothing hides it.
        self.replan_gap = 4
        self.queued: QueuedPlainStep | None = None  # a plain step queued past the last output
        self.admission = Admission(self)  # the rows opened, not decoding yet
        self._delivered = 0.0  # when the last pipelined step's tokens were read back
        self._trees: bool | None = None  # the model can verify token trees (`verifies_trees`)

    def verifies_trees(self) -> bool:
        """Whether a token tree can be verified now: a row on its own cache, of a model whose
        attention takes per-token positions and has no recurrent layers (`tree.py`)."""
        if self.cache is None or self.cache.shared:
            return False
        if self._trees is None:
            from .tree import rope_sites

            try:
                rope_sites(self.model)
                self._trees = not caches.has_recurrent(self.cache.layers)
            except MlxspecError:
                self._trees = False
        return self._trees

    def open(self, engine: Engine, prompt, **request) -> BatchRow:
        """A request checked (`request.prepare`) joining the batch: each `step()` commits its
        tokens, and returns them as text; close the row to leave. A short rest of the
        prompt prefills at the next step with the round's other joiners; a longer one here
        (`progress(done, total)`), or `prefill_chunk` tokens per `step()` when longer still
        (`admission.py`). `request`: as `request.prepare`."""
        return self.admission.open(engine, prompt, **request)

    # -- leaving
    def drop_queued(self) -> None:
        """Undo a queued step: its rows' caches without the tokens it fed them."""
        q, self.queued = self.queued, None
        if q is not None and any(r is not None for r in q.rows):
            self.cache.trim_rows([1 if r is not None and r in q.rows else 0 for r in self.slots],
                                 ckpt=q.step.ckpt)

    def leave(self, row: BatchRow) -> None:
        """A row leaves (`BatchRow.close`); its cache goes back to its prompt cache."""
        self.admission.drop(row)
        if row not in self.rows:
            return
        self.rows.remove(row)
        b = self.slots.index(row)
        q = self.queued
        if q is not None and row in q.rows:  # its last token was fed by the queued step
            self.cache.trim_rows([1 if r is row else 0 for r in self.slots], ckpt=q.step.ckpt)
            q.rows[q.rows.index(row)] = None
        self.slots[b] = None
        if row.draft is not None:
            batch = self.drafts[id(row.draft.model)]
            batch.leave(row.draft, failed=row.error is not None)
            if not batch.members:
                del self.drafts[id(row.draft.model)]
            row.draft = None
        layers = self.cache.take_row(b)
        if row.error is not None:  # state unknown after a failed step: not reused
            row.pc.drop()
        else:
            row.pc.cache, row.pc.tokens = layers, row.context[:-1]
        if not self.rows:
            self.cache, self.queued, self.slots = None, None, []
        else:
            self._compact()

    def _compact(self) -> None:
        """Drop the empty slots once they are half the batch (each costs a row's compute);
        a queued step's rows and tokens follow."""
        empty = self.slots.count(None)
        if not empty or empty * 2 < len(self.slots):
            return
        keep = [b for b, r in enumerate(self.slots) if r is not None]
        self.cache.keep_rows(keep)
        self.slots = [self.slots[b] for b in keep]
        q = self.queued
        if q is not None:  # slots added since it was queued are not in it
            kept = [b for b in keep if b < len(q.rows)]
            q.rows = [q.rows[b] for b in kept]
            q.step.out = q.step.out[mx.array(kept, mx.int32)]
            q.step.fed = [q.step.fed[b] for b in kept]

    # -- the step
    def step(self) -> dict[BatchRow, StepOutput]:
        """Admit the rows opened (`admit`), then one batched step for every row that wants
        tokens (the others sit it out: fed padding, trimmed at once); returns what each row
        produced (a row whose step failed has its `error`: `BatchRow.output` raises it)."""
        self.admission.run()
        self._decode()
        return self._produced()

    def admit(self) -> dict[BatchRow, StepOutput]:
        """Prefill a chunk of every long prompt, and the rows opened since the last step
        together; returns their first tokens. No row decodes."""
        self.admission.run()
        return self._produced()

    def _produced(self) -> dict[BatchRow, StepOutput]:
        produced = {}
        for r in self.rows:
            outs, r.outputs = r.outputs, []
            if outs:
                produced[r] = outs[0] if len(outs) == 1 else merged(outs)
        return produced

    def _decode(self) -> None:
        if self.queued is not None:
            self._deliver_queued()
            return
        fed = [r if r is not None and r.wants else None for r in self.slots]
        rows = [r for r in fed if r is not None]  # in the order of the cache's rows
        if not rows:
            return
        start = time.perf_counter()
        span = self._span()
        try:
            plans = self._plans(rows)
            if not any(k for _, k in plans) and self._can_pipeline(rows):
                # a plain stretch's first step, queued and delivered as the next ones are
                self._queue_next(fed)
                self._deliver_queued(started=start)
                return
            proposals, forwards = self._propose(rows, plans)
            results = decode_step(
                self.model, self.cache, _spread(fed, [r.context[-1] for r in rows]),
                _spread(fed, proposals), [GREEDY if r is None else r.sampling for r in fed],
                [None if r is None else r.seed_at() for r in fed],
                _spread(fed, [k for _, k in plans], 0), self.sync)
            results = [res for res in results if res is not None]
        except Exception as e:
            self.fail(e)
            return
        # (a draft's catch-up on skipped context is a prefill, not this step's cost)
        seconds = time.perf_counter() - start - sum(p.setup_seconds for p in proposals if p)
        self.steps += 1
        self.rows_stepped += len(rows)
        drafted = [res.drafted for res in results]
        if not any(drafted):
            self.plain_steps += 1
        self.policy.observe(len(self.slots), 1 + max(drafted), sum(drafted), forwards, seconds,
                            span)
        for r, (arm, _), res in zip(rows, plans, results):
            r.commit(res.tokens, arm, res.source, res.drafted, res.accepted,
                     seconds if res.drafted else None)

    # -- pipelined plain stretches
    def _can_pipeline(self, rows: list[BatchRow]) -> bool:
        """A plain step may queue the next: a row wants a token after this one's."""
        return self.pipeline and any(r.wants_two for r in rows)

    def _queue_next(self, fed: list[BatchRow | None], inputs: mx.array | None = None,
                    ahead: set[int] = frozenset()) -> None:
        """A plain step feeding fed[b] its last token (or inputs[b], unread), started
        (`mx.async_eval`; a sharded target's ranks then run the forwards' collectives in the
        same order), not read back. A keyed row fed an unread token (its id in `ahead`) draws
        at the position after that token's."""
        lasts = [None if r is None else r.context[-1] for r in fed]
        seeds = [None if r is None else r.seed_at(id(r) in ahead) for r in fed]
        started = start_step(self.model, self.cache, lasts, [None] * len(fed),
                             [GREEDY if r is None else r.sampling for r in fed], seeds,
                             sync=self.sync, inputs=inputs)
        mx.async_eval(started.out)
        self.queued = QueuedPlainStep(fed, started)

    def _deliver_queued(self, started: float | None = None) -> None:
        """The queued step's tokens are its rows' next output (`started`: when a stretch's
        first step, planned and run just now, started). Before reading them back the step
        after is queued, while the batch wants no proposal, so that its forward runs while the
        host reads, detokenizes and plans: it feeds the queued rows their queued tokens, rows
        that joined meanwhile their last token, so a stretch survives requests coming, leaving
        and ending."""
        q, self.queued = self.queued, None
        cache = self.cache
        span = self._span() - 1  # the queued step's token is cached already
        try:
            at = {id(r): i for i, r in enumerate(q.rows) if r is not None}
            fed = [None if r is None else (r if r.wants_two else None) if id(r) in at
                   else (r if r.wants else None) for r in self.slots]
            stepping = [r for r in fed if r is not None]
            # (a row on its own cache asks every step, as cheap sources end a stretch at once)
            replan = started is None and (
                not cache.shared or self.pipelined % self.replan_gap == 0
                or any(r is not None and id(r) not in at for r in fed))
            again = (stepping and self._can_pipeline(stepping) and not (
                replan and any(k for _, k in self._plans(stepping, commit=False))))
            if again:
                if fed == q.rows:
                    inputs = q.tokens
                else:
                    inputs = mx.stack([
                        mx.array(0, mx.uint32) if r is None else q.tokens[at[id(r)]]
                        if id(r) in at else mx.array(r.context[-1], mx.uint32) for r in fed])
                self._queue_next(fed, inputs=inputs, ahead=set(at))
            host = finish_step(q.step)
        except Exception as e:
            self.fail(e)
            return
        now = time.perf_counter()
        seconds, self._delivered = now - (started or self._delivered), now
        kept = [(r, res.tokens[0]) for r, res in zip(q.rows, host)
                if r is not None and res is not None and r.wants]
        # a row that wants no more: the token the queued step fed it goes, not committed
        drop = [r for r in q.rows if r is not None and not r.wants]
        if drop:
            cache.trim_rows([1 if r in drop else 0 for r in self.slots], ckpt=q.step.ckpt)
        self.pipelined += started is None
        # A stretch's last step (none queued after it) was mostly computed while the host
        # planned: its wait is not what a plain token costs (11 ms against 64 on SmolLM2).
        self._commit_plain(kept, seconds if again or started else None, span, bool(started),
                           cache.shared)

    def _plans(self, rows: list[BatchRow], commit: bool = True) -> list[tuple[str, int]]:
        """Every row's (source, k): the batch's policy over the rows' offers, or a row's own
        plan on its own cache (by the same cost model and rule, `policy/cost.py`).
        `commit=False`: only asking (a forced probe is not counted as taken)."""
        if self.row_plans or not self.cache.shared:
            return [r.planner.plan(r.available(), r.context) for r in rows]
        return plan_rows(self.policy, rows, self.steps, commit, len(self.slots), self._span(),
                         self._can_pipeline(rows))

    def _span(self) -> int:
        """The longest row's cached length (what a step's queries attend, less the width)."""
        return max(self.cache.lengths, default=0) if self.cache else 0

    def _commit_plain(self, kept: list[tuple[BatchRow, int]], seconds: float | None, span: int,
                      synced: bool, shared: bool) -> None:
        """Each (row, token) of a plain step; `seconds` None: the step is counted, its time is
        not a cost to learn from."""
        self.steps += 1
        self.plain_steps += 1
        self.rows_stepped += len(kept)
        if seconds is not None:
            self.policy.observe(len(self.slots), 1, 0, None, seconds, span, synced)
        for r, token in kept:
            # (a row on its own cache learns only the steady state: not a stretch's synced first)
            r.commit([token], seconds=None if synced and not shared else seconds)

    def fail(self, e: BaseException) -> None:
        """A step failed: every row has `e` as its `error`."""
        self.queued = None
        for r in self.rows:
            r.error = e

    def _propose(self, rows: list[BatchRow], plans: list[tuple[str, int]],
                 ) -> tuple[list[Proposal | None], dict[str, int]]:
        """Every row's proposal (draft-model rows draft together, `proposers/draft.py`),
        and the sequential forwards this took per source group (`forward_group`)."""
        proposals: list[Proposal | None] = [None] * len(rows)
        by_draft: dict[int, list[int]] = {}
        forwards: dict[str, int] = {}
        for i, (r, (source, k)) in enumerate(zip(rows, plans)):
            if not k:
                continue
            if source == "draft" and r.draft is not None:
                by_draft.setdefault(id(r.draft.model), []).append(i)
                continue
            proposals[i] = r.proposer.propose(r.context, k, r.seed, source=source)
            group = forward_group(source)
            if group:  # a draft (or QuantSpec's pass) on its own: k forwards
                forwards[group] = forwards.get(group, 0) + k
        widest = 0
        for model_id, members in by_draft.items():
            made = self.drafts[model_id].propose(
                [(rows[i].draft, rows[i].context, plans[i][1], rows[i].seed) for i in members])
            for i, prop in zip(members, made):
                proposals[i] = prop
            self.batched_drafts += len(members)
            widest = max(widest, max(plans[i][1] for i in members))
        if widest:
            forwards["draft"] = forwards.get("draft", 0) + widest
        return proposals, forwards


def _spread(fed: list, values, empty=None) -> list:
    """`values` (one per row fed, in order) at the rows' places in `fed`, `empty` elsewhere."""
    it = iter(values)
    return [next(it) if r is not None else empty for r in fed]


def merged(outs: list[StepOutput]) -> StepOutput:
    """Consecutive outputs of one row as one."""
    last = outs[-1]
    return StepOutput("".join(o.text for o in outs), [t for o in outs for t in o.tokens],
                      last.stats, last.finish_reason, last.stop_string)
