"""--distributed in the commands: load on every rank (`cli_engine`: rank 0 returns the engine,
the others follow it), rank 0's input, signals and a lost rank as one clear error."""

from __future__ import annotations

import atexit
import os
import sys
import threading

from ..distributed import (
    CollectiveMeter,
    Coordinator,
    DistributedFailure,
    fail,
    finish,
    follow,
    init_group,
    launched,
    load,
    lost,
)
from ..errors import MlxspecError


def cli_engine(model, draft_model, mode, num_draft, strategy: str, quiet: bool = False,
               meter: bool = False, interactive: bool = False, **options):
    """Load for a command run with --distributed. On rank 0 return the engine; on the other
    ranks run `follow` and exit (they never return to the command). `meter`: count (and
    optionally delay) every collective on every rank (`CollectiveMeter`, bench only);
    `interactive` (chat, serve): rank 0 keeps its own Ctrl-C handling."""
    import click

    from .. import backend

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
