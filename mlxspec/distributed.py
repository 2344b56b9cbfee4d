"""Speculation with a target sharded over several processes (several Macs), on MLX's own
distributed engine, started by `mlx.launch` (docs/SEVERAL_MACS.md).

Every rank holds a shard of the target (mlx-lm's `sharded_load`: tensor parallel where the
architecture has `shard`, pipeline parallel where it has `pipeline`) and runs identical forwards
with identical shapes. Rank 0 decides everything else and the others follow:

- the policy's (source, k) is rank 0's, broadcast as a fixed-size packet (`SyncedPolicy`), except
  where every rank computes the same plan from the same tokens (FixedK over a cheap proposer);
- the proposal is rank 0's, broadcast as a fixed-size packet of tokens and tree parents
  (`SyncedProposer`); a draft model runs on rank 0 only (it is loaded whole on every rank);
- the verification result (accepted count, next token, the draft) is rank 0's, broadcast inside
  the graph before the step's one host sync (`Coordinator.sync`, `step.decode_step(sync=...)`),
  and so is every plain token: every rank trims its cache the same way, and nothing depends on
  logits being bit-identical across ranks;
- whole generations are mirrored: rank 0's `stream_steps` (from generate, chat, bench or the
  server's worker) sends each request, step and close to the other ranks, which run `follow`
  instead of the command; only rank 0 reads input, prints, writes files and serves HTTP.

- prompt caches: before each prefill every rank agrees (one all_min) on the prefix it keeps,
  so the prefill runs the same forwards everywhere; the followers hold their shard of each of
  the server's caches under an id rank 0 gives it (`Coordinator.cache_id`).

Failures: a rank that dies closes its sockets and the ring backend raises on the others, or
the watchdog finds the closed socket (`ring_peer_closed`); a command then exits 1 with a clear
error (`DistributedFailure`), a server first answers its requests in flight with it
(`Coordinator.abandon`, `on_lost`). A rank stuck inside a generation trips the watchdog
(`MLXSPEC_DIST_TIMEOUT`, default 120 s without progress) and the process exits 1.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterator

import mlx.core as mx

from .errors import MlxspecError
from .proposers.base import Proposal, Proposer

STRATEGIES = ("auto", "tensor", "pipeline")
SHARDED_MODES = ("none", "ngram", "draft", "lookahead", "auto")
MAX_NODES = 256  # proposal packet capacity (chain tokens or tree nodes)
SOURCE_BYTES = 32  # a source name ("ngram:4", "draft") in the plan packet
DEFAULT_TIMEOUT = 120.0  # seconds without progress inside a generation
LOST_GRACE = 1.5  # seconds a server has to answer its requests with the error before it exits
STALL_CHECK = 2.0  # seconds without progress before the watchdog looks for a dead peer


class DistributedFailure(MlxspecError):
    """Another rank failed, or a collective timed out."""

    fatal = True  # the CLI exits 1 at once (no teardown that could wait on a dead rank)


# ----------------------------------------------------------------------------- the group


def loopback_hostfile(path, ranks: int):
    """Write a ring hostfile for `ranks` processes on this machine (free loopback ports), as
    the tests and bench/bench_distributed.py start them; returns `path`."""
    import socket
    from pathlib import Path

    socks = [socket.socket() for _ in range(ranks)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    Path(path).write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
    return path


def launched() -> bool:
    """Whether this process was started as one rank of several (by mlx.launch or by hand)."""
    return any(os.environ.get(v) for v in ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "MLX_HOSTFILE",
                                           "MLX_JACCL_COORDINATOR"))


def init_group():
    """MLX's distributed group; size 1 when this process was not launched as a rank."""
    if not launched():
        return mx.distributed.init()
    try:
        return mx.distributed.init(strict=True)
    except RuntimeError as e:
        raise MlxspecError(f"--distributed: cannot join the other ranks ({e}); start the "
                           "command with mlx.launch (docs/SEVERAL_MACS.md)") from None


