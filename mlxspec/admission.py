"""Admission, apart from decoding (as mlx-lm keeps prompt processing apart from generation): a
request checked (`request.prepare`) becomes a row of a batch; its prompt is prefilled at once,
in chunks between steps, or with the round's other joiners in one forward; its proposer starts
and it joins the batch's decoding rows (`join`): a first row on its own cache (any kind, no
copy), plain-attention rows in `RaggedRows` once a second joins, its draft in the draft's rows. "Can this request share a
batch?" is decided here only (`shareable`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import mlx.core as mx

from . import caches
from .caches.ragged import plain_attention
from .caches.rows import RaggedRows, RowCache
from .errors import MlxspecError
from .policy import MAX_NUM_DRAFT
from .prefill import GROUP_PREFILL_MAX, prefill, prefill_group, reuse, start_proposer
from .proposers.base import Proposer
from .proposers.draft import DraftRows, draft_proposer
from .request import prepare
from .row import BatchRow

if TYPE_CHECKING:
    from .batch_step import BatchSpeculator
    from .engine import Engine


class Admission:
    """The rows of a batch not decoding yet: `opening` (a short rest of the prompt, prefilled
    with the round's other joiners at the next step), `prefilling` (a long one, a chunk per
    step)."""

    def __init__(self, batch: BatchSpeculator):
        self.batch = batch
        self.opening: list[BatchRow] = []
        self.prefilling: list[BatchRow] = []

    def open(self, engine: Engine, prompt, *, progress=None, prefill_chunk: int | None = None,
             **request) -> BatchRow:
        """As `BatchSpeculator.open`."""
        batch = self.batch
        req = prepare(engine, prompt, **request)
        pc, proposer, tokens = req.pc, req.proposer, req.tokens
        if engine.model is not batch.model:
            raise MlxspecError("a row of another model cannot join this batch")
        members = self.opening + self.prefilling + batch.rows
        row = BatchRow(batch, engine, pc, list(tokens), proposer, req.policy, req.sampling,
                       req.seed, req.stats, len(tokens) + req.max_tokens,
                       req.num_draft or MAX_NUM_DRAFT, req.stops)
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

    def run(self) -> None:
        """Before a step: a chunk of every long prompt, then the round's joiners together."""
        self._prefill_chunks()
        self._open_pending()

    def drop(self, row: BatchRow) -> None:
        """A row closed before it joined: its cache holds what it prefilled."""
        for waiting in (self.opening, self.prefilling):
            if row in waiting:
                waiting.remove(row)
                row.opening = None

    def _prefill(self, row: BatchRow, progress=None) -> None:
        """A short rest of the prompt waits for the round's joiners, a longer one is prefilled
        now (`row_plans`: every step planned by the row, the first one too)."""
        if (not self.batch.row_plans
                and len(row.context) - len(row.pc.tokens) <= GROUP_PREFILL_MAX):
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
                self._fail(row, e)

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
        self.join(row, may_keep_own=first is None)

    def _open_pending(self) -> None:
        """The rows opened since the last step prefill together (the last prompt token too)
        and join, each with its first token: one forward and one wait for a round's joiners,
        not one each (each wait stalls the whole batch)."""
        batch = self.batch
        group = [r for r in self.opening if not r.closed]
        self.opening = []
        if not group:
            return
        start = time.perf_counter()
        try:
            if len(group) == 1 and self._keeps_own_cache(group[0]):
                self._prefill_and_join(group[0])  # on its own cache
                return
            firsts = prefill_group(batch.model, group)
        except Exception as e:  # the state of every row's cache is unknown
            for r in group:
                self._fail(r, e)
            return
        spent = time.perf_counter() - start
        self._make_room(len(group), len(group[0].pc.cache))
        for r, token in zip(group, firsts):
            try:  # a failure here is this row's only
                self._start(r, spent, token)
            except Exception as e:
                self._fail(r, e)

    def _fail(self, row: BatchRow, e: BaseException) -> None:
        """A row whose prefill or join failed has `error` (its `output` raises it); its cache
        goes."""
        batch = self.batch
        row.opening, row.error = None, e
        if row in batch.slots and row not in batch.rows:  # written in, not yet a member
            batch.rows.append(row)
        batch.leave(row)  # (out of the waiting lists too)
        row.pc.drop()

    # -- joining the decoding rows
    def _keeps_own_cache(self, row: BatchRow) -> bool:
        """A first row decodes on its own cache (any kind, no copy): the fastest for one
        request (on ragged rows one ran at 0.93x, bench/bench_batch_of_one.py), until another
        joins."""
        return not self.batch.rows

    def join(self, row: BatchRow, may_keep_own: bool = True) -> None:
        """A prefilled row starts decoding: on its own cache, or in the shared rows."""
        batch = self.batch
        if row.detok is not None:
            row.detok.start = time.perf_counter()  # decoding starts (its prefill is done)
        if may_keep_own and self._keeps_own_cache(row):
            batch.cache, batch.slots = RowCache(batch.model, row.pc.cache), [row]
            row.pc.cache = None  # the batch holds it now; given back on leaving
            batch.rows.append(row)
            return
        if not row.shares or any(not r.shares for r in batch.rows):
            raise MlxspecError("this request cannot run in the batched step")
        self._share()
        self._put(row)
        batch.rows.append(row)

    def _share(self) -> None:
        """A row on its own cache moves into ragged rows (a step queued for it undone first)."""
        batch = self.batch
        if batch.cache is None or batch.cache.shared:
            return
        batch.drop_queued()
        (row,) = batch.slots
        layers = batch.cache.take_row(0)
        batch.cache, batch.slots = None, []
        row.pc.cache = layers
        self._put(row)

    def _make_room(self, n: int, layers: int) -> None:
        """Room for `n` rows joining at once (growing copies every buffer); a row on its own
        cache moves into ragged rows first."""
        batch = self.batch
        self._share()
        need = n - batch.slots.count(None)
        if need > 0:
            if batch.cache is None:
                batch.cache = RaggedRows(layers)
            batch.cache.add_empty_rows(need)
            batch.slots.extend([None] * need)

    def _put(self, row: BatchRow) -> None:
        """Move a row's single-request cache (and its draft's) into the ragged rows."""
        batch, layers = self.batch, row.pc.cache
        if batch.cache is None:
            batch.cache = RaggedRows(len(layers))
        else:
            # Evaluated (no wait: every caller has just waited), the buffers are written in
            # place; otherwise MLX copies them whole, ~7 ms a join at 8 rows on the server.
            mx.eval(batch.cache.evaluate())
        if len(layers) != len(batch.cache.layers):
            raise MlxspecError("a row of another model cannot join this batch")
        slots = batch.slots
        b = slots.index(None) if None in slots else len(slots)
        batch.cache.put_row(b, layers)
        if b == len(slots):
            slots.append(row)
        else:
            slots[b] = row
        # Started, not waited for: a queued step may still be running; the copy joins it.
        mx.async_eval(batch.cache.evaluate())
        row.pc.cache = None  # the batch holds it now; given back on leaving
        draft = draft_proposer(row.proposer)
        if draft is not None and DraftRows.joins(draft) and not any(
                r.draft is draft for r in batch.rows):
            rows = batch.drafts.setdefault(id(draft.model), DraftRows(draft.model))
            rows.join(draft)
            row.draft = draft


def accepts(engine: Engine, mode: str | None = None) -> bool:
    """Whether a request in `mode` can share a batch with others (`shareable`)."""
    try:
        proposer = engine.proposer_of(mode)
    except MlxspecError:
        return False  # the engine path reports it
    return shareable(engine, proposer)


def shareable(engine: Engine, proposer: Proposer | None) -> bool:
    """Whether a request can share a batch with other requests (decided here only): a plain
    attention cache (a window or a recurrent state has no ragged rows yet), a chain proposer
    on the target's plain cache, an unsharded target. Others decode on their own cache."""
    if engine.kv != "fp" or engine.sync is not None:
        return False
    if proposer is not None and (proposer.uses_trees or proposer.cache_kind != "kv"):
        return False
    return plain_attention(caches.make_cache(engine.model))  # (a CacheList layer: no rows)
