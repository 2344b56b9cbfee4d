"""The several-Macs benchmark on one machine: two ring ranks on 127.0.0.1 (free ports), each
pinned to its own cores with as many BLAS threads as it has cores, running

    mlxspec bench --distributed --modes none,ngram --workloads edit,doc-qa,predicted --prompts 6 \\
        --max-tokens 128 --collective-delay 0,0.2,0.5,1

and printing rank 0's table (docs/SEVERAL_MACS.md). First it measures the collective latency
between the two ranks (a one-float all_sum), so that the report says what "0 ms" meant.

Why the pinning: MLX's ring backend waits for data by polling its non-blocking sockets in a
loop (one thread per socket), so a rank waiting in a collective keeps a core busy. Two
unpinned ranks on a 2-core machine then have more runnable threads than cores, and a
collective costs a scheduler time slice (measured: 4-12 ms median, p90 up to 20 ms) instead of
~0.05 ms. One core per rank (and one BLAS thread per core) makes it stable.

    python bench/bench_distributed.py            # the whole run (tens of minutes on 2 cores)
    python bench/bench_distributed.py --quick    # a smoke run of the script (seconds)
    python bench/bench_distributed.py --latency-only [--no-pin]
    python bench/bench_distributed.py -- -k 8    # arguments after -- go to mlxspec bench
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RANKS = 2
FULL = ["--modes", "none,ngram", "--workloads", "edit,doc-qa,predicted", "--prompts", "6",
        "--max-tokens", "128", "--collective-delay", "0,0.2,0.5,1"]
QUICK = ["--modes", "none,ngram", "--workloads", "edit", "--prompts", "1", "--max-tokens", "16",
         "--collective-delay", "0,1"]


def core_sets(ranks: int, pin: bool) -> list[set[int] | None]:
    """The cores each rank is pinned to (None: not pinned): an equal share of this process's
    cores, when there are at least as many cores as ranks."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not pin or len(cpus) < ranks:
        return [None] * ranks
    per = len(cpus) // ranks
    return [set(cpus[r * per:(r + 1) * per]) for r in range(ranks)]


def launch(argv: list[str], pin: bool, timeout: float, show_rank0: bool) -> list[int]:
    """Run `argv` as every rank (rank 0's output passes through when `show_rank0`, the others'
    is shown only on failure); kill them all on a timeout. Returns the exit codes."""
    with tempfile.TemporaryDirectory() as tmp:
        from mlxspec.distributed import loopback_hostfile

        hostfile = loopback_hostfile(Path(tmp) / "hosts.json", RANKS)
        procs, logs = [], []
        for rank, cores in enumerate(core_sets(RANKS, pin)):
            threads = str(len(cores)) if cores else "1"
            env = dict(os.environ, MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile),
                       MLX_WORLD_SIZE=str(RANKS), OPENBLAS_NUM_THREADS=threads,
                       OMP_NUM_THREADS=threads)
            log = open(Path(tmp) / f"rank{rank}.log", "w+")
            logs.append(log)
            quiet = rank > 0 or not show_rank0
            procs.append(subprocess.Popen(
                argv, env=env, stdout=log if quiet else None, stderr=log if quiet else None,
                preexec_fn=(lambda c=cores: os.sched_setaffinity(0, c)) if cores else None))
        deadline = time.monotonic() + timeout
        try:
            for p in procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"error: timed out after {timeout:.0f} s", file=sys.stderr)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        codes = [p.returncode for p in procs]
        for rank, (code, log) in enumerate(zip(codes, logs)):
            log.seek(0)
            text = log.read()
            if code != 0 and text:
                print(f"--- rank {rank} (exit {code}) ---\n{text}", file=sys.stderr)
            elif not show_rank0 and rank == 0:
                print(text, end="")
            log.close()
    return codes


def latency_rank(n: int, work_ms: float) -> None:
    """One rank of the latency micro-benchmark: `n` one-float all_sums back to back, then `n`
    after `work_ms` on rank 0 alone while rank 1 already waits inside the collective: rank 0
    busy in Python (its proposal, bookkeeping), then rank 0 blocked (its main thread waiting,
    as when MLX's stream thread computes). Rank 0 prints the figures."""
    import mlx.core as mx

    import mlxspec  # noqa: F401  (OpenBLAS before mlx.core)

    group = mx.distributed.init(strict=True)
    x = mx.array([1.0])

    def one(work: str) -> float:
        if work and group.rank() == 0:
            if work == "busy":
                end = time.perf_counter() + work_ms / 1e3
                while time.perf_counter() < end:
                    pass
            else:
                time.sleep(work_ms / 1e3)
        start = time.perf_counter()
        mx.eval(mx.distributed.all_sum(x, group=group))
        return (time.perf_counter() - start) * 1e3

    for _ in range(20):
        one("")
    out = {}
    for name, work in (("back_to_back", ""), (f"after_{work_ms:g}ms_busy_on_rank0", "busy"),
                       (f"after_{work_ms:g}ms_blocked_on_rank0", "blocked")):
        times = sorted(one(work) for _ in range(n))
        out[name] = {"median_ms": round(times[n // 2], 3), "p90_ms": round(times[n * 9 // 10], 3),
                     "max_ms": round(times[-1], 3)}
    if group.rank() == 0:
        print(json.dumps({"all_sum_one_float": out}), flush=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-latency":
        latency_rank(int(sys.argv[2]), float(sys.argv[3]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run (1 edit prompt, 16 tokens, delays 0 and 1 ms)")
    ap.add_argument("--latency-only", action="store_true", help="only the latency figures")
    ap.add_argument("--no-pin", action="store_true",
                    help="do not pin the ranks to cores (to see what the pinning changes)")
    ap.add_argument("--model", "-m", default=None, help="target (default: the bundled model)")
    ap.add_argument("--out", default=None, help="folder for bench_distributed.json/.md")
    ap.add_argument("--timeout", type=float, default=7200, help="seconds for the whole run")
    ap.add_argument("extra", nargs="*", help="after --: more arguments for mlxspec bench")
    args = ap.parse_args()
    pin = not args.no_pin
    cores = core_sets(RANKS, pin)
    print(f"{RANKS} ranks on 127.0.0.1, "
          + (f"pinned to cores {[sorted(c) for c in cores]}" if cores[0] else "not pinned")
          + f", BLAS threads per rank: {len(cores[0]) if cores[0] else 1}", file=sys.stderr)
    n = 200 if args.quick else 1000
    codes = launch([sys.executable, __file__, "--rank-latency", str(n), "2"], pin,
                   timeout=120, show_rank0=False)
    if any(codes):
        sys.exit(1)
    if args.latency_only:
        return
    cmd = [sys.executable, "-m", "mlxspec.cli.main", "bench", "--distributed",
           *(QUICK if args.quick else FULL)]
    if args.model:
        cmd += ["-m", args.model]
    out = args.out or tempfile.mkdtemp(prefix="mlxspec-bench-dist-")
    cmd += ["--out", out, *args.extra]
    print("$ " + " ".join(cmd[1:]), file=sys.stderr)
    start = time.monotonic()
    codes = launch(cmd, pin, timeout=args.timeout, show_rank0=True)
    print(f"{time.monotonic() - start:.0f} s; report in {out}", file=sys.stderr)
    sys.exit(1 if any(codes) else 0)


if __name__ == "__main__":
    main()