class Coordinator:
    """Rank, broadcasts from rank 0, collective counting and the watchdog."""

    def __init__(self, group, timeout: float | None = None):
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        if timeout is None:
            timeout = float(os.environ.get("MLXSPEC_DIST_TIMEOUT", DEFAULT_TIMEOUT))
        self.timeout = timeout
        self.collectives = 0  # issued by this rank: ours plus the model's (when counted)
        self._deadline: float | None = None
        self._what = ""
        self._lock = threading.Lock()
        # Set once another rank is lost: no collective may run after that (it could hang).
        self.broken: str | None = None
        # `on_lost(message)`: a server's way to answer its requests with the error before the
        # process ends (`abandon`); None: the process ends at once.
        self.on_lost = None
        self.watch_idle = False  # serve (rank 0): look for a dead rank between requests too
        # A command (cli_engine): a lost rank ends the process even where the command would
        # report an error and go on (chat). The Python API raises DistributedFailure instead.
        self.exit_on_loss = False
        self._idle_checked = 0.0
        # Rank 0: the prompt caches it has handed to mirrored generations, by id (weakly: an
        # id whose cache rank 0 dropped is dropped by the followers at the next request).
        self.cache_refs: dict[int, weakref.ref] = {}
        self.next_cache_id = 1
        self._watch = threading.Thread(target=self._watchdog, name="mlxspec-watchdog",
                                       daemon=True)
        self._watch.start()

    @property
    def leader(self) -> bool:
        return self.rank == 0

    # -- the watchdog: never hang inside a generation
    def arm(self, what: str) -> None:
        with self._lock:
            self._what = what
            self._deadline = time.monotonic() + self.timeout

    def tick(self) -> None:
        with self._lock:
            if self._deadline is not None:
                self._deadline = time.monotonic() + self.timeout

    def disarm(self) -> None:
        with self._lock:
            self._deadline = None

    def abandon(self, message: str) -> None:
        """Another rank is lost: end this process with `message` (exit 1). With `on_lost` set
        (serve), it runs first and the process ends `LOST_GRACE` seconds later, so that the
        requests in flight get the error as their answer instead of a dropped connection."""
        with self._lock:
            first, self.broken = self.broken is None, self.broken or message
            hook = self.on_lost
        if hook is None:
            fail(message)
        if not first:
            return
        try:
            hook(message)
        except Exception:
            pass
        timer = threading.Timer(LOST_GRACE, fail, (message,))
        timer.daemon = True
        timer.start()

    def _watchdog(self) -> None:
        while True:
            time.sleep(min(1.0, max(self.timeout / 10, 0.05)))
            with self._lock:
                now = time.monotonic()
                late = self._deadline is not None and now > self._deadline
                stalled = (self._deadline is not None
                           and now > self._deadline - self.timeout + STALL_CHECK)
                # An idle server (no collective pending) looks for a dead rank too, so that
                # it exits now rather than at its next request; not once it is stopping (the
                # others then exit on purpose).
                idle = (self.watch_idle and self._deadline is None
                        and not getattr(self, "finished", False)
                        and now - self._idle_checked > STALL_CHECK)
                if idle:
                    self._idle_checked = now
            if (stalled and not late or idle) and ring_peer_closed():
                # The ring backend does not fail a collective whose peer died mid-way (it
                # reports "Socket N was closed by the peer" and waits): stop now, not at the
                # timeout.
                self.abandon(lost(self.rank, "its socket was closed by the peer"))
            elif late:
                self.abandon(f"rank {self.rank}: no progress for {self.timeout:.0f} s during "
                             f"{self._what} (another rank is stuck or unreachable); stopping "
                             "(MLXSPEC_DIST_TIMEOUT sets the limit)")

    # -- collectives
    def sync(self, x: mx.array) -> mx.array:
        """Rank 0's value of `x` on every rank, lazily (inside the graph)."""
        self.tick()
        self.collectives += 1
        dtype = x.dtype
        if dtype == mx.bool_:
            x = x.astype(mx.int32)
        elif dtype == mx.uint32:
            x = x.astype(mx.int32)  # token ids < 2**31
        # The followers' zeros depend on their own x: the forward that computes it (and its
        # collectives) runs before this one on every rank, in the same order.
        mine = x if self.leader else mx.depends(mx.zeros_like(x), x)
        out = mx.distributed.all_sum(mine, group=self.group)
        return out.astype(dtype) if out.dtype != dtype else out

    def bcast_ints(self, values: list[int] | None, size: int) -> list[int]:
        """Rank 0's `values` (padded to `size`) on every rank; blocking."""
        if self.leader:
            if len(values) > size:
                raise DistributedFailure(f"packet of {len(values)} values exceeds {size}")
            data = mx.array(list(values) + [0] * (size - len(values)), mx.int32)
        else:
            data = mx.zeros((size,), mx.int32)
        try:
            return self.sync(data).tolist()
        except RuntimeError as e:
            raise DistributedFailure(lost(self.rank, e)) from None

    def agree_min(self, value: int) -> tuple[int, int]:
        """(min, max) of `value` over the ranks; blocking."""
        self.tick()
        self.collectives += 1
        try:
            lo, neg_hi = mx.distributed.all_min(mx.array([value, -value], mx.int32),
                                                group=self.group).tolist()
        except RuntimeError as e:
            raise DistributedFailure(lost(self.rank, e)) from None
        return lo, -neg_hi

    def cache_id(self, pc) -> int:
        """Rank 0: the id under which the followers hold their shard of prompt cache `pc`."""
        cid = getattr(pc, "dist_id", None)
        if cid is None:
            cid = pc.dist_id = self.next_cache_id
            self.next_cache_id += 1
            self.cache_refs[cid] = weakref.ref(pc)
        return cid

    def live_cache_ids(self) -> list[int]:
        """Rank 0: the ids of the prompt caches it still holds (the followers drop the rest)."""
        for cid in [c for c, ref in self.cache_refs.items() if ref() is None]:
            del self.cache_refs[cid]
        return sorted(self.cache_refs)

    def bcast_obj(self, obj=None):
        """A JSON-able object from rank 0 (two collectives: length, then the bytes)."""
        raw = json.dumps(obj).encode() if self.leader else b""
        (n,) = self.bcast_ints([len(raw)], 1)
        words = (n + 3) // 4
        vals = None
        if self.leader:
            padded = raw + b"\0" * (4 * words - n)
            vals = [int.from_bytes(padded[i:i + 4], "little", signed=True)
                    for i in range(0, len(padded), 4)]
        got = self.bcast_ints(vals, max(words, 1))[:words]
        data = b"".join(int(v).to_bytes(4, "little", signed=True) for v in got)[:n]
        return json.loads(data.decode())


