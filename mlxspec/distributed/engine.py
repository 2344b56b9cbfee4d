"""The engine over a sharded target (`DistributedEngine`: every rank runs its generations in
step) and the mirroring of whole requests: rank 0's `MirroredRow`, the followers' `follow`."""

from __future__ import annotations

import inspect
import threading
import time

from ..errors import MlxspecError
from .group import Coordinator, DistributedFailure, fail, lost
from .synced import SyncedPolicy, SyncedProposer

SHARDED_MODES = ("none", "ngram", "draft", "lookahead", "suffix", "auto")


def check_mode(mode: str) -> None:
    if mode == "quantspec":
        raise MlxspecError(
            "mode 'quantspec' cannot run sharded yet (its 4-bit draft would pay every round trip "
            f"of the target); with --distributed use one of: {', '.join(SHARDED_MODES[1:])}")


def _engine_class():
    from ..engine import Engine, PromptCache
    from ..policy import FixedK

    class DistributedEngine(Engine):
        """An Engine over a sharded target whose generations every rank runs in step."""

        def __init__(self, *args, coordinator: Coordinator, **kwargs):
            self.coord = coordinator
            self._wrapped: dict[int, object] = {}
            self.slot_id = 0
            self._next_slot = 1
            super().__init__(*args, **kwargs)
            self.sync = coordinator.sync

        def clone(self):
            other = super().clone(coordinator=self.coord)
            other.slot_id, self._next_slot = self._next_slot, self._next_slot + 1
            return other

        def proposer_for(self, mode: str, **mode_options):
            check_mode(mode)
            inner = super().proposer_for(mode, **mode_options)
            if inner is None or isinstance(inner, SyncedProposer):
                return inner
            if id(inner) not in self._wrapped:
                local = mode == "ngram"
                self._wrapped[id(inner)] = (inner, SyncedProposer(inner, self.coord, local))
            return self._wrapped[id(inner)][1]

        def wrap_policy(self, policy, proposer):
            if policy is None or isinstance(policy, SyncedPolicy):
                return policy
            local = (type(policy) is FixedK and isinstance(proposer, SyncedProposer)
                     and proposer.local)
            return SyncedPolicy(policy, self.coord, local)

        def policy_for(self, proposer, signal=""):
            policy = super().policy_for(proposer, signal)
            key = ("policy", id(policy))
            if key not in self._wrapped:
                self._wrapped[key] = (policy, self.wrap_policy(policy, proposer))
            return self._wrapped[key][1]

        def open(self, prompt, **kwargs):
            """On rank 0: the request alone, opened on every rank (see `follow`)."""
            if not self.coord.leader:
                raise MlxspecError("requests open on rank 0 only; the other ranks follow")
            row = MirroredRow(self, prompt, kwargs)
            return row, row

        def open_local(self, prompt, kwargs):
            """The request opened here (every rank, in step): the ranks agree on the prompt
            cache's prefix first, so that the prefill runs the same forwards everywhere."""
            policy = kwargs.pop("policy", None)
            proposer = self.proposer_of(kwargs.get("mode"))
            if policy is not None:
                kwargs["policy"] = self.wrap_policy(policy, proposer)
            pc = kwargs.get("prompt_cache")
            if pc is None:
                pc = kwargs["prompt_cache"] = self.prompt_cache
            tokens = self.encode(prompt)
            if tokens:  # an empty prompt is refused by the engine, the cache left as it is
                self.agree_prefix(pc, tokens, self.target.cache_kind(proposer))
            return Engine.open(self, prompt, **kwargs)

        def agree_prefix(self, pc: PromptCache, tokens: list[int], kind: str) -> int:
            """Make every rank's `pc` hold the same prefix of the prompt, the longest that
            every rank can reuse, so that the prefill that follows runs the same forwards (and
            collectives) everywhere: rank 0's cache is the server's, the followers' their own
            mirror of it, and a follower may hold less (a cache it never saw, another eviction).
            Returns the agreed length: the engine's prefill then reuses exactly that."""
            target = tokens[:-1]  # what the prefill brings the cache to (`prefill.prefill`)
            limit = len(target)
            while True:
                keep = pc.reuse_prefix(target[:limit], kind) if limit else 0
                lo, hi = self.coord.agree_min(keep)
                if lo == hi:
                    break
                limit = lo  # the ranks that hold more trim to the shortest and ask again
            if keep == 0:  # nothing reused anywhere: no rank may find a prefix later either
                pc.drop()
            return keep

    return DistributedEngine


_ENGINE_CLASS = None


def engine_class():
    global _ENGINE_CLASS
    if _ENGINE_CLASS is None:
        _ENGINE_CLASS = _engine_class()
    return _ENGINE_CLASS


# ----------------------------------------------------------------------------- mirroring

