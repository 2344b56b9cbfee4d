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
from .caches.prompt import PromptCache
from .caches.ragged import plain_attention
from .caches.rows import RaggedRows, RowCache
from .errors import MlxspecError
from .policy import (
    MAX_NUM_DRAFT,
    AdaptiveK,
    BatchPolicy,
    Policy,
    RowOffer,
    RowPolicy,
    forward_group,
    plan_rows,
)
from .prefill import GROUP_PREFILL_MAX, prefill, prefill_group, reuse, start_proposer
from .proposal import Proposal
from .proposers.base import Proposer
from .proposers.draft import DRAFT_ARMS, TREE, DraftRows, draft_proposer
from .request import prepare
from .sampling import SamplingParams
from .stats import Stats
from .step import StartedStep, decode_step, draw_next, finish_step, start_step
from .stopstrings import Detokenizer, StepOutput

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


class BatchRow:
    """One request in a `BatchSpeculator`: `step()` commits its tokens and returns them."""

    def __init__(self, batch: BatchSpeculator, engine: Engine | None, pc: PromptCache,
                 context: list[int], proposer: Proposer | None, policy: Policy,
                 sampling: SamplingParams, key: mx.array, stats: Stats, end: int,
                 num_draft: int, stops: list[str], seeded: bool = False):
        self.batch, self.engine, self.pc = batch, engine, pc
        # A seeded sampled row draws what it would by itself: its fixed k stays fixed (`pinned`),
        # and its plain steps draw with its own key.
        self.seeded = seeded
        self.pinned = seeded and not sampling.greedy
        self.context, self.proposer = context, proposer
        self.planner = RowPolicy(policy, proposer, batched=not batch.row_plans,
                                 cost=batch.policy.cost)
        self.sampling, self.key, self.stats = sampling, key, stats
        self.end, self.num_draft = end, num_draft
        self.draft = None  # its DraftModelProposer, while that drafts in the batch's DraftRows
        # (request, tokens reused, seconds prefilling) until it joins; `chunk`: tokens per step
        self.opening: tuple | None = None
        self.chunk: int | None = None
        # What this step produced: detokenized as committed (a row stops at its end at once)
        self.outputs: list[StepOutput] = []
        self.shares = False  # may share a batch with other rows (`shareable`, set at `open`)
        self.error: BaseException | None = None
        self.closed = False
        self.detok = None if engine is None else Detokenizer(engine.tokenizer, stops, stats)

    @property
    def ended(self) -> bool:
        """It has ended (an end-of-sequence token, a stop string, max_tokens)."""
        return self.detok is not None and self.detok.done

    @property
    def exhausted(self) -> bool:
        return len(self.context) >= self.end

    @property
    def wants(self) -> bool:
        """It has not ended, left or failed."""
        return not (self.closed or self.ended or self.exhausted or self.error is not None)

    @property
    def wants_two(self) -> bool:
        """It wants a token after the next one (a queued step may feed it)."""
        return self.wants and len(self.context) + 2 <= self.end

    def available(self) -> dict[str, int] | None:
        """Its proposer's offer per source, k <= remaining - 1 (None: no proposal can be); a
        draft tree only where the row's cache can verify one."""
        cap = min(self.num_draft, self.planner.policy.max_k, self.end - len(self.context) - 1)
        if self.proposer is None or cap <= 0:
            return None
        self.planner.at(len(self.context) - 1)  # (its cache holds all but the last token)
        offered = self.proposer.available(self.context, cap)
        if TREE in offered and not self.proposer.uses_trees and not self.batch.verifies_trees():
            offered = {s: n for s, n in offered.items() if s != TREE}
        policy, draft = self.planner.policy, draft_proposer(self.proposer)
        if "draft" in offered and isinstance(policy, AdaptiveK) and draft is not None:
            # (at the target's prefill time per token, as the engine last measured it)
            per_token = getattr(self.engine, "prefill_seconds_per_token", 0.0)
            if not policy.catch_up_pays(len(self.context) - len(draft.cached),
                                        self.end - len(self.context), per_token):
                offered = {s: n for s, n in offered.items() if s not in DRAFT_ARMS}
        return offered

    def offer(self) -> tuple[str, RowOffer]:
        """The source this row would propose from and what it offers the batch's policy."""
        return self.planner.offer(self.available() or {}, self.pinned, self.context)

    def step_keys(self) -> tuple[mx.array | None, mx.array | None]:
        """The keys of its next step (proposing, verifying), split from its own when seeded
        and sampled; None otherwise (MLX's global generator)."""
        if not self.seeded or self.sampling.greedy:
            return None, None
        self.key, propose_key, verify_key = mx.random.split(self.key, 3)
        return propose_key, verify_key

    def first_draw(self, logits: mx.array) -> mx.array:
        """The row's first token (lazy, shape (1,)), drawn as a plain step draws it."""
        return draw_next(logits[None], [self.sampling], [self.step_keys()[1]])

    def commit(self, tokens: list[int], arm: str = "", source: str = "", drafted: int = 0,
               accepted: int = 0, seconds: float | None = None, observe: bool = True) -> None:
        """Commit a step's tokens (`arm`: the plan's source, `source`: the proposal's); its
        draft, proposer, policies (not for its prefill's token) and stats are told."""
        self.context.extend(tokens)
        if self.draft is not None and source == "draft":
            self.batch.drafts[id(self.draft.model)].update(self.draft, self.context, accepted)
        if self.proposer is not None:
            self.proposer.update(self.context, accepted)
        if observe:
            self.planner.observe(arm, drafted, accepted, seconds, self.context)
        self.stats.record_step(source, drafted, accepted, len(tokens))
        if self.detok is None:  # a raw row (tests, tools): tokens only
            self.outputs.append(StepOutput("", list(tokens), self.stats))
        elif not self.detok.done:
            self.outputs.append(self.detok.feed(tokens, last=self.exhausted))

    def output(self, produced: dict[BatchRow, StepOutput]) -> StepOutput | None:
        """Its output in what a `step()` produced (None: none this step); raises the error of
        a step or a prefill that failed."""
        if self.error is not None:
            raise self.error
        return produced.get(self)

    def close(self) -> None:
        """Leave; the prompt cache gets the row's cache (every committed token but the last)."""
        if self.closed:
            return
        self.closed = True
        self.batch._leave(self)
        if self.proposer is not None:
            self.proposer.finish()  # the answer is in the suffix store for the next request


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
        self.opening: list[BatchRow] = []  # opened, to prefill together (`_open_pending`)
        self.prefilling: list[BatchRow] = []  # opened, prefilled a chunk per step
        self._delivered = 0.0  # when the last pipelined step's tokens were read back
        self._trees: bool | None = None  # the model can verify token trees (`verifies_trees`)

    @staticmethod
    def accepts(engine: Engine, mode: str | None = None) -> bool:
        """Whether a request in `mode` can share a batch with others (`shareable`)."""
        try:
            proposer = engine.proposer_of(mode)
        except MlxspecError:
            return False  # the engine path reports it
        return shareable(engine, proposer)

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

    def open(self, engine: Engine, prompt, *, progress=None, prefill_chunk: int | None = None,
             **request) -> BatchRow:
        """A request checked (`request.prepare`) joining the batch: each `step()` commits its
        tokens, and returns them as text; close the row to leave. A short rest of the
        prompt prefills at the next step with the round's other joiners; a longer one here
        (`progress(done, total)`), or `prefill_chunk` tokens per `step()` when longer still.
        `request`: as `request.prepare`."""
        req = prepare(engine, prompt, **request)
        pc, proposer, tokens = req.pc, req.proposer, req.tokens
        if engine.model is not self.model:
            raise MlxspecError("a row of another model cannot join this batch")
        members = self.opening + self.prefilling + self.rows
        row = BatchRow(self, engine, pc, list(tokens), proposer, req.policy, req.sampling,
                       req.key, req.stats, len(tokens) + req.max_tokens,
                       req.num_draft or MAX_NUM_DRAFT, req.stops, seeded=req.seeded)
        row.shares = shareable(engine, proposer)
        if members and not (row.shares and all(r.shares for r in members)):
            raise MlxspecError("this request cannot run in the batched step")
        if any(r.pc is pc for r in members):
            raise MlxspecError("two requests in a batch cannot share a prompt cache")
        start = time.perf_counter()
        keep = reuse(engine, tokens, pc, proposer, req.cache_reuse)
        row.opening = (req, keep, time.perf_counter() - start)
        if prefill_chunk and len(tokens) - 1 - keep > prefill_chunk:
            row.chunk = prefill_chunk
            self.prefilling.append(row)
        else:
            self._prefill(row, progress)
        return row

    def _prefill(self, row: BatchRow, progress=None) -> None:
        """A short rest of the prompt waits for the round's joiners, a longer one is prefilled
        now (`row_plans`: every step planned by the row, the first one too)."""
        if not self.row_plans and len(row.context) - len(row.pc.tokens) <= GROUP_PREFILL_MAX:
            self.opening.append(row)
        else:
            self._prefill_and_join(row, progress)

    def _prefill_chunks(self) -> None:
        """A chunk of every long prompt; one whose rest fits a chunk is prefilled and joins."""
        for row in list(self.prefilling):
            req, keep, seconds = row.opening
            start = time.perf_counter()
            try:
                rest = len(req.tokens) - 1 - len(row.pc.tokens)
                if rest > row.chunk:
                    prefill(row.engine, req.tokens, row.pc, req.proposer, limit=row.chunk)
                    row.opening = (req, keep, seconds + time.perf_counter() - start)
                    continue
                self.prefilling.remove(row)
                self._prefill(row)
            except Exception as e:
                self._fail_open(row, e)

    def _prefill_and_join(self, row: BatchRow, progress=None) -> None:
        """Prefill the rest of a row's prompt on its own cache, then start it."""
        req = row.opening[0]
        start = time.perf_counter()
        prefill(row.engine, req.tokens, row.pc, req.proposer, progress=progress)
        self._start(row, time.perf_counter() - start)

    def _start(self, row: BatchRow, spent: float, first: int | None = None) -> None:
        """A prefilled row starts its proposer and joins; with its `first` token where a
        group's forward drew it (its cache then holds its whole prompt)."""
        req, keep, seconds = row.opening
        row.opening = None
        row.stats.cached_tokens = keep  # reused at `open`, not the chunks prefilled since
        start_proposer(row.engine, req, seconds + spent)
        if first is not None:
            row.pc.tokens = list(row.context)
            row.commit([first], observe=False)
        self._join(row, may_keep_own=first is None)

    def _open_pending(self) -> None:
        """The rows opened since the last step prefill together (the last prompt token too)
        and join, each with its first token: one forward and one wait for a round's joiners,
        not one each (each wait stalls the whole batch)."""
        group = [r for r in self.opening if not r.closed]
        self.opening = []
        if not group:
            return
        start = time.perf_counter()
        try:
            if len(group) == 1 and self._keeps_own_cache(group[0]):
                self._prefill_and_join(group[0])  # on its own cache
                return
            firsts = prefill_group(self.model, group)
        except Exception as e:  # the state of every row's cache is unknown
            for r in group:
                self._fail_open(r, e)
            return
        spent = time.perf_counter() - start
        self._share()  # a row on its own cache moves into ragged rows first
        need = len(group) - self.slots.count(None)
        if need > 0:  # room for the whole group at once: growing copies every buffer
            if self.cache is None:
                self.cache = RaggedRows(len(group[0].pc.cache))
            self.cache.add_empty_rows(need)
            self.slots.extend([None] * need)
        for r, token in zip(group, firsts):
            try:  # a failure here is this row's only
                self._start(r, spent, token)
            except Exception as e:
                self._fail_open(r, e)

    def _fail_open(self, row: BatchRow, e: BaseException) -> None:
        """A row whose prefill or join failed has `error` (its `output` raises it); its cache goes."""
        row.opening, row.error = None, e
        if row in self.slots and row not in self.rows:  # written in, not yet a member
            self.rows.append(row)
        self._leave(row)  # (out of the waiting lists too)
        row.pc.drop()

    # -- membership
    def _keeps_own_cache(self, row: BatchRow) -> bool:
        """A first row decodes on its own cache (any kind, no copy): the fastest for one
        request (on ragged rows one ran at 0.93x, bench/bench_batch_of_one.py at 6fce6c1),
        until another joins. Not a pinned row of a shared batch (seeded, fixed k, T > 0): its
        draws must not depend on whether another row comes."""
        return not self.rows and (self.row_plans or not row.shares or not row.pinned
                                  or isinstance(row.planner.policy, AdaptiveK))

    def _join(self, row: BatchRow, may_keep_own: bool = True) -> None:
        if row.detok is not None:
            row.detok.start = time.perf_counter()  # decoding starts (its prefill is done)
        if may_keep_own and self._keeps_own_cache(row):
            self.cache, self.slots = RowCache(self.model, row.pc.cache), [row]
            row.pc.cache = None  # the batch holds it now; given back on leaving
            self.rows.append(row)
            return
        if not row.shares or any(not r.shares for r in self.rows):
            raise MlxspecError("this request cannot run in the batched step")
        self._share()
        self._admit(row)
        self.rows.append(row)

    def _share(self) -> None:
        """A row on its own cache moves into ragged rows (a step queued for it undone first)."""
        if self.cache is None or self.cache.shared:
            return
        self._drop_queued()
        (row,) = self.slots
        layers = self.cache.take_row(0)
        self.cache, self.slots = None, []
        row.pc.cache = layers
        self._admit(row)

    def _drop_queued(self) -> None:
        """Undo a queued step: its rows' caches without the tokens it fed them."""
        q, self.queued = self.queued, None
        if q is not None and any(r is not None for r in q.rows):
            self.cache.trim_rows([1 if r is not None and r in q.rows else 0 for r in self.slots],
                                 ckpt=q.step.ckpt)

    def _admit(self, row: BatchRow) -> None:
        """Move a row's single-request cache (and its draft's) into the ragged rows."""
        layers = row.pc.cache
        if self.cache is None:
            self.cache = RaggedRows(len(layers))
        else:
            # Evaluated (no wait: every caller has just waited), the buffers are written in
            # place; otherwise MLX copies them whole, ~7 ms a join at 8 rows on the server.
            mx.eval(self.cache.evaluate())
        if len(layers) != len(self.cache.layers):
            raise MlxspecError("a row of another model cannot join this batch")
        b = self.slots.index(None) if None in self.slots else len(self.slots)
        self.cache.put_row(b, layers)
        if b == len(self.slots):
            self.slots.append(row)
        else:
            self.slots[b] = row
        # Started, not waited for: a queued step may still be running; the copy joins it.
        mx.async_eval(self.cache.evaluate())
        row.pc.cache = None  # the batch holds it now; given back on leaving
        draft = draft_proposer(row.proposer)
        if draft is not None and DraftRows.joins(draft) and not any(
                r.draft is draft for r in self.rows):
            batch = self.drafts.setdefault(id(draft.model), DraftRows(draft.model))
            batch.join(draft)
            row.draft = draft

    def _leave(self, row: BatchRow) -> None:
        for waiting in (self.opening, self.prefilling):
            if row in waiting:  # closed before it joined: its cache holds what it prefilled
                waiting.remove(row)
                row.opening = None
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
        self._prefill_chunks()
        self._open_pending()
        self._decode()
        return self._produced()

    def admit(self) -> dict[BatchRow, StepOutput]:
        """Prefill a chunk of every long prompt, and the rows opened since the last step
        together; returns their first tokens. No row decodes."""
        self._prefill_chunks()
        self._open_pending()
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
            propose_keys, verify_keys = zip(*(r.step_keys() for r in rows))
            plans = self._plans(rows)
            if not any(k for _, k in plans) and self._can_pipeline(rows):
                # a plain stretch's first step, queued and delivered as the next ones are
                self._queue_next(fed, _spread(fed, verify_keys))
                self._deliver_queued(started=start)
                return
            proposals, forwards = self._propose(rows, plans, propose_keys)
            results = decode_step(
                self.model, self.cache, _spread(fed, [r.context[-1] for r in rows]),
                _spread(fed, proposals), [GREEDY if r is None else r.sampling for r in fed],
                _spread(fed, verify_keys), _spread(fed, [k for _, k in plans], 0), self.sync)
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
        """A plain step may queue the next: a row wants a token after this one's, and no row
        is pinned (whether its next step is plain would depend on the other rows)."""
        return (self.pipeline and any(r.wants_two for r in rows)
                and not any(r.planner.shadow is not None and r.proposer is not None
                            and r.pinned for r in self.rows))

    def _queue_next(self, fed: list[BatchRow | None], keys=None,
                    inputs: mx.array | None = None) -> None:
        """A plain step feeding fed[b] its last token (or inputs[b], unread), started
        (`mx.async_eval`; a sharded target's ranks then run the forwards' collectives in the
        same order), not read back."""
        if keys is None:  # the same keys the step would take when it runs
            keys = [r.step_keys()[1] if r is not None else None for r in fed]
        lasts = [None if r is None else r.context[-1] for r in fed]
        started = start_step(self.model, self.cache, lasts, [None] * len(fed),
                             [GREEDY if r is None else r.sampling for r in fed], keys,
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
                self._queue_next(fed, inputs=inputs)
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
                 keys: list[mx.array]) -> tuple[list[Proposal | None], dict[str, int]]:
        """Every row's proposal (draft-model rows draft together, `proposers/draft.py`),
        and the sequential forwards this took per source group (`forward_group`)."""
        proposals: list[Proposal | None] = [None] * len(rows)
        by_draft: dict[int, list[int]] = {}
        forwards: dict[str, int] = {}
        for i, (r, (source, k), key) in enumerate(zip(rows, plans, keys)):
            if not k:
                continue
            if source == "draft" and r.draft is not None:
                by_draft.setdefault(id(r.draft.model), []).append(i)
                continue
            proposals[i] = r.proposer.propose(r.context, k, key, source=source)
            group = forward_group(source)
            if group:  # a draft (or QuantSpec's pass) on its own: k forwards
                forwards[group] = forwards.get(group, 0) + k
        widest = 0
        for model_id, members in by_draft.items():
            made = self.drafts[model_id].propose(
                [(rows[i].draft, rows[i].context, plans[i][1], keys[i]) for i in members])
            for i, prop in zip(members, made):
                proposals[i] = prop
            self.batched_drafts += len(members)
            widest = max(widest, max(plans[i][1] for i in members))
        if widest:
            forwards["draft"] = forwards.get("draft", 0) + widest
        return proposals, forwards


def shareable(engine: Engine, proposer: Proposer | None) -> bool:
    """Whether a request can share a batch with other requests (decided here only): a plain
    attention cache (a window or a recurrent state has no ragged rows yet), a chain proposer
    on the target's plain cache, an unsharded target. Others decode on their own cache."""
    if engine.kv != "fp" or engine.sync is not None:
        return False
    if proposer is not None and (proposer.uses_trees or proposer.cache_kind != "kv"):
        return False
    return plain_attention(caches.make_cache(engine.model))  # (a CacheList layer: no rows)


def _spread(fed: list, values, empty=None) -> list:
    """`values` (one per row fed, in order) at the rows' places in `fed`, `empty` elsewhere."""
    it = iter(values)
    return [next(it) if r is not None else empty for r in fed]


def merged(outs: list[StepOutput]) -> StepOutput:
    """Consecutive outputs of one row as one."""
    last = outs[-1]
    return StepOutput("".join(o.text for o in outs), [t for o in outs for t in o.tokens],
                      last.stats, last.finish_reason, last.stop_string)
