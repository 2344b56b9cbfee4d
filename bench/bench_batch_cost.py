"""What a batched step costs, measured: where the batch policy's prior comes from
(`mlxspec/policy/batch.py`) and what joining and leaving the batch cost
(`mlxspec/batch_step.py`, `RaggedKVCache`).

    python bench/bench_batch_cost.py [--model DIR]

1. The target's forward over B rows of width W (a `RaggedKVCache` of ragged rows of about S
   tokens), median milliseconds, and the least-squares fit T = a + n*N + m*N*S/1024 (N = B*W
   query rows) printed relative to a, the form of the policy's prior.
2. A row joining and leaving a batch of 8 rows of 300 tokens: appending to the dense buffer
   and removing from it (a copy of the whole cache each: `add_row`, `remove_row`) against
   writing into an empty row and copying one row out (`put_row`, `take_row`: what the server's
   batch does).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import mlxspec  # noqa: E402  (OpenBLAS before mlx.core)

assert mlxspec

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from mlxspec.batch_step import RaggedKVCache  # noqa: E402


def median_ms(fn, runs: int = 25, warm: int = 5) -> float:
    times = []
    for _ in range(runs + warm):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[warm:])


def kv_shape(model) -> tuple[int, int, int, mx.Dtype]:
    """(layers, kv heads, head dim, dtype) from one forward's cache."""
    cache = [KVCache() for _ in model.layers]
    model(mx.array([[1, 2]], mx.uint32), cache=cache)
    keys = cache[0].keys
    return len(cache), keys.shape[1], keys.shape[3], keys.dtype


def single(heads: int, dim: int, n: int, dtype) -> KVCache:
    c = KVCache()
    k = mx.random.normal((1, heads, n, dim)).astype(dtype)
    c.update_and_fetch(k, k)
    return c


def ragged(layers: int, heads: int, dim: int, lengths: list[int], dtype) -> list[RaggedKVCache]:
    cache = [RaggedKVCache() for _ in range(layers)]
    for c in cache:
        for n in lengths:
            c.add_row(single(heads, dim, n, dtype))
    mx.eval([c.state for c in cache])
    return cache


def forward_costs(model) -> None:
    layers, heads, dim, dtype = kv_shape(model)
    rows, seconds = [], []
    print("| rows B | width W | keys S | ms |\n|---:|---:|---:|---:|")
    for span in (100, 400):
        for b in (1, 2, 4, 8):
            lengths = [span - 5 * i for i in range(b)]
            cache = ragged(layers, heads, dim, lengths, dtype)
            for w in (1, 3, 5, 9):
                def step(b=b, w=w, cache=cache):
                    out = model(mx.zeros((b, w), mx.uint32), cache=cache)
                    mx.eval(mx.argmax(out, axis=-1))
                    for c in cache:
                        c.trim_rows([w] * b)

                ms = median_ms(step)
                n = b * w
                rows.append([1.0, n, n * (span + w) / 1024])
                seconds.append(ms)
                print(f"| {b} | {w} | {span} | {ms:.2f} |")
    coef, *_ = np.linalg.lstsq(np.array(rows), np.array(seconds), rcond=None)
    a = coef[0]
    print(f"\nfit: T = {a:.2f} ms + {coef[1]:.3f} ms * N + {coef[2]:.3f} ms * N*S/1024; "
          f"relative to the intercept: n = {coef[1] / a:.3f}, m = {coef[2] / a:.3f}")


def join_leave_costs(model) -> None:
    layers, heads, dim, dtype = kv_shape(model)
    cache = ragged(layers, heads, dim, [300] * 8, dtype)
    joiner = single(heads, dim, 300, dtype)
    mx.eval(joiner.keys)

    def on_every_layer(op):
        def run():
            for c in cache:
                op(c)
            mx.eval([c.state for c in cache])
        return run

    dense_leave = on_every_layer(lambda c: c.remove_row(3))
    dense_join = on_every_layer(lambda c: c.add_row(joiner))
    slot_leave = on_every_layer(lambda c: c.take_row(3))
    slot_join = on_every_layer(lambda c: c.put_row(3, joiner))

    def pair(leave, join):
        times = [[], []]
        for _ in range(25):
            for i, fn in enumerate((leave, join)):
                start = time.perf_counter()
                fn()
                times[i].append(time.perf_counter() - start)
        return [1e3 * statistics.median(t[5:]) for t in times]

    dense, slots = pair(dense_leave, dense_join), pair(slot_leave, slot_join)
    print(f"\n8 rows of 300 tokens, {layers} layers (cache buffer {tuple(cache[0].keys.shape)}):")
    print("| | leave (ms) | join (ms) |\n|---|---:|---:|")
    print(f"| dense rows (a copy of the cache each) | {dense[0]:.2f} | {dense[1]:.2f} |")
    print(f"| an empty row, written in place | {slots[0]:.2f} | {slots[1]:.2f} |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models"))
    args = ap.parse_args(argv)
    engine = mlxspec.load(args.model, mode="none")
    forward_costs(engine.model)
    join_leave_costs(engine.model)


if __name__ == "__main__":
    main()
