"""The ranks: MLX's group, the `Coordinator` (rank 0's broadcasts, collective counting, the
watchdog), what a lost rank does (`lost`, `fail`, `ring_peer_closed`) and the bench's
`CollectiveMeter`."""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time
import weakref

import mlx.core as mx

from ..errors import MlxspecError

DEFAULT_TIMEOUT = 120.0  # seconds without progress inside a generation
LOST_GRACE = 1.5  # seconds a server has to answer its requests with the error before it exits
STALL_CHECK = 2.0  # seconds without progress before the watchdog looks for a dead peer


class DistributedFailure(MlxspecError):
    """Another rank failed, or a collective timed out."""

    fatal = True  # the CLI exits 1 at once (no teardown that could wait on a dead rank)


def loopback_hostfile(path, ranks: int):
    """Write a ring hostfile for `ranks` processes on this machine (free loopback ports), as
    the tests start them; returns `path`."""
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
        self.mirrored = 0  # rank 0's requests open on every rank: the watchdog covers them all
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
