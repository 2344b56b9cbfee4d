"""The decode loop, for one request or many: rows of one batch, one target forward per step.

Each row proposes with its own source and k (possibly 0), one forward runs over the rows padded
to 1 + max k (`step.py`, the same kernel for k = 0), each row keeps its own accepted tokens;
where no row proposes, plain steps run pipelined. The batch's cache is `caches.rows.Rows`: a
first request's own cache of any kind (no copy), plain-attention requests' ragged rows once a
second joins. Each row's cache holds every committed token but the last, and its output equals
the request decoded by itself. See docs/HOW_IT_WORKS.md, "The loop" and "Several requests".
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from operator import itemgetter

import mlx.core as mx

from . import caches
from .admission import Admission
from .caches.rows import Rows
from .cost import forward_group
from .errors import MlxspecError
from .planning import BatchPolicy
from .proposal import Proposal
from .proposers.draft import DraftModelProposer, DraftRows, draft_proposer
from .request import Request
from .row import CLOSED, DECODING, BatchRow
from .sampling import SamplingParams
from .step import GREEDY, decode_step, start_plain
from .stopstrings import StepOutput
from .target import Target

REPLAN_GAP = 4  # pipelined steps of shared rows before a plain stretch first asks the policy
REPLAN_GAP_MAX = 16  # the longest gap it grows to while no row would propose


@dataclass(frozen=True)
class Regime:
    """What the batch does for its cache's layout, decided once each time the layout changes
    (`BatchSpeculator._settle`): a row on its own cache (a batch of one) differs from rows
    sharing ragged rows in how it is planned, replanned and timed, and in that it may verify a
    token tree."""

    own_row: BatchRow | None  # the row decoding on its own cache (None: shared, or none)
    plans_by_row: bool  # each row plans by its own policy, not the batch's (`_plans`)
    replans_each_step: bool  # a plain stretch asks after every token (`_replan`)
    times_stretch_start: bool  # rows learn a plain stretch's synced first step (`_deliver`)
    trees: bool  # a token tree can be verified now


@dataclass
class QueuedPlainStep:
    """A plain step started for `rows` (per slot; None: not fed, or left since) before the
    previous step's tokens were read back; `tokens` (lazy) their next tokens."""

    rows: list
    tokens: mx.array
    ckpt: object


