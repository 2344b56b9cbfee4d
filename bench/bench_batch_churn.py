"""The batched step against mlx-lm's `BatchGenerator` without the server: B rows decoding free
text (temperature 1, unseeded), a finished request replaced at once by the next prompt (a closed
loop at the batch level, with joins and leaves but no HTTP, no worker, no client threads).

    python bench/bench_batch_churn.py [--rows 4] [--requests 32] [--mode auto] [--repeat 6]

`ours`: `BatchSpeculator.open` / `next_output(row)` / `row.close()` (the server's batched
path); `mlx-lm`: `BatchGenerator.insert` / `next()`. The two run alternately, in reversed
order every other round; prints each round's tok/s and the median of the per-round ratios.
Separates what the batch costs from what the server around it costs (`bench_server.py
--no-http`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_server import free_workload  # noqa: E402  (imports mlxspec: OpenBLAS before mlx.core)
from mlx_lm.generate import BatchGenerator, StopSequences  # noqa: E402
from mlx_lm.sample_utils import make_sampler  # noqa: E402

import mlxspec  # noqa: E402
from mlxspec.batch_step import BatchSpeculator, next_output  # noqa: E402
from mlxspec.engine import PromptCache  # noqa: E402


def ours(batch, slots, prompts, rows: int, max_tokens: int, mode: str) -> float:
    todo, free, live, n = list(prompts), list(slots), {}, 0
    start = time.perf_counter()

    def admit():
        while todo and free:
            slot = free.pop()
            row = batch.open(slot, todo.pop(0), max_tokens=max_tokens, temperature=1.0,
                             seed=None, prompt_cache=PromptCache(), mode=mode)
            live[row] = slot

    admit()
    while live:
        for row in list(live):
            try:
                out = next_output(row)
                n += len(out.tokens)
                done = bool(out.finish_reason)
            except StopIteration:
                done = True
            if done:
                row.close()
                free.append(live.pop(row))
                admit()
    return n / (time.perf_counter() - start)


def theirs(model, prompts, rows: int, max_tokens: int, eos: list[int]) -> float:
    gen = BatchGenerator(model, completion_batch_size=max(8, rows), prefill_batch_size=8)
    sampler = make_sampler(1.0)
    # as the server's plain batch: a request ends at an end-of-sequence token, as ours do
    stop = StopSequences([[t] for t in eos] or None)
    todo, live, n = list(prompts), 0, 0
    start = time.perf_counter()
    while todo and live < rows:
        gen.insert([todo.pop(0)], max_tokens=[max_tokens], samplers=[sampler],
                   stop_sequences=[stop])
        live += 1
    while live:
        for r in gen.next()[1]:
            n += r.finish_reason != "stop"  # an end-of-sequence token is not output
            if r.finish_reason:
                live -= 1
                if todo:
                    gen.insert([todo.pop(0)], max_tokens=[max_tokens], samplers=[sampler],
                               stop_sequences=[stop])
                    live += 1
    gen.close()
    return n / (time.perf_counter() - start)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--mode", default="auto")
    ap.add_argument("--repeat", type=int, default=6)
    args = ap.parse_args(argv)
    engine = mlxspec.load(str(ROOT / "models"), mode=args.mode)
    engine.proposer_for(args.mode)
    prompts = [engine.encode(p) for p in free_workload(args.requests)]
    slots = [engine.clone() for _ in range(args.rows)]
    batch = BatchSpeculator(engine.model)
    run_ours = lambda: ours(batch, slots, prompts, args.rows, args.max_tokens, args.mode)  # noqa: E731
    eos = sorted(getattr(engine.tokenizer, "eos_token_ids", None) or [])
    run_theirs = lambda: theirs(engine.model, prompts, args.rows, args.max_tokens, eos)  # noqa: E731
    run_ours(), run_theirs()  # warm-up
    ratios = []
    for i in range(args.repeat):
        if i % 2:
            a, t = run_ours(), run_theirs()
        else:
            t, a = run_theirs(), run_ours()
        ratios.append(a / t)
        print(f"round {i + 1}: ours {a:.1f} tok/s, mlx-lm {t:.1f} tok/s, {a / t:.3f}", flush=True)
    print(f"{args.rows} rows, {args.requests} requests of {args.max_tokens} tokens, mode "
          f"{args.mode}: ours / mlx-lm, median of {len(ratios)} rounds: "
          f"{statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