def _ring_ports() -> set[int]:
    """The ports of the ring backend's hostfile (MLX_HOSTFILE: a JSON list, per rank, of
    "ip:port"); empty without one (another backend)."""
    import re

    path = os.environ.get("MLX_HOSTFILE")
    try:
        text = open(path).read() if path else ""
    except OSError:
        return set()
    return {int(p) for p in re.findall(r":(\d+)\"", text)}


def ring_peer_closed() -> bool:
    """Whether one of this process's ring sockets was closed by its peer (another rank died):
    a non-blocking peek at every socket to or from a hostfile port reads end-of-file."""
    import socket
    import stat

    ports = _ring_ports()
    flags = socket.MSG_PEEK | getattr(socket, "MSG_DONTWAIT", 0)
    if not ports or not getattr(socket, "MSG_DONTWAIT", 0):
        return False
    try:
        fds = [int(n) for n in os.listdir("/dev/fd")]
    except OSError:
        return False
    for fd in fds:
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET,
                                                                      socket.AF_INET6):
                continue
            if sock.getsockname()[1] not in ports and sock.getpeername()[1] not in ports:
                continue
            if sock.recv(1, flags) == b"":
                return True
        except (BlockingIOError, InterruptedError):
            pass
        except ConnectionResetError:
            return True
        except OSError:
            pass
        finally:
            sock.close()
    return False


def lost(rank: int, e: BaseException | str) -> str:
    return (f"rank {rank}: lost another rank ({e}); every rank stops "
            "(see the other ranks' output for the cause)")


def fail(message: str, code: int = 1) -> None:
    """Print the error and end this process now (no atexit: pending collectives would hang)."""
    try:
        sys.stdout.flush()
    except Exception:
        pass
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    os._exit(code)


def encode_source(source: str) -> list[int]:
    raw = source.encode()[:SOURCE_BYTES]
    return [len(raw)] + list(raw) + [0] * (SOURCE_BYTES - len(raw))


def decode_source(vals: list[int]) -> str:
    n = vals[0]
    return bytes(vals[1:1 + n]).decode(errors="replace")


