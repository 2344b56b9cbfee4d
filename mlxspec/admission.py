"""Admission, apart from decoding (as mlx-lm keeps prompt processing apart from generation): a
resolved request becomes a row; its prompt is prefilled at once (a batch's first row), in
chunks between steps, or with the round's other joiners in one forward; its proposer starts,
and the row is handed to the batch ready to decode (`Admission.run`). Whether a request may
share a batch is the request's (`Target.shareable`, resolved once).
"""

from __future__ import annotations

import time

from .cost import StepCost
from .errors import MlxspecError
from .prefill import GROUP_PREFILL_MAX, prefill, prefill_group, reuse, start_proposer
from .request import Request
from .row import BatchRow
from .target import Target


class Admission:
    """The rows opened, not decoding yet: `opening` (a short rest of the prompt, prefilled with
    the round's other joiners at the next step), `prefilling` (a long one, a chunk per step).
    `run()` hands the batch the rows ready to decode; nothing here touches the batch."""

    def __init__(self, model, cost: StepCost):
        self.model, self.cost = model, cost
        self.opening: list[BatchRow] = []
        self.prefilling: list[BatchRow] = []
        # prefilled rows, each with whether it may decode on its own cache (not a group's)
        self.ready: list[tuple[BatchRow, bool]] = []

    def open(self, req: Request, target: Target, members: list[BatchRow], *, progress=None,
             prefill_chunk: int | None = None) -> BatchRow:
        """As `BatchSpeculator.open`; `members`: the batch's rows (none: this one is prefilled
        now, by itself)."""
        if target.model is not self.model:
            raise MlxspecError("a row of another model cannot join this batch")
        members = self.opening + self.prefilling + [r for r, _ in self.ready] + members
        if members and not (req.shares and all(r.shares for r in members)):
            raise MlxspecError("this request cannot run in the batched step")
        if any(r.pc is req.pc for r in members):
            raise MlxspecError("two requests in a batch cannot share a prompt cache")
        row = BatchRow(req, target, self.cost)
        tokens, pc = req.tokens, req.pc
        start = time.perf_counter()
        keep = reuse(target, tokens, pc, req.proposer, req.cache_reuse)
        chunk = prefill_chunk if prefill_chunk and len(tokens) - 1 - keep > prefill_chunk else 0
        row.opened(keep, time.perf_counter() - start, chunk)
        if chunk:
            self.prefilling.append(row)
        elif members and len(tokens) - len(pc.tokens) <= GROUP_PREFILL_MAX:
            self.opening.append(row)  # with the round's other joiners, at the next step
        else:
            self._prefill_alone(row, progress, shared=bool(members))
        return row

    def run(self, empty: bool) -> list[tuple[BatchRow, bool]]:
        """Before a step: a chunk of every long prompt, then the round's joiners together
        (`empty`: the batch has no rows); returns the rows ready to decode."""
        self._prefill_chunks(empty)
        self._open_pending(empty)
        ready, self.ready = self.ready, []
        return ready

    def drop(self, row: BatchRow) -> None:
        """A row closed before it joined: its cache holds what it prefilled."""
        for waiting in (self.opening, self.prefilling):
            if row in waiting:
                waiting.remove(row)
        self.ready = [(r, own) for r, own in self.ready if r is not row]

    def _prefill_chunks(self, empty: bool) -> None:
        """A chunk of every long prompt; one whose rest fits a chunk joins the round's other
        joiners (`empty`: there are no rows to join; prefilled by itself)."""
        for row in list(self.prefilling):
            req = row.request
            start = time.perf_counter()
            try:
                rest = len(req.tokens) - 1 - len(row.pc.tokens)
                if rest > row.chunk:
                    prefill(row.target, req.tokens, row.pc, req.proposer, limit=row.chunk)
                    row.prefilled_part(time.perf_counter() - start)
                    continue
                self.prefilling.remove(row)
                if empty:
                    self._prefill_alone(row, shared=False)
                else:
                    row.joins_round()
                    self.opening.append(row)
            except Exception as e:
                self._fail(row, e)

    def _prefill_alone(self, row: BatchRow, progress=None, *, shared: bool) -> None:
        """Prefill the rest of a row's prompt on its own cache, then start it (`shared`: it
        joins rows decoding already)."""
        req = row.request
        start = time.perf_counter()
        prefill(row.target, req.tokens, row.pc, req.proposer, progress=progress)
        self._start(row, time.perf_counter() - start, shared=shared)

    def _start(self, row: BatchRow, spent: float, first: int | None = None, *,
               shared: bool) -> None:
        """A prefilled row starts its proposer and is ready; with its `first` token where a
        group's forward drew it (its cache then holds its whole prompt). `shared`: it decodes
        beside other rows."""
        # (cached: reused at `open`, not the chunks prefilled since)
        start_proposer(row.target, row.request, row.prefill_seconds + spent, row.reused,
                       shared=shared)
        row.started(first)
        self.ready.append((row, first is None))

    def _open_pending(self, empty: bool) -> None:
        """The rows opened since the last step prefill together (the last prompt token too),
        each with its first token: one forward and one wait for a round's joiners, not one
        each (each wait stalls the whole batch)."""
        group = [r for r in self.opening if r.waiting]
        self.opening = []
        if not group:
            return
        start = time.perf_counter()
        try:
            if len(group) == 1 and empty:
                self._prefill_alone(group[0], shared=False)  # on its own cache
                return
            firsts = prefill_group(self.model, group)
        except Exception as e:  # the state of every row's cache is unknown
            for r in group:
                self._fail(r, e)
            return
        spent = time.perf_counter() - start
        for r, token in zip(group, firsts):
            try:  # a failure here is this row's only
                self._start(r, spent, token, shared=True)
            except Exception as e:
                self._fail(r, e)

    def _fail(self, row: BatchRow, e: BaseException) -> None:
        """A row whose prefill or start failed has `error` (its `output` raises it); its cache
        goes."""
        self.drop(row)
        row.fail(e)
        row.pc.drop()