class BatchSpeculator:
    """The rows decoding together on one model; one `step()` = one target forward for all."""

    def __init__(self, model, policy: BatchPolicy | None = None, pipeline: bool = True,
                 sync=None):
        """`policy`: chooses every row's k and learns the steps' cost (default a fresh
        `BatchPolicy`; the engine's cost model: `BatchPolicy(engine.cost)`). `pipeline`: plain
        stretches pipelined. `sync`: a sharded target's (rank 0's tokens on every rank)."""
        self.model = model
        self.sync = sync
        self.policy = policy or BatchPolicy()
        self.rows: list[BatchRow] = []
        # Row b of the cache holds slots[b]; a row leaving leaves None (fed padding, trimmed at
        # once) for the next to join: neither joining nor leaving copies the cache (`_compact`).
        self.slots: list[BatchRow | None] = []
        self.cache = Rows(model)
        self.drafts: dict[int, DraftRows] = {}  # id(draft model) -> its rows' draft caches
        # the rows whose draft model drafts in those shared rows, each with its proposer
        self.drafting: dict[BatchRow, DraftModelProposer] = {}
        self.speculating = 0  # rows with a proposer: only they are planned
        self.stateful = 0  # rows whose next draw needs the last token read (no pipelining)
        self.argmax = 0  # rows whose next token is the argmax of the logits, nothing else
        self.steps = 0  # batched forwards run
        self.rows_stepped = 0  # row-steps run (steps * mean batch size)
        self.plain_steps = 0  # batched forwards in which no row proposed
        self.batched_drafts = 0  # proposals drafted in shared draft rows (proposers/draft.py)
        self.pipeline = pipeline
        self.pipelined = 0  # plain steps whose forward was queued before the previous read
        # A plain stretch of shared rows asks the policy after `REPLAN_GAP` steps, then twice
        # as many each time no row would propose, up to `REPLAN_GAP_MAX` (a stretch starts
        # anew when a row joins): on MLX's CPU backend `async_eval` returns near the forward's
        # end, so nothing hides the asking (every row's offer: 2 % of the server's time at 8
        # clients on the bundled pair, every 4 steps).
        self._gap = REPLAN_GAP  # the stretch's gap now
        self._next_replan = 0  # pipelined steps left before the stretch asks again
        self.queued: QueuedPlainStep | None = None  # a plain step queued past the last output
        self.admission = Admission(model, self.policy.cost)  # the rows opened, not decoding yet
        self._delivered = 0.0  # when the last pipelined step's tokens were read back
        self._tree_model: bool | None = None  # the model's attention can verify token trees
        self.regime: Regime  # what the cache's layout means for the loop (`_settle`)
        self._settle()

    def open(self, req: Request, target: Target, *, progress=None,
             prefill_chunk: int | None = None) -> BatchRow:
        """A resolved request (`Engine.request`) joining the batch: each `step()` commits its
        tokens, and returns them as text; `close(row)` to leave. The batch's first row is
        prefilled here (`progress(done, total)`) and decodes at once; a later one's short rest
        of the prompt at the next step with the round's other joiners, `prefill_chunk` tokens
        per `step()` when longer, else here; it joins at the start of a step (a plain step
        queued for the others is read first: `admission.py`)."""
        row = self.admission.open(req, target, self.rows, progress=progress,
                                  prefill_chunk=prefill_chunk)
        if not self.rows:  # the first row decodes at once; others join at a step's start
            self.join(self.admission.ready)
            self.admission.ready = []
        return row

    # -- joining and leaving
    def join(self, ready: list[tuple[BatchRow, bool]]) -> None:
        """Prefilled rows (each with its cache in `row.pc.cache`, every committed token but the
        last; and whether it may decode on that cache) start decoding: a first one on its own
        cache (any kind, no copy: the fastest for one request), the others in the shared rows,
        their drafts in the draft's rows (`Admission.run` hands them over)."""
        grouped = sum(not own for _, own in ready)
        for row, own in ready:
            row.joined()
            try:
                if own and not self.slots:
                    self.cache.put_row(0, row.pc.take())  # given back on leaving
                    self.slots = [row]
                    self._settle()
                else:
                    if not row.shares or any(not r.shares for r in self.rows):
                        raise MlxspecError("this request cannot run in the batched step")
                    self._make_room(grouped, len(row.pc.cache))
                    self._put(row)
                    grouped = 0
            except Exception as e:
                row.fail(e)
                row.pc.drop()
                self._settle()  # (a move that failed half-way may have changed the layout)
                continue
            self.rows.append(row)
            self.speculating += row.proposer is not None
            self.stateful += bool(getattr(row.sampling, "stateful", False))
            self.argmax += _argmax_only(row.sampling)

    def _settle(self) -> None:
        """Decide the loop's regime after the cache's layout changed (a first row put on its
        own cache, rows moved into ragged rows, the last row gone): the one place the batch
        asks `Rows.alone`; the loop reads `self.regime`."""
        own = self.cache.alone
        row = self.slots[0] if own and self.slots else None
        self.regime = Regime(own_row=row, plans_by_row=own, replans_each_step=own,
                             times_stretch_start=not own,
                             trees=row is not None and self._tree_model_here())

    def _sharing(self) -> None:
        """The row on its own cache (if any) is about to share the cache's rows: a step queued
        for it undone (its draft joins the draft's rows at its first proposal, `_propose`)."""
        if self.regime.own_row is not None:
            self.drop_queued()

    def _make_room(self, room: int, num_layers: int) -> None:
        """`room` empty slots for a group joining at once (growing copies every buffer)."""
        need = room - self.slots.count(None)
        if need > 0:
            self._sharing()
            self.cache.add_empty_rows(need, num_layers)
            self.slots.extend([None] * need)
            self._settle()

    def _put(self, row: BatchRow) -> None:
        """A row's single-request cache (and its draft's) into the shared rows."""
        layers = row.pc.cache
        if self.slots:
            if len(layers) != len(self.cache.layers):
                raise MlxspecError("a row of another model cannot join this batch")
            self._sharing()
            # Evaluated (no wait: every caller has just waited), the buffers are written in
            # place; otherwise MLX copies them whole, ~7 ms a join at 8 rows on the server.
            mx.eval(self.cache.evaluate())
        slots = self.slots
        b = slots.index(None) if None in slots else len(slots)
        self.cache.put_row(b, layers)
        if b == len(slots):
            slots.append(row)
        else:
            slots[b] = row
        self._settle()
        mx.async_eval(self.cache.evaluate())
        row.pc.take()  # the batch holds it now; given back on leaving

    def _join_draft(self, row: BatchRow) -> None:
        """A shared row's draft model drafts in the draft's rows, with the other rows'. Asked
        at the row's first draft proposal, not when it joins: a shared batch takes a draft
        rarely, and each member's join and leave copies the draft's rows."""
        draft = draft_proposer(row.proposer)
        if draft is not None and DraftRows.joins(draft) and draft not in self.drafting.values():
            self.drafts.setdefault(id(draft.model), DraftRows(draft.model)).join(draft)
            self.drafting[row] = draft

    def _tree_model_here(self) -> bool:
        """Whether a token tree can be verified on the row's own cache: the model's attention
        takes per-token positions and the cache has no recurrent layers (`tree.py`)."""
        if self._tree_model is None:
            from .tree import rope_sites

            try:
                rope_sites(self.model)
                self._tree_model = not caches.has_recurrent(self.cache.layers)
            except (MlxspecError, AttributeError):  # (a wrapped model: no modules to patch)
                self._tree_model = False
        return self._tree_model

    def drop_queued(self) -> None:
        """Undo a queued step: its rows' caches without the tokens it fed them (they are drawn
        again by the next step: the same tokens for greedy and keyed rows)."""
        q, self.queued = self.queued, None
        if q is not None and any(r is not None for r in q.rows):
            self.cache.trim_rows([1 if r is not None else 0 for r in q.rows], ckpt=q.ckpt)

    def close(self, row: BatchRow) -> None:
        """A row leaves (whatever its state); its cache goes back to its prompt cache (every
        committed token but the last) and its proposer is told."""
        if row.state == CLOSED:
            return
        self.admission.drop(row)
        if row in self.rows:
            self._leave(row)
        row.leave()

    def _leave(self, row: BatchRow) -> None:
        q = self.queued
        if q is not None and row in q.rows:  # its last token was fed by the queued step
            self.cache.trim_rows([1 if r is row else 0 for r in self.slots], ckpt=q.ckpt)
            q.rows[q.rows.index(row)] = None
        self.rows.remove(row)
        self.speculating -= row.proposer is not None
        self.stateful -= bool(getattr(row.sampling, "stateful", False))
        self.argmax -= _argmax_only(row.sampling)
        b = self.slots.index(row)
        self.slots[b] = None
        draft = self.drafting.pop(row, None)
        if draft is not None:
            batch = self.drafts[id(draft.model)]
            batch.leave(draft, failed=row.error is not None)
            if not batch.members:
                del self.drafts[id(draft.model)]
        layers = self.cache.take_row(b)
        if row.error is not None:  # state unknown after a failed step: not reused
            row.pc.drop()
        else:
            row.pc.hold(layers, row.context[:-1])
        if not self.rows:
            self.cache, self.slots, self.queued = Rows(self.model), [], None
            self._settle()
        else:
            self._compact()

    def _compact(self) -> None:
        """Drop the empty slots once they are half the batch (each costs a row's compute)."""
        empty = self.slots.count(None)
        if not empty or empty * 2 < len(self.slots):
            return
        self.drop_queued()
        keep = [b for b, r in enumerate(self.slots) if r is not None]
        self.cache.keep_rows(keep)
        self.slots = [self.slots[b] for b in keep]

    # -- the step
    def step(self) -> dict[BatchRow, StepOutput]:
        """Admit the rows ready (a queued plain step delivered first), then one batched step
        for every row that wants tokens (the others sit it out: fed padding, trimmed at once);
        returns what each row produced (a row whose step failed has its `error`:
        `BatchRow.output` raises it)."""
        admission = self.admission
        if admission.opening or admission.prefilling or admission.ready:
            # a queued step is this step's forward; the joiners join the next stretch
            delivered = self.queued is not None
            if delivered:
                self._deliver(again=False)
            self.join(admission.run(not self.rows))
            if not delivered:
                self._decode()
        elif self.queued is not None:
            self._deliver()
        else:
            self._decode()
        produced = {}
        for r in self.rows:
            if r.outputs:
                produced[r] = r.take_output()
        return produced

    def _decode(self) -> None:
        fed, rows = [], []  # rows: in the order of the cache's rows
        for r in self.slots:
            wants = r is not None and r.state == DECODING
            fed.append(r if wants else None)
            if wants:
                rows.append(r)
        if not rows:
            return
        start = time.perf_counter()
        try:
            plans = self._plans(rows) if self.speculating else None
            if (plans is None or not any(map(itemgetter(1), plans))) and self._can_pipeline(rows):
                # a plain stretch's first step, queued and delivered as the next ones are
                self._gap, self._next_replan = REPLAN_GAP, REPLAN_GAP - 1
                self._queue(fed)
                self._deliver(started=start)
                return
            plans = plans or [("", 0)] * len(rows)
            proposals, forwards = self._propose(rows, plans)
            results = self._verify(fed, rows, plans, proposals)
        except Exception as e:
            self.fail(e)
            return
        # (a draft's catch-up on skipped context is a prefill, not this step's cost)
        seconds = time.perf_counter() - start
        widest = proposed = 0
        for p, res in zip(proposals, results):
            if p is not None:
                seconds -= p.setup_seconds
            widest, proposed = max(widest, res.drafted), proposed + res.drafted
        self.steps += 1
        self.rows_stepped += len(rows)
        self.plain_steps += not proposed
        self.policy.cost.add(len(self.slots), 1 + widest, proposed, forwards, seconds,
                            self._span())
        for r, (arm, _), res, p in zip(rows, plans, results, proposals):
            r.commit(res.tokens, arm, res.source, res.drafted, res.accepted,
                     seconds if res.drafted else None,
                     setup_seconds=p.setup_seconds if p is not None else 0.0)

    def _verify(self, fed: list[BatchRow | None], rows: list[BatchRow],
                plans: list[tuple[str, int]], proposals: list[Proposal | None]) -> list:
        """One forward verifying every row's proposal (`step.decode_step`); rows sitting out
        (None in `fed`) are fed padding. Each fed row's `StepResult`, in order."""
        lasts, samplings, seeds, ks = [], [], [], []
        for r, (_, k) in zip(rows, plans):
            lasts.append(r.context[-1])
            samplings.append(r.sampling)
            seeds.append(None if r.seed is None else (r.seed, len(r.context)))
            ks.append(k)
        if len(rows) < len(fed):
            lasts, proposals, samplings, seeds, ks = (
                _spread(fed, lasts), _spread(fed, proposals), _spread(fed, samplings, GREEDY),
                _spread(fed, seeds), _spread(fed, ks, 0))
        results = decode_step(self.model, self.cache, lasts, proposals, samplings, seeds, ks,
                              self.sync)
        return results if len(rows) == len(fed) else [res for res in results if res is not None]

    # -- pipelined plain stretches
    def _can_pipeline(self, rows: list[BatchRow]) -> bool:
        """A plain step may queue the next: a row wants a token after this one's, and no row
        needs each token read before its next draw."""
        return self.pipeline and not self.stateful and any(
            len(r.context) + 2 <= r.end for r in rows)

    def _queue(self, fed: list[BatchRow | None], inputs: mx.array | None = None) -> None:
        """A plain step feeding fed[b] its last token (or inputs[b], the queued step's token,
        unread), started (`step.start_plain`), not read back. A keyed row draws at the
        position of the token after the one it is fed."""
        ahead = inputs is not None
        if inputs is None:
            inputs = mx.array([0 if r is None else r.context[-1] for r in fed], mx.uint32)
        samplings = seeds = idle = None
        if self.argmax != len(self.rows):  # (greedy rows only: one argmax, as mlx-lm's)
            samplings = [GREEDY if r is None else r.sampling for r in fed]
            seeds = [None if r is None or r.seed is None else (r.seed, len(r.context) + ahead)
                     for r in fed]
        if None in fed:
            idle = [1 if r is None else 0 for r in fed]
        tokens, ckpt = start_plain(self.model, self.cache, inputs, samplings, seeds, idle,
                                   self.sync)
        self.queued = QueuedPlainStep(fed, tokens, ckpt)

    def _deliver(self, again: bool = True, started: float | None = None) -> None:
        """The queued step's tokens are its rows' next output (`started`: when a stretch's
        first step, planned and run just now, started). Before reading them back the step
        after is queued (`again`, while every row is plain), so that its forward runs while
        the host reads, detokenizes and plans; rows joining or leaving end the stretch."""
        q, self.queued = self.queued, None
        span = self._span() if self.speculating else 0  # (the row's length before it)
        queuing = 0.0
        try:
            fed = []  # (a loop, not a comprehension: a call less per token)
            for r in q.rows:
                fed.append(r if r is not None and len(r.context) + 2 <= r.end else None)
            if again and fed.count(None) < len(fed) and not self.stateful and not (
                    started is None and self.speculating and self._replan(fed)):
                queuing = time.perf_counter()
                self._queue(fed, q.tokens)
                queuing = time.perf_counter() - queuing
            tokens = q.tokens.tolist()
        except Exception as e:
            self.fail(e)
            return
        now = time.perf_counter()
        seconds, self._delivered = now - (started or self._delivered), now
        if started is not None:
            # The step queued after it is not its cost: MLX's CPU backend runs most of a
            # forward before `async_eval` returns (it waits while too many of the graph's tasks
            # are in flight), so a stretch's first step timed with the next one's queuing read
            # as two forwards (the coder 1.5B: 1.0-1.3 s against 0.5 s), and the cost model
            # priced every synced step, speculative ones too, at up to 1.7x a plain one.
            seconds -= queuing
        self.pipelined += started is None
        self.steps += 1
        self.plain_steps += 1
        # A stretch's last step (none queued after it) was mostly computed while the host
        # planned: its wait is not what a plain token costs (11 ms against 64 on SmolLM2).
        timed = self.queued is not None or started is not None
        if self.speculating and timed:
            self.policy.cost.add(len(self.slots), 1, 0, None, seconds, span, started is not None)
        # (a row on its own cache learns only the steady state: not a stretch's synced first)
        if not timed or (started and not self.regime.times_stretch_start):
            seconds = None
        for r, token in zip(q.rows, tokens):
            if r is not None:
                self.rows_stepped += 1
                r.commit([token], seconds=seconds)
        nxt = self.queued
        ended = []
        if nxt is not None:
            for r in nxt.rows:
                ended.append(r is not None and r.state != DECODING)
        if True in ended:  # a row ended (a stop string, an end token): its queued token goes
            self.cache.trim_rows([int(e) for e in ended], ckpt=nxt.ckpt)
            nxt.rows = [None if e else r for r, e in zip(nxt.rows, ended)]

    def _replan(self, rows: list[BatchRow | None]) -> bool:
        """Whether a row of the stretch would propose now (a row on its own cache asks every
        step, as cheap sources end a stretch at once; shared rows at growing gaps)."""
        if not self.regime.replans_each_step:
            if self._next_replan > 0:
                self._next_replan -= 1
                return False
            self._gap = min(2 * self._gap, REPLAN_GAP_MAX)  # (a proposal ends the stretch)
            self._next_replan = self._gap - 1
        return any(k for _, k in self._plans([r for r in rows if r is not None], False))

    def _plans(self, rows: list[BatchRow], commit: bool = True) -> list[tuple[str, int]]:
        """Every row's (source, k): the batch's policy over the rows' offers, or a row's own
        plan on its own cache (by the same cost model and rule, `policy.choose_ks`).
        `commit=False`: only asking (a forced probe is not counted as taken)."""
        if self.regime.plans_by_row:
            return [r.planner.plan(r.available(self.regime.trees), r.context) for r in rows]
        return self.policy.plan_rows(rows, self.steps, commit, len(self.slots), self._span(),
                                     self._can_pipeline(rows))

    def _span(self) -> int:
        """The longest row's cached length (what a step's queries attend, less the width):
        each row's cache holds its committed tokens but the last."""
        if len(self.rows) == 1:
            return len(self.rows[0].context) - 1
        return max([len(r.context) for r in self.rows], default=1) - 1

    def fail(self, e: BaseException) -> None:
        """A step failed: every row has `e` as its `error`."""
        self.queued = None
        for r in self.rows:
            r.fail(e)

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
            if source == "draft" and self.regime.own_row is None and r not in self.drafting:
                self._join_draft(r)
            if source == "draft" and r in self.drafting:
                by_draft.setdefault(id(self.drafting[r].model), []).append(i)
                continue
            p = proposals[i] = r.proposer.propose(r.context, k, r.seed, source=source)
            if p is not None and (not isinstance(p.tokens, mx.array)
                                  or p.tokens.dtype != mx.uint32):  # (a proposer's own list)
                p.tokens = mx.array(p.tokens, mx.uint32)
            group = forward_group(source)
            if group:  # a draft (or QuantSpec's pass) on its own: k forwards
                forwards[group] = forwards.get(group, 0) + k
        widest = 0
        for model_id, members in by_draft.items():
            made = self.drafts[model_id].propose(
                [(self.drafting[rows[i]], rows[i].context, plans[i][1], rows[i].seed)
                 for i in members])
            for i, prop in zip(members, made):
                proposals[i] = prop
            self.batched_drafts += len(members)
            widest = max(widest, max(plans[i][1] for i in members))
        if widest:
            forwards["draft"] = forwards.get("draft", 0) + widest
        return proposals, forwards