class CollectiveMeter:
    """Bench only (`mlxspec bench --distributed`): counts every collective this process issues
    (ours and the sharded model's) and, with `delay` > 0, evaluates each one as it is issued
    and then sleeps `delay` seconds: a stand-in for the network latency that loopback hides
    (every rank sleeps, as every rank would wait for the wire). Installed by wrapping
    `mx.distributed.all_sum`, `all_gather`, `send`, `recv_like`, ... (mlx-lm's sharded
    layers and pipelines look them up at call time)."""

    NAMES = ("all_sum", "all_gather", "all_max", "all_min", "sum_scatter", "send", "recv",
             "recv_like")

    def __init__(self, delay: float = 0.0):
        self.count = 0
        self.delay = delay
        self.waited = 0.0  # seconds really slept (sleep overshoots short delays)
        self._orig: dict[str, object] = {}

    def install(self) -> CollectiveMeter:
        for name in self.NAMES:
            fn = getattr(mx.distributed, name, None)
            if fn is not None and name not in self._orig:
                self._orig[name] = fn
                setattr(mx.distributed, name, self._wrap(fn))
        return self

    def uninstall(self) -> None:
        for name, fn in self._orig.items():
            setattr(mx.distributed, name, fn)
        self._orig.clear()

    def _wrap(self, fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            self.count += 1
            if self.delay > 0:
                mx.eval(out)
                start = time.perf_counter()
                time.sleep(self.delay)
                self.waited += time.perf_counter() - start
            return out

        return wrapped


# ----------------------------------------------------------------------------- wrappers


class SyncedPolicy:
    """Rank 0's plan on every rank. `local`: every rank computes the same plan itself (FixedK
    over a cheap, deterministic proposer: the plan is a function of the committed tokens)."""

    def __init__(self, inner, coord: Coordinator, local: bool):
        self.inner, self.coord, self.local = inner, coord, local

    @property
    def max_k(self) -> int:
        return self.inner.max_k

    def plan(self, available: dict[str, int]) -> tuple[str, int]:
        if self.local:
            return self.inner.plan(available)
        source, k = self.inner.plan(available) if self.coord.leader else ("", 0)
        vals = self.coord.bcast_ints([k] + encode_source(source), 2 + SOURCE_BYTES)
        return decode_source(vals[1:]), vals[0]

    def observe(self, *args, **kwargs) -> None:
        self.inner.observe(*args, **kwargs)

    def observe_plain(self, *args, **kwargs) -> None:
        if hasattr(self.inner, "observe_plain"):
            self.inner.observe_plain(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class SyncedProposer(Proposer):
    """Rank 0 proposes; the proposal reaches every rank as a fixed-size packet
    [n, is_tree, has_verify] + source + tokens + parents + verify flags. With `local` (ngram:
    deterministic from the committed tokens) every rank proposes itself, no packet; the step's
    result sync then checks that the drafts agreed."""

    def __init__(self, inner: Proposer, coord: Coordinator, local: bool):
        self.inner, self.coord, self.local = inner, coord, local
        self.name = inner.name
        self.cheap = inner.cheap
        self.uses_trees = inner.uses_trees
        self.cache_kind = inner.cache_kind
        self.adaptive = getattr(inner, "adaptive", False)

    @property
    def runs_inner(self) -> bool:
        return self.coord.leader or self.local

    def make_target_cache(self, model):
        return self.inner.make_target_cache(model)

    def bind_cache(self, cache: list) -> None:
        self.inner.bind_cache(cache)

    def set_prediction(self, tokens) -> None:
        self.inner.set_prediction(tokens)

    def reset(self, prompt, sampling) -> None:
        if self.runs_inner:  # a draft model prefills on rank 0 only
            self.inner.reset(prompt, sampling)

    def available(self, context, cap):
        if self.runs_inner:
            return self.inner.available(context, cap)
        return {self.name: cap}  # unused: the plan comes from rank 0

    def propose(self, context, num_draft, key, source=None):
        if self.local:
            p = self.inner.propose(context, num_draft, key, source=source)
            if not self.coord.leader:
                self._own = p.tokens.tolist() if p is not None and not p.is_tree else None
            return p
        p = None
        if self.coord.leader:
            p = self.inner.propose(context, num_draft, key, source=source)
            n = len(p) if p is not None else 0
            if n > MAX_NODES:
                raise DistributedFailure(f"a proposal of {n} tokens exceeds the packet "
                                         f"({MAX_NODES}); use a smaller k or tree budget")
            vals = [n, int(p is not None and p.is_tree), int(p is not None and p.verify is not None)]
            vals += encode_source(p.source if p is not None else "")
            if n:
                vals += p.tokens.tolist()
                if p.is_tree:
                    vals += [q + 1 for q in p.parents]
                if p.verify is not None:
                    vals += [int(v) for v in p.verify]
            self.coord.bcast_ints(vals, 3 + 1 + SOURCE_BYTES + 3 * MAX_NODES)
            return p
        vals = self.coord.bcast_ints(None, 3 + 1 + SOURCE_BYTES + 3 * MAX_NODES)
        n, is_tree, has_verify = vals[:3]
        source = decode_source(vals[3:4 + SOURCE_BYTES])
        if n == 0:
            return None
        at = 4 + SOURCE_BYTES
        tokens = vals[at:at + n]
        at += n
        parents = verify = None
        if is_tree:
            parents = [q - 1 for q in vals[at:at + n]]
            at += n
        if has_verify:
            verify = [bool(v) for v in vals[at:at + n]]
        # No draft probabilities here: rank 0's verification result is the one every rank uses.
        return Proposal(tokens=mx.array(tokens, mx.uint32), source=source, parents=parents,
                        verify=verify)

    def update(self, context, num_accepted) -> None:
        own, self._own = getattr(self, "_own", None), None
        if own is not None and num_accepted and (
                own[:num_accepted] != context[-1 - num_accepted:-1]):
            raise DistributedFailure(f"rank {self.coord.rank}: its {self.name} draft differs "
                                     "from rank 0's (a non-deterministic proposer)")
        if self.runs_inner:
            self.inner.update(context, num_accepted)

    def stats(self) -> dict:
        return self.inner.stats()


# ----------------------------------------------------------------------------- the engine


def _engine_class():
    from .engine import Engine, PromptCache
    from .policy import FixedK

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

        def policy_for(self, proposer):
            policy = super().policy_for(proposer)
            key = ("policy", id(policy))
            if key not in self._wrapped:
                self._wrapped[key] = (policy, self.wrap_policy(policy, proposer))
            return self._wrapped[key][1]

        def stream_steps(self, prompt, **kwargs):
            """On rank 0: the generation, mirrored on every rank (see `follow`)."""
            if not self.coord.leader:
                raise MlxspecError("stream_steps runs on rank 0 only; the other ranks follow")
            return Mirrored(self, prompt, kwargs)

        def run_local(self, prompt, kwargs):
            """The generation itself (every rank, in step)."""
            mode = kwargs.get("mode") or self.mode
            policy = kwargs.pop("policy", None)
            if policy is not None:
                proposer = self.proposer if mode == self.mode else self.proposer_for(mode)
                kwargs["policy"] = self.wrap_policy(policy, proposer)
            return self._agreed_steps(prompt, mode, kwargs)

        def _agreed_steps(self, prompt, mode: str, kwargs):
            # A generator: the agreement and any error (a bad mode, a bad prompt) come at the
            # first step, at the same point on every rank (rank 0's STEP packet, then this).
            pc = kwargs.get("prompt_cache")
            if pc is None:
                pc = kwargs["prompt_cache"] = self.prompt_cache
            tokens = self.encode(prompt)
            if tokens:  # an empty prompt is refused by the engine, the cache left as it is
                proposer = self.proposer if mode == self.mode else self.proposer_for(mode)
                self.agree_prefix(pc, tokens, self.cache_kind(proposer))
            yield from Engine.stream_steps(self, prompt, **kwargs)

        def agree_prefix(self, pc: PromptCache, tokens: list[int], kind: str) -> int:
            """Make every rank's `pc` hold the same prefix of the prompt, the longest that
            every rank can reuse, so that the prefill that follows runs the same forwards (and
            collectives) everywhere: rank 0's cache is the server's, the followers' their own
            mirror of it, and a follower may hold less (a cache it never saw, another eviction).
            Returns the agreed length: the engine's prefill then reuses exactly that."""
            target = tokens[:-1]  # what the prefill brings the cache to (Engine.prefill)
            limit = len(target)
            while True:
                keep = pc.reuse_prefix(target[:limit], kind) if limit else 0
                lo, hi = self.coord.agree_min(keep)
                if lo == hi:
                    break
                limit = lo  # the ranks that hold more trim to the shortest and ask again
            if keep == 0:  # nothing reused anywhere: no rank may find a prefix later either
                pc.cache, pc.tokens, pc.checkpoint = None, [], None
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
    policy = kw.pop("policy", None)
    kw.pop("prompt_cache", None)
    if kw.get("seed", 0) is None:  # one seed for every rank
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
    from .policy import AdaptiveK, FixedK

    if type(policy) is FixedK:
        return {"kind": "fixed", "k": policy.num_draft}
    if type(policy) is AdaptiveK:
        return {"kind": "adaptive", "max_k": policy.max_k}
    return {"kind": "other"}


def _policy_from(spec):
    from .policy import AdaptiveK, FixedK

    if spec is None:
        return None
    if spec["kind"] == "fixed":
        return FixedK(spec["k"])
    return AdaptiveK(max_k=spec.get("max_k", 8))  # its plan comes from rank 0 anyway


class Mirrored:
    """Rank 0's side of one generation: a generator that tells the followers to open, step and
    close the same generation as it does each of these."""

    def __init__(self, engine, prompt, kwargs):
        self.engine, self.coord = engine, engine.coord
        self.prompt, self.kwargs = prompt, kwargs
        self.gid = next(_gen_ids)
        self.inner: Iterator | None = None
        self.done = False

    def __iter__(self):
        return self

    def _send(self, op: int, payload=None) -> None:
        self.coord.bcast_ints([op, self.gid], 2)
        if payload is not None:
            self.coord.bcast_obj(payload)

    def __next__(self):
        if self.done:
            raise StopIteration
        if self.coord.broken:  # a server between a lost rank and its exit
            self.done = True
            raise DistributedFailure(self.coord.broken)
        try:
            if self.inner is None:
                self.coord.arm("a generation")
                request = _request(self.engine, self.prompt, self.kwargs)
                self._send(OPEN, request)
                kwargs = dict(self.kwargs)
                kwargs["seed"] = request["kwargs"].get("seed", 0)
                self.inner = self.engine.run_local(self.prompt, kwargs)
            self._send(STEP)
            self.coord.tick()
            return next(self.inner)
        except StopIteration:
            self.done = True
            self.coord.disarm()
            raise
        except DistributedFailure as e:
            self._lost(str(e))
            raise
        except MlxspecError:  # a bad request: every rank raises it at the same point
            self.done = True
            self.coord.disarm()
            raise
        except RuntimeError as e:
            self._lost(lost(self.coord.rank, e))
            raise DistributedFailure(lost(self.coord.rank, e)) from None

    def _lost(self, message: str) -> None:
        """Another rank is lost: every later generation would fail too. A command, or the
        server's worker thread, ends the process (`Coordinator.abandon`: a server first
        answers the requests in flight with the error); otherwise (the Python API) the caller
        raises DistributedFailure, and later generations fail at once."""
        self.done = True
        if self.coord.exit_on_loss or threading.current_thread() is not threading.main_thread():
            self.coord.abandon(message)
        self.coord.broken = self.coord.broken or message

    def close(self) -> None:
        if self.coord.broken:  # no collective after a lost rank: it could hang
            self.done = True
        if self.inner is not None and not self.done:
            self.done = True
            try:
                self._send(CLOSE)
                self.inner.close()
            except RuntimeError as e:
                self._lost(lost(self.coord.rank, e))
                raise DistributedFailure(lost(self.coord.rank, e)) from None
            finally:
                self.coord.disarm()


def follow(engine, on_step=None) -> None:
    """A follower rank's whole life: run rank 0's generations in step until it says stop.
    `on_step(gid, output)` sees each step's output (tests: the tokens every rank commits)."""
    from .engine import PromptCache
    coord = engine.coord
    gens: dict[int, Iterator] = {}
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
                gens[gid] = slot.run_local(req["prompt"], kwargs)
            elif op == STEP:
                gen = gens.get(gid)
                try:
                    out = next(gen)
                    coord.tick()
                    if on_step is not None:
                        on_step(gid, out)
                except StopIteration:
                    gens.pop(gid, None)
                except MlxspecError as e:  # rank 0 hits the same error and reports it
                    if isinstance(e, DistributedFailure):
                        raise
                    gens.pop(gid, None)
                if not gens:
                    coord.disarm()
            elif op == CLOSE:
                gen = gens.pop(gid, None)
                if gen is not None:
                    gen.close()
                if not gens:
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


# ----------------------------------------------------------------------------- checks, loading


def check_mode(mode: str) -> None:
    if mode == "quantspec":
        raise MlxspecError(
            "mode 'quantspec' cannot run sharded yet (its 4-bit draft would pay every round trip "
            f"of the target); with --distributed use one of: {', '.join(SHARDED_MODES[1:])}")


def choose_strategy(config: dict, size: int, strategy: str) -> str:
    """'tensor' or 'pipeline' for this architecture over `size` ranks, or a clear refusal;
    needs only config.json (nothing is loaded)."""
    from mlx_lm.utils import _get_classes

    if strategy not in STRATEGIES:
        raise MlxspecError(f"--distributed must be one of {', '.join(STRATEGIES)}, "
                           f"got {strategy!r}")
    try:
        model_cls, args_cls = _get_classes(config)
    except ValueError as e:
        raise MlxspecError(f"cannot shard: {e}") from None
    model = model_cls(args_cls.from_dict(config))  # lazy: no weights are computed
    arch = config.get("model_type", "?")
    can_tensor = hasattr(model, "shard")
    can_pipe = hasattr(model, "model") and hasattr(model.model, "pipeline")
    if not can_tensor and not can_pipe:
        raise MlxspecError(
            f"architecture {arch!r} can be neither tensor- nor pipeline-sharded by mlx-lm (it has "
            "no shard() and no pipeline()): run it on one machine, or use an architecture such "
            "as llama, qwen2, qwen3, mistral or deepseek_v3")
    if strategy == "auto":
        strategy = "tensor" if can_tensor else "pipeline"
    if strategy == "tensor" and not can_tensor:
        raise MlxspecError(f"architecture {arch!r} has no tensor parallelism in mlx-lm: use "
                           "--distributed pipeline")
    if strategy == "pipeline" and not can_pipe:
        raise MlxspecError(f"architecture {arch!r} has no pipeline parallelism in mlx-lm: use "
                           "--distributed tensor")
    if strategy == "tensor":
        for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            value = config.get(field)
            if isinstance(value, int) and value % size:
                works = [n for n in range(2, value + 1) if value % n == 0 and all(
                    not isinstance(config.get(f), int) or config[f] % n == 0
                    for f in ("num_attention_heads", "num_key_value_heads", "intermediate_size"))]
                hint = (f"use {', '.join(map(str, works[:4]))} ranks" if works
                        else "no rank count divides it")
                if can_pipe:
                    hint += ", or --distributed pipeline"
                raise MlxspecError(f"{field} = {value} is not divisible by {size} ranks, so the "
                                   f"model cannot be tensor-sharded over them: {hint}")
    else:
        layers = config.get("num_hidden_layers", 0)
        if layers < size:
            raise MlxspecError(f"the model has {layers} layers, fewer than {size} ranks: "
                               "pipeline parallelism needs one layer per rank at least")
    return strategy


def load(model: str | None = None, *, mode: str = "none", draft: str | None = None,
         num_draft: int | None = None, strategy: str = "auto", adaptive: bool = False,
         max_context: int | None = None, coordinator: Coordinator | None = None,
         **mode_options):
    """`mlxspec.load` for a rank of a sharded run. With one process: exactly `load`."""
    from . import backend, loading
    from .policy import check_num_draft
    from .proposers import check_mode as check_known_mode

    check_known_mode(mode)
    check_mode(mode)
    if num_draft is not None:
        check_num_draft(num_draft)
    group = coordinator.group if coordinator is not None else init_group()
    if group.size() == 1:
        return loading.load(model, mode=mode, draft=draft, num_draft=num_draft,
                            adaptive=adaptive, max_context=max_context, **mode_options)
    model, path, draft_path = loading.resolve_paths(model, draft, mode)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise MlxspecError(f"{path}: cannot read config.json: {e}") from None
    strategy = choose_strategy(config, group.size(), strategy)  # refused before loading
    net, tokenizer = sharded_load(path, group, strategy)
    dtype = backend.compute_dtype()
    if dtype is not None:
        net.set_dtype(dtype)
    coord = coordinator or Coordinator(group)
    coord.strategy = strategy
    name = model if model is not None else f"bundled:{path.name}"
    engine = engine_class()(net, tokenizer, mode="none", num_draft=num_draft, config=config,
                            name=name, max_context=max_context, adaptive=adaptive,
                            draft_source=draft_path, coordinator=coord)
    if draft_path is not None and mode in ("draft", "auto"):
        engine.draft_model = loading.load_draft(draft_path, engine)  # whole, on every rank
    engine.set_mode(mode, **mode_options)
    return engine


def sharded_load(path, group, strategy: str):
    """mlx-lm's `sharded_load`; a pipeline over a checkpoint without a weight index (one
    model.safetensors) is split the same way after a lazy load."""
    from mlx_lm.utils import load_model, load_tokenizer
    from mlx_lm.utils import sharded_load as mlx_sharded_load

    if strategy == "pipeline" and not (path / "model.safetensors.index.json").exists():
        net, config = load_model(path, lazy=True, strict=False)
        net.model.pipeline(group)
        mx.eval(net.parameters())
        tokenizer = load_tokenizer(path, {"trust_remote_code": True},
                                   eos_token_ids=config.get("eos_token_id", None))
        mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu, group=group))
        return net, tokenizer
    groups = {"tensor_group": group} if strategy == "tensor" else {"pipeline_group": group}
    try:
        return mlx_sharded_load(str(path), **groups)
    except ValueError as e:
        raise MlxspecError(f"{path}: cannot shard: {e}") from None


