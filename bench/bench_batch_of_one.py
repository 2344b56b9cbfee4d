"""A request alone: `BatchSpeculator` with one row against the engine's own loop
(`Engine.stream_steps`), paired and interleaved, `auto`, on the bundled pair; prints the median
of per-prompt tok/s ratios (prefill included). `--no-solo`: the lone row in batched steps, as
before a lone row ran the engine's loop inside the batch (docs/HOW_IT_WORKS.md).

    python bench/bench_batch_of_one.py [--no-solo]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_server import free_workload, workload  # noqa: E402

import mlxspec  # noqa: E402  (OpenBLAS before mlx.core)
from mlxspec.batch_step import BatchSpeculator, next_output  # noqa: E402
from mlxspec.engine import PromptCache  # noqa: E402


def loop_tps(slot, prompt, temp: float) -> float:
    start, n = time.perf_counter(), 0
    for out in slot.stream_steps(prompt, max_tokens=64, temperature=temp, seed=None,
                                 prompt_cache=PromptCache()):
        n += len(out.tokens)
    return n / (time.perf_counter() - start)


def batch_tps(batch, slot, prompt, temp: float) -> float:
    start, n = time.perf_counter(), 0
    row = batch.open(slot, prompt, max_tokens=64, temperature=temp, seed=None,
                     prompt_cache=PromptCache())
    while not row.finished:
        n += len(next_output(row).tokens)
    row.close()
    return n / (time.perf_counter() - start)


def main() -> None:
    engine = mlxspec.load(str(Path(__file__).resolve().parent.parent / "models"), mode="auto")
    for name, temp, texts in (("grounded", 0.0, workload(8)), ("free", 1.0, free_workload(8))):
        prompts = [engine.encode(p) for p in texts]
        loop_slot, batch_slot = engine.clone(), engine.clone()
        batch = BatchSpeculator(engine.model, solo="--no-solo" not in sys.argv)
        ratios = []
        for rnd in range(4):  # the first round warms both up and is not counted
            for i, p in enumerate(prompts):
                if (i + rnd) % 2:
                    x, y = loop_tps(loop_slot, p, temp), batch_tps(batch, batch_slot, p, temp)
                else:
                    y, x = batch_tps(batch, batch_slot, p, temp), loop_tps(loop_slot, p, temp)
                if rnd:
                    ratios.append(y / x)
        print(f"{name}: batch of one / single-request loop, median of {len(ratios)} pairs: "
              f"{statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
