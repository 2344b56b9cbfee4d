"""Which k the adaptive policy chooses on a model, and the step cost it measured: the same
policy code on the bundled model and on a real one.

    python bench/bench_policy_k.py                      # the bundled model, then SmolLM2
    python bench/bench_policy_k.py -m smollm2 --prompts 8

One `AdaptiveK` (k <= 8) decodes the `mixed` workload with prompt lookup (`ngram`); printed:
the mean k of its speculative steps, how often each k was chosen, and its fitted step cost
(intercept and slope per proposed token) relative to a pipelined plain token.
"""

from __future__ import annotations

import argparse
import collections
from dataclasses import dataclass, field

import mlxspec
from mlxspec.bench.workloads import build_workload
from mlxspec.engine import PromptCache
from mlxspec.policy import AdaptiveK


@dataclass
class CountingK(AdaptiveK):
    """AdaptiveK that counts the k of every speculative step."""

    chosen: collections.Counter = field(default_factory=collections.Counter)

    def observe(self, source: str, drafted: int, accepted: int, seconds: float) -> None:
        if drafted:
            self.chosen[drafted] += 1
        super().observe(source, drafted, accepted, seconds)


def measure(model: str | None, prompts: int, max_tokens: int) -> str:
    engine = mlxspec.load(model, mode="none")
    policy = CountingK(max_k=8)
    for item in build_workload("mixed", prompts, max_tokens, 0, engine.tokenizer):
        engine.generate(engine.encode(item.prompt), max_tokens=item.max_tokens, mode="ngram",
                        policy=policy, prediction=item.prediction,
                        temperature=item.temperature, prompt_cache=PromptCache())
    steps = sum(policy.chosen.values())
    mean = sum(k * n for k, n in policy.chosen.items()) / max(steps, 1)
    intercept, slope = policy.step_cost("ngram")
    histogram = ", ".join(f"{k}: {n}" for k, n in sorted(policy.chosen.items()))
    return (f"| {model or 'bundled'} | {mean:.2f} | {histogram} | "
            f"{intercept / policy.plain_time:.2f} | {slope / policy.plain_time:.3f} |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", action="append", default=None,
                    help="repeatable (default: the bundled model and smollm2)")
    ap.add_argument("--prompts", type=int, default=None, help="default 24 bundled, 8 others")
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args(argv)
    print("| model | mean k | steps by k | step intercept / plain token | slope / plain token |")
    print("|---|---:|---|---:|---:|")
    for model in args.model or [None, "smollm2"]:
        n = args.prompts or (24 if model is None else 8)
        print(measure(model, n, args.max_tokens), flush=True)


if __name__ == "__main__":
    main()