# ----------------------------------------------------------------------------- the CLI side


def cli_engine(model, draft_model, mode, num_draft, strategy: str, quiet: bool = False,
               meter: bool = False, interactive: bool = False, **options):
    """Load for a command run with --distributed. On rank 0 return the engine; on the other
    ranks run `follow` and exit (they never return to the command). `meter`: count (and
    optionally delay) every collective on every rank (`CollectiveMeter`, bench only);
    `interactive` (chat, serve): rank 0 keeps its own Ctrl-C handling."""
    import click

    from . import backend

    coord = cli_coordinator()
    if coord is None:
        click.echo("note: --distributed with one process: running on this machine alone "
                   "(start it with mlx.launch to shard the model)", err=True)
        return None
    stop_on_signals(coord, interactive)
    coord.exit_on_loss = True
    if meter:
        coord.meter = CollectiveMeter().install()
    if coord.leader and not quiet:
        click.echo(f"loading {model or 'the bundled model'} sharded over {coord.size} ranks "
                   f"(backend {backend.device_name()}, BLAS {backend.blas_in_use})", err=True)
    try:
        coord.arm("loading")  # every rank loads; a rank that never arrives trips the watchdog
        engine = load(model, mode=mode, draft=draft_model, num_draft=num_draft,
                      strategy=strategy, coordinator=coord, **options)
        coord.disarm()
    except RuntimeError as e:
        fail(lost(coord.rank, e))
    except MlxspecError as e:  # the same refusal on every rank: rank 0 prints it
        if coord.leader:
            raise
        os._exit(2 if not getattr(e, "fatal", False) else 1)
    if coord.leader:
        atexit.register(finish, engine)
        if not quiet:
            click.echo(f"sharded: {coord.strategy} parallel over {coord.size} ranks", err=True)
        return engine
    follow(engine)
    sys.stdout.flush()
    os._exit(0)