OPEN, STEP, CLOSE, EXIT = 1, 2, 3, 4
_gen_ids = iter(range(1, 1 << 30))


def _request(engine, prompt, kwargs) -> dict:
    """What a follower needs to run the same generation: JSON-able."""
    coord = engine.coord
    kw = dict(kwargs)
    kw.pop("progress", None)
    # a misspelt keyword is refused here (TypeError), before any rank hears of the request
    inspect.signature(engine.request).bind(prompt, **{k: v for k, v in kw.items()
                                                      if k != "prefill_chunk"})
    policy = kw.pop("policy", None)
    kw.pop("prompt_cache", None)
    if kw.get("seed") is None:  # one seed for every rank (their draws keyed alike)
        kw["seed"] = time.time_ns() % 2**31
    prediction = kw.get("prediction")
    if prediction is not None and not isinstance(prediction, str):
        kw["prediction"] = [int(t) for t in prediction]
    return {"prompt": engine.encode(prompt), "kwargs": kw, "mode": engine.mode,
            "mode_options": engine.mode_options,
            "num_draft": engine.num_draft if engine.num_draft_set else None,
            "policy": None if policy is None else _policy_spec(policy),
            # The prompt cache: None for the engine's own (generate, chat), else the id of the
            # server's cache; and the ids rank 0 still holds.
            "cache": None if (pc := kwargs.get("prompt_cache")) is None else coord.cache_id(pc),
            "live": coord.live_cache_ids(), "slot": engine.slot_id,
            # Rank 0's end-of-sequence set: chat, edit and the server add the chat template's
            # turn-end tokens on rank 0 only, and every rank must stop at the same token.
            "eos": sorted(getattr(engine.tokenizer, "eos_token_ids", None) or []),
            "delay": meter.delay if (meter := getattr(engine.coord, "meter", None)) else None}


def _policy_spec(policy) -> dict | None:
    from ..policy import AdaptiveK, FixedK

    if type(policy) is FixedK:
        return {"kind": "fixed", "k": policy.max_k}
    if type(policy) is AdaptiveK:
        return {"kind": "adaptive", "max_k": policy.max_k}
    return {"kind": "other"}


def _policy_from(spec):
    from ..policy import AdaptiveK, FixedK

    if spec is None:
        return None
    if spec["kind"] == "fixed":
        return FixedK(spec["k"])
    return AdaptiveK(max_k=spec.get("max_k", 8))  # its plan comes from rank 0 anyway


class MirroredRow:
    """Rank 0's side of a request alone: a row of a batch of one (`Engine.open`) whose
    opening, steps and closing it tells the followers to repeat. It is its own batch of one:
    whoever holds it steps it and takes the row's output, as a `BatchRow`'s."""

    def __init__(self, engine, prompt, kwargs):
        self.engine, self.coord = engine, engine.coord
        self.gid = next(_gen_ids)
        self.error: BaseException | None = None
        self.done = self.closed = self.released = False
        self.row = None
        if self.coord.broken:  # a server between a lost rank and its exit
            raise DistributedFailure(self.coord.broken)
        self.coord.mirrored += 1
        self.coord.arm("a generation")
        try:
            request = _request(engine, prompt, kwargs)
            self._guard(self._send, OPEN, request)
            kwargs = dict(kwargs)
            kwargs["seed"] = request["kwargs"].get("seed", 0)
            self.local, self.row = self._guard(engine.open_local, prompt, kwargs)
        except BaseException:  # no row to close
            self._release()
            raise

    def _release(self) -> None:
        """This request no longer needs the watchdog; it is off once no mirrored one does."""
        if not self.released:
            self.released = True
            self.coord.mirrored -= 1
            if not self.coord.mirrored:
                self.coord.disarm()

    @property
    def ended(self) -> bool:
        return self.row.ended

    @property
    def live(self) -> bool:
        return not self.done and self.error is None and self.row.live

    @property
    def waiting(self) -> bool:
        return self.row.waiting

    @property
    def pc(self):
        return self.row.pc

    @property
    def context(self) -> list[int]:
        return self.row.context

    def _send(self, op: int, payload=None) -> None:
        self.coord.bcast_ints([op, self.gid], 2)
        if payload is not None:
            self.coord.bcast_obj(payload)

    def _guard(self, work, *args):
        """work(*args), with a lost rank said as one (`DistributedFailure`)."""
        if self.coord.broken:  # a server between a lost rank and its exit
            self.done = True
            raise DistributedFailure(self.coord.broken)
        try:
            return work(*args)
        except DistributedFailure as e:
            self._lost(str(e))
            raise
        except MlxspecError:  # a bad request: every rank raises it at the same point
            self.done = True
            self._release()
            raise
        except RuntimeError as e:
            self._lost(lost(self.coord.rank, e))
            raise DistributedFailure(lost(self.coord.rank, e)) from None

    def step(self) -> dict:
        """One step, on every rank: {self: its output} (a failure: raised by `output`)."""
        if self.done:
            return {}
        try:
            self._guard(self._send, STEP)
            self.coord.tick()
            out = self.row.output(self._guard(self.local.step))
        except Exception as e:
            self.fail(e)
            return {}
        return {} if out is None else {self: out}

    def fail(self, e: BaseException) -> None:
        self.error = e

    def output(self, produced: dict):
        if self.error is not None:
            raise self.error
        return produced.get(self)

    def _lost(self, message: str) -> None:
        """Another rank is lost: every later generation would fail too. A command, or the
        server's worker thread, ends the process (`Coordinator.abandon`: a server first
        answers the requests in flight with the error); otherwise (the Python API) the caller
        raises DistributedFailure, and later generations fail at once."""
        self.done = True
        if self.coord.exit_on_loss or threading.current_thread() is not threading.main_thread():
            self.coord.abandon(message)
        self.coord.broken = self.coord.broken or message

    def close(self, row=None) -> None:
        """Close the request on every rank (`row`: itself, as a batch closes its row)."""
        if self.row is None or self.closed:
            return
        self.closed = True
        if self.coord.broken:  # no collective after a lost rank: it could hang
            return
        if self.done:  # a bad request ended it on every rank: each closes its own
            self.local.close(self.row)
            return
        self.done = True
        try:
            self._send(CLOSE)
            self.local.close(self.row)
        except RuntimeError as e:
            self._lost(lost(self.coord.rank, e))
            raise DistributedFailure(lost(self.coord.rank, e)) from None
        finally:
            self._release()