def follow(batch: BatchSpeculator, row: BatchRow) -> Iterator[StepOutput | None]:
    """Step `batch` until `row` ends, yielding the row's output of each step (None after a
    step that only prefilled a chunk of its prompt); the row is closed at the end, however it
    ends (its cache to its prompt cache)."""
    pc = row.pc
    try:
        while True:
            out = row.output(batch.step())
            if out is not None or row.waiting:
                yield out
            if not row.live:
                return
    finally:
        batch.close(row)  # the cache holds every committed token but the last
        # An exception in the middle of a step (Ctrl-C, a failing callback) can leave the
        # cache holding other tokens than the row committed: not reused then.
        if pc.cache is not None and any(getattr(c, "offset", len(pc.tokens)) != len(pc.tokens)
                                        for c in caches.leaves(pc.cache)):
            pc.drop()


def _argmax_only(sampling: SamplingParams) -> bool:
    """Whether a row's next token is the argmax of its logits, with nothing to adjust."""
    return sampling == GREEDY and not getattr(sampling, "adjusted", False)


def _spread(fed: list, values, empty=None) -> list:
    """`values` (one per row fed, in order) at the rows' places in `fed`, `empty` elsewhere."""
    it = iter(values)
    return [next(it) if r is not None else empty for r in fed]