_CLI_COORD: Coordinator | None = None


def cli_coordinator() -> Coordinator | None:
    """This process's coordinator for a command run with --distributed (one per process);
    None when it runs alone."""
    global _CLI_COORD
    if _CLI_COORD is None:
        group = init_group()
        if group.size() == 1:
            return None
        _CLI_COORD = Coordinator(group)
    return _CLI_COORD


def leader_input(read):
    """`read()` (a prompt from a file or stdin) on rank 0 only, its result broadcast to the
    others before anything loads; an error there (MlxspecError) stops every rank (exit 2, rank 0
    says why). Alone: just `read()`."""
    coord = cli_coordinator() if launched() else None
    if coord is None:
        return read()
    value = error = None
    if coord.leader:
        try:
            value = read()
        except MlxspecError as e:
            error = str(e)
    # No watchdog here: rank 0 may wait on a person typing; a rank that dies closes its sockets.
    got = coord.bcast_obj({"value": value, "error": error} if coord.leader else None)
    if got["error"] is not None:
        if coord.leader:
            raise MlxspecError(got["error"])
        os._exit(2)
    return got["value"]


def stop_on_signals(coord: Coordinator, interactive: bool = False) -> None:
    """Ctrl-C and SIGTERM stop every rank. The followers die at once (default actions: a Python
    handler would wait for the collective they are blocked in); rank 0 flushes, says so and
    exits, and the others see its sockets close (or got the same signal from mlx.launch). In
    `interactive` commands rank 0 keeps its own Ctrl-C handling (chat: a reply stops between
    steps; serve: a clean shutdown, then the others are told to stop)."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        return
    if not coord.leader:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        return

    def stop(signum, frame):
        name = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
        fail(f"rank 0: {name}: stopping every rank", 130 if signum == signal.SIGINT else 143)

    signal.signal(signal.SIGTERM, stop)
    if not interactive:
        signal.signal(signal.SIGINT, stop)


def guarded(fn):
    """Around a command run with --distributed: a lost rank is one clear error and exit 1
    (never a traceback, never a hang in the ring backend's teardown)."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DistributedFailure as e:
            fail(str(e))
        except RuntimeError as e:
            if "[ring]" in str(e) or "[jaccl]" in str(e) or "distributed" in str(e):
                fail(lost(int(os.environ.get("MLX_RANK", 0)), e))
            raise

    return wrapper