def follow(engine, on_step=None) -> None:
    """A follower rank's whole life: open, step and close rank 0's requests in step until it
    says stop. `on_step(gid, output)` sees each step's output (tests: the tokens every rank
    commits)."""
    from mlx_lm.generate import wired_limit

    with wired_limit(engine.model):  # the weights wired (Metal), as on rank 0
        _follow(engine, on_step)


def _follow(engine, on_step) -> None:
    from ..engine import PromptCache

    coord = engine.coord
    rows: dict[int, object] = {}
    slots = {0: engine}
    held: dict[int, object] = {}  # this rank's shard of each of rank 0's server prompt caches
    while True:
        try:
            op, gid = coord.bcast_ints(None, 2)
            if op == EXIT:
                return
            if op == OPEN:
                req = coord.bcast_obj()
                coord.arm("a generation")
                meter = getattr(coord, "meter", None)
                if meter is not None and req.get("delay") is not None:
                    meter.delay = req["delay"]  # bench: rank 0's injected delay
                slot = slots.get(req["slot"])
                if slot is None:
                    slot = slots[req["slot"]] = engine.clone()
                if req["mode"] != slot.mode or req["mode_options"] != slot.mode_options or (
                        req["num_draft"] is not None and req["num_draft"] != slot.num_draft):
                    slot.set_mode(req["mode"], num_draft=req["num_draft"], **req["mode_options"])
                if req.get("eos") is not None and hasattr(slot.tokenizer, "eos_token_ids"):
                    slot.tokenizer.eos_token_ids = req["eos"]
                kwargs = dict(req["kwargs"])
                if req["policy"] is not None:
                    kwargs["policy"] = _policy_from(req["policy"])
                for cid in set(held) - set(req["live"]):
                    del held[cid]
                if req["cache"] is not None:
                    kwargs["prompt_cache"] = held.setdefault(req["cache"], PromptCache())
                try:
                    rows[gid] = slot.open_local(req["prompt"], kwargs)  # (batch, row)
                except MlxspecError as e:  # rank 0 hits the same error and reports it
                    if isinstance(e, DistributedFailure):
                        raise
            elif op == STEP and gid in rows:
                batch, row = rows[gid]
                try:
                    out = row.output(batch.step())
                except MlxspecError as e:  # rank 0 hits the same error, and closes its own
                    if isinstance(e, DistributedFailure):
                        raise
                    batch.close(rows.pop(gid)[1])
                    out = None
                coord.tick()
                if on_step is not None and out is not None:  # (None: a prefill chunk)
                    on_step(gid, out)
            elif op == CLOSE and gid in rows:
                batch, row = rows.pop(gid)
                batch.close(row)
            if not rows:
                coord.disarm()
        except RuntimeError as e:
            fail(lost(coord.rank, e))
        except DistributedFailure as e:
            fail(str(e))


def finish(engine) -> None:
    """Rank 0: tell the followers to stop (at exit)."""
    coord = engine.coord
    if coord.leader and not getattr(coord, "finished", False):
        coord.finished = True
        try:
            coord.bcast_ints([EXIT, 0], 2)
        except Exception:
            pass
