"""Helpers of the distributed tests: two ring ranks on 127.0.0.1 with hard timeouts (a hang
fails fast), the rank script's command line, and plain decoding's reference."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO

from mlxspec.distributed import loopback_hostfile

RANK = Path(__file__).resolve().parent / "dist_rank.py"
PROMPT = "def main(): return 1 + 2 def main(): return 1 + 2 def main(): return"
TIMEOUT = 60


def start(tmp_path, argv, stdin0=None, env_extra: dict | None = None, cwds=None):
    """Two ranks of `argv`, not waited for; rank 0's stdin is `stdin0` (text), the others'
    is empty: only rank 0 may read it. `cwds`: each rank's working directory."""
    hostfile = loopback_hostfile(tmp_path / "hosts.json", 2)
    procs = []
    for rank in range(2):
        env = dict(os.environ, MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile),
                   MLX_WORLD_SIZE="2", MLXSPEC_DIST_TIMEOUT="20", **(env_extra or {}))
        procs.append(subprocess.Popen(argv, env=env, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      cwd=cwds[rank] if cwds else REPO))
    for rank, p in enumerate(procs):
        if rank == 0 and stdin0:
            p.stdin.write(stdin0)
        p.stdin.close()
        p.stdin = None  # communicate() must not touch it
    return procs


def launch(tmp_path, argv: list[str], env_extra: dict | None = None, timeout: int = TIMEOUT):
    """Start two ranks of `argv` (a command list) and wait for both: [(rc, stdout, stderr)]."""
    return wait_all(start(tmp_path, argv, env_extra=env_extra), timeout)


def wait_all(procs, timeout: int = TIMEOUT) -> list[tuple[int, str, str]]:
    """Wait for every rank (killing all on a timeout, so a hang fails fast)."""
    out = []
    try:
        for p in procs:
            o, e = p.communicate(timeout=timeout)
            out.append((p.returncode, o, e))
    finally:
        kill_all(procs)
    return out


def kill_all(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def rank_script(model, draft, strategy, temp, modes, max_tokens=40):
    return [sys.executable, str(RANK), str(model), str(draft or ""), strategy, PROMPT,
            str(max_tokens), str(temp), *modes]


def reference(model_dir: Path, max_tokens=40) -> list[int]:
    from mlxspec import load

    engine = load(str(model_dir), mode="none")
    return engine.generate(PROMPT, max_tokens=max_tokens).tokens
