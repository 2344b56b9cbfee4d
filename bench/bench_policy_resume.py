"""A command's first request with `auto`'s policy fresh (the priors) against one resumed from
an earlier process's measurements (what `generate`, `edit` and `chat` do, `policy.resume`).

    python bench/bench_policy_resume.py -m smollm2 --workloads quote,rewrite,completion --prompts 3

The "earlier process" decodes 2 other prompts (seed 1) of each workload; then every prompt
(seed 0) runs `none`, `auto` with a fresh policy and `auto` with a policy resumed from that
snapshot, in rotating order, each policy on that one request only. The suffix source is off,
so that no run proposes from another run's answer. Printed: tok/s per run and the median of
per-prompt speedups over `none`.
"""

from __future__ import annotations

import argparse
import statistics

import mlxspec
from mlxspec.bench.workloads import build_workload
from mlxspec.engine import PromptCache
from mlxspec.policy import AdaptiveK


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="smollm2")
    ap.add_argument("--workloads", default="quote,rewrite,completion")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args(argv)
    names = args.workloads.split(",")
    engine = mlxspec.load(args.model, mode="auto")
    engine.set_mode("auto", suffix=False)
    earlier = AdaptiveK(max_k=8)
    for name in names:
        for item in build_workload(name, 2, args.max_tokens, 1, engine.tokenizer):
            engine.generate(engine.encode(item.prompt), max_tokens=item.max_tokens,
                            policy=earlier, prediction=item.prediction,
                            prompt_cache=PromptCache())
    snapshot = earlier.snapshot()
    speedups: dict[tuple[str, str], list[float]] = {}
    for name in names:
        items = build_workload(name, args.prompts, args.max_tokens, 0, engine.tokenizer)
        for i, item in enumerate(items):
            tokens = engine.encode(item.prompt)
            order = ["none", "fresh", "resumed"]
            row = {}
            for label in order[i % 3:] + order[:i % 3]:
                policy = None
                if label != "none":
                    policy = AdaptiveK(max_k=8)
                    if label == "resumed":
                        policy.resume(snapshot)
                cache = PromptCache()
                engine.generate(tokens, max_tokens=1, mode="none", prompt_cache=cache)  # prefill
                r = engine.generate(tokens, max_tokens=item.max_tokens, policy=policy,
                                    mode="none" if label == "none" else None,
                                    prediction=item.prediction, prompt_cache=cache)
                row[label] = len(r.tokens) / r.stats.decode_seconds
            print(name, i, {k: round(v, 1) for k, v in row.items()}, flush=True)
            for label, tps in row.items():
                speedups.setdefault((name, label), []).append(tps / row["none"])
    print("| workload | fresh policy | resumed policy |\n|---|---:|---:|")
    for name in names:
        print(f"| {name} | {statistics.median(speedups[(name, 'fresh')]):.2f}× | "
              f"{statistics.median(speedups[(name, 'resumed')]):.2f}× |")


if __name__ == "__main__":
    main()
