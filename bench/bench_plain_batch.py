"""Plain batching at 1/4/8 rows against mlx-lm's `BatchGenerator` (a change must keep it):
the batched step with k = 0 (`BatchSpeculator`, rows in mode `none`, what
`mlxspec serve` runs over --spec-max-concurrency) against mlx-lm's `BatchGenerator` (what it
ran before), on the same prompts, B rows at a time, paired and interleaved; greedy, prefill
included. Prints tok/s and the median of per-round ratios per width.

    python bench/bench_plain_batch.py [-m smollm2] [--widths 1,4,8,16] [--rounds 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_server import workload  # noqa: E402

import mlxspec  # noqa: E402  (OpenBLAS before mlx.core)
from mlxspec.batch_step import BatchSpeculator  # noqa: E402
from mlxspec.engine import PromptCache  # noqa: E402


def ours(engine, slots, prompts, max_tokens: int) -> float:
    start = time.perf_counter()
    batch = BatchSpeculator(engine.model)
    rows = [slot.join(batch, p, max_tokens=max_tokens, temperature=0.0, mode="none",
                      prompt_cache=PromptCache()) for slot, p in zip(slots, prompts)]
    n, live = 0, list(rows)
    while live:
        produced = batch.step()
        for row in list(live):
            out = row.output(produced)
            n += len(out.tokens) if out is not None else 0
            if out is not None and out.finish_reason:
                batch.close(row)
                live.remove(row)
    return n / (time.perf_counter() - start)


def mlx_lm_batch(engine, prompts, max_tokens: int) -> float:
    from mlx_lm.generate import BatchGenerator, StopSequences

    eos = sorted(getattr(engine.tokenizer, "eos_token_ids", None) or [])
    start = time.perf_counter()
    gen = BatchGenerator(engine.model, completion_batch_size=len(prompts),
                         prefill_batch_size=min(8, len(prompts)),
                         prefill_step_size=engine.prefill_step_size)
    gen.insert(prompts, max_tokens=[max_tokens] * len(prompts),
               stop_sequences=[StopSequences([[t] for t in eos] or None)] * len(prompts))
    n, done = 0, 0
    while done < len(prompts):
        _, responses = gen.next()
        for r in responses:
            n += r.finish_reason != "stop"
            done += r.finish_reason is not None
    gen.close()
    return n / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=None, help="default: the bundled model")
    ap.add_argument("--widths", default="1,4,8,16")
    ap.add_argument("--rounds", type=int, default=4, help="counted rounds (one more warms up)")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    engine = mlxspec.load(args.model or str(Path(__file__).resolve().parent.parent / "models"))
    texts = workload(16)
    for width in (int(w) for w in args.widths.split(",")):
        prompts = [engine.encode(t) for t in texts[:width]]
        slots = [engine.clone() for _ in prompts]
        a, b = [], []
        for rnd in range(args.rounds + 1):  # the first round warms both up
            if rnd % 2:
                x = ours(engine, slots, prompts, args.max_tokens)
                y = mlx_lm_batch(engine, prompts, args.max_tokens)
            else:
                y = mlx_lm_batch(engine, prompts, args.max_tokens)
                x = ours(engine, slots, prompts, args.max_tokens)
            if rnd:
                a.append(x)
                b.append(y)
        ratio = statistics.median(x / y for x, y in zip(a, b))
        print(f"width {width:2d}: batched step k=0 {statistics.median(a):6.1f} tok/s, "
              f"mlx-lm BatchGenerator {statistics.median(b):6.1f} tok/s, "
              f"median ratio {ratio:.3f}", flush=True)


if __name__ == "__main__":
    main()
