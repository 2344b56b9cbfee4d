"""The one loop (`batch_step.decode`: a request as a batch of one on its own cache) against the
engine's own pipelined loop it replaced (`plain_decode` before #28, kept verbatim below as the
reference), `none`, greedy, in one process, interleaved per prompt; prints the median tok/s of
each and the median of the paired ratios.

    python bench/bench_one_loop.py [-m smollm2] [--max-tokens 48]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlxspec  # (OpenBLAS before mlx.core)

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
from bench_server import workload  # noqa: E402

from mlxspec import caches  # noqa: E402
from mlxspec.batch_step import decode  # noqa: E402
from mlxspec.engine import PromptCache  # noqa: E402
from mlxspec.policy import FixedK  # noqa: E402
from mlxspec.sampling import SamplingParams, probs_from_logits, sample  # noqa: E402
from mlxspec.stats import Stats  # noqa: E402


# the old loop, as engine.py had it at c195bee
def plain_decode(model, cache, context, sampling, max_tokens, key, stats):
    def step(token, step_key):
        logits = model(token.reshape(1, 1), cache=cache)[0, -1]
        if sampling.greedy:
            y = mx.argmax(logits, axis=-1)
        else:
            y = sample(probs_from_logits(logits, sampling), step_key)
        return y
    keys = mx.random.split(key, max_tokens + 1) if not sampling.greedy else [None] * (max_tokens + 1)
    y = step(mx.array([context[-1]], mx.uint32), keys[0])
    mx.async_eval(y)
    queued = None
    try:
        for n in range(1, max_tokens + 1):
            queued = None
            if n < max_tokens:
                queued = caches.checkpoint(cache), y
                next_y = step(y, keys[n])
                mx.async_eval(next_y)
            token = y.item()
            context.append(token)
            stats.record_step("", 0, 0, 1)
            yield [token]
            if n == max_tokens:
                return
            y = next_y
    finally:
        if queued is not None:
            caches.rollback(model, cache, queued[0], [context[-1]], 0)
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=None, help="default: the bundled model")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    engine = mlxspec.load(args.model)
    prompts = [engine.encode(p) for p in workload(args.prompts)]

    def run(kind: str, tokens: list[int]) -> float:
        pc = PromptCache()
        engine.prefill(tokens, pc, None)
        context, stats = list(tokens), Stats()
        start = time.perf_counter()
        if kind == "old":
            steps = plain_decode(engine.model, pc.cache, context, SamplingParams(),
                                 args.max_tokens, mx.random.key(0), stats)
        else:
            steps = decode(engine.model, pc.cache, context, None, FixedK(4), SamplingParams(),
                           args.max_tokens, mx.random.key(0), stats)
        n = sum(len(t) for t in steps)
        return n / (time.perf_counter() - start)

    res: dict[str, list[float]] = {"old": [], "new": []}
    for rnd in range(args.rounds):
        for i, p in enumerate(prompts):
            for kind in (("old", "new") if (rnd + i) % 2 == 0 else ("new", "old")):
                res[kind].append(run(kind, p))
    ratios = [a / b for a, b in zip(res["new"], res["old"])]
    print(f"old loop {statistics.median(res['old']):.1f} tok/s, one loop "
          f"{statistics.median(res['new']):.1f} tok/s, median ratio {statistics.median(ratios):.3f} "
          f"(range {min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
