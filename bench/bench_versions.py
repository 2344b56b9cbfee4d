"""A single request on this checkout against another (a refactor must not slow the loop;
run it both orders against the commit before):
`Engine.generate` per mode over the same prompts, each checkout in its own process, the two
alternating round by round; prints each mode's decode tok/s per checkout and the median of the
per-round ratios (this / other), and the target forwards each round took (the same count
means the same policy decisions: a speed difference is then the step's cost, not its choices).

    git worktree add /tmp/old <commit>
    python bench/bench_versions.py --other /tmp/old [-m smollm2] [--modes none,ngram,auto]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1] + "/bench")
from bench_server import free_workload, workload
import mlxspec
from mlxspec.engine import PromptCache
model, modes, n, max_tokens = sys.argv[2] or None, sys.argv[3].split(","), int(sys.argv[4]), int(sys.argv[5])
temps = [float(t) for t in sys.argv[6].split(",")]
engine = mlxspec.load(model or sys.argv[1] + "/models")
prompts = ([(p, 0.0) for p in workload(n)] if 0.0 in temps else []) + (
    [(p, 1.0) for p in free_workload(n)] if 1.0 in temps else [])
out = {}
for mode in modes:
    engine.generate(prompts[0][0], max_tokens=8, mode=mode, prompt_cache=PromptCache())
    tokens = seconds = forwards = 0.0
    for p, temp in prompts:
        r = engine.generate(p, max_tokens=max_tokens, temperature=temp, seed=0, mode=mode,
                            prompt_cache=PromptCache())
        tokens += r.stats.generated_tokens
        seconds += r.stats.decode_seconds
        forwards += r.stats.target_forwards
    out[mode] = tokens / seconds
    out[mode + ":forwards"] = forwards
print(json.dumps(out))
"""


def run(root: Path, args) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(root), MLXSPEC_POLICY_CACHE="0")
    proc = subprocess.run([sys.executable, "-c", CHILD, str(root), args.model or "", args.modes,
                           str(args.prompts), str(args.max_tokens), args.temps],
                          capture_output=True, text=True, env=env, cwd=root)
    if proc.returncode:
        sys.exit(f"{root}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--other", required=True, help="the other checkout (a git worktree)")
    ap.add_argument("-m", "--model", default=None, help="default: the bundled model")
    ap.add_argument("--modes", default="none,ngram,auto")
    ap.add_argument("--prompts", type=int, default=4, help="per workload (grounded, free)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--temps", default="0,1", help="0: the grounded prompts, greedy; 1: free "
                    "text sampled (seeded: each checkout may sample other tokens)")
    args = ap.parse_args()
    this, other = HERE.parent, Path(args.other).resolve()
    ours, theirs = [], []
    for rnd in range(args.rounds):
        pair = (run(this, args), run(other, args)) if rnd % 2 == 0 else \
            tuple(reversed((run(other, args), run(this, args))))
        ours.append(pair[0])
        theirs.append(pair[1])
        print(f"round {rnd + 1}: this {pair[0]} other {pair[1]}", flush=True)
    for mode in args.modes.split(","):
        a = [r[mode] for r in ours]
        b = [r[mode] for r in theirs]
        ratio = statistics.median(x / y for x, y in zip(a, b))
        fa = [r[mode + ":forwards"] for r in ours]
        fb = [r[mode + ":forwards"] for r in theirs]
        print(f"{mode}: this {statistics.median(a):.1f} tok/s, other {statistics.median(b):.1f} "
              f"tok/s, median ratio {ratio:.3f}; target forwards per round (all prompts): "
              f"this {sorted(fa)}, other {sorted(fb)}")


if __name__ == "__main__":
    main()
