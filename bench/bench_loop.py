"""The decode loop's own cost: Python functions of `mlxspec` entered per target forward, per
mode (a request by itself, after prefill, T = 0), the modules they live in, and plain
decoding's speed against mlx-lm's `stream_generate` on a model whose forward is well under a
millisecond (where the loop's Python is most of a token's cost).

    python bench/bench_loop.py                      # calls per forward, bundled model
    python bench/bench_loop.py --speed --runs 5     # and none vs mlx-lm on a 1-layer llama

Calls are counted with `sys.setprofile` ("call" events whose code lives under mlxspec/),
from the first step after prefill to the end, divided by the target forwards of those steps.
Speed: `Engine.generate` (mode none) and `mlx_lm.stream_generate` over the same prompt and
token count, interleaved, `--runs` times each in one process; the median of per-run ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import mlxspec  # noqa: F401  (OpenBLAS before mlx.core)

PACKAGE = str(Path(mlxspec.__file__).parent)


def count_calls(engine, prompt, mode: str, max_tokens: int, top: int = 8) -> dict:
    """Calls into mlxspec per target forward for one request in `mode`, after its prefill."""
    batch, row = engine.open(prompt, max_tokens=max_tokens, mode=mode)
    calls: Counter = Counter()

    def profile(frame, event, arg):
        if event == "call":
            path = frame.f_code.co_filename
            if path.startswith(PACKAGE):
                calls[(path[len(PACKAGE) + 1:], frame.f_code.co_name)] += 1

    while row.waiting:  # a prompt still prefilling (not counted)
        batch.step()
    forwards = row.stats.target_forwards
    sys.setprofile(profile)
    try:
        while row.live:
            batch.step()
    finally:
        sys.setprofile(None)
    forwards = row.stats.target_forwards - forwards
    batch.close(row)
    modules = {path for path, _ in calls}
    total = sum(calls.values())
    return {"mode": mode, "forwards": forwards, "calls_per_forward": total / max(forwards, 1),
            "modules": len(modules), "top": calls.most_common(top)}


def tiny_llama():
    """A 1-layer random llama, hidden 96: a forward well under a millisecond on a CPU."""
    import mlx.core as mx
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=96, num_hidden_layers=1,
                           intermediate_size=192, num_attention_heads=4, num_key_value_heads=2,
                           rms_norm_eps=1e-5, vocab_size=256, tie_word_embeddings=True)
    mx.random.seed(0)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def speed(runs: int, max_tokens: int) -> dict:
    """none against mlx-lm's stream_generate on the 1-layer llama: tok/s, interleaved."""
    from mlx_lm.generate import stream_generate
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from mlxspec.engine import Engine

    model = tiny_llama()
    tokenizer = mlxspec.load(None).tokenizer  # any tokenizer: ids below 256 only
    engine = Engine(model, tokenizer, mode="none")
    prompt = list(range(1, 33))
    wrapped = tokenizer if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer)

    def ours() -> float:
        start = time.perf_counter()
        out = engine.generate(prompt, max_tokens=max_tokens)
        return len(out.tokens) / (time.perf_counter() - start)

    def theirs() -> float:
        start, n = time.perf_counter(), 0
        for _ in stream_generate(model, wrapped, prompt, max_tokens=max_tokens):
            n += 1
        return n / (time.perf_counter() - start)

    ours(), theirs()  # warm-up
    pairs = []
    for i in range(runs):
        a, b = (ours(), theirs()) if i % 2 == 0 else tuple(reversed((theirs(), ours())))
        pairs.append((a, b))
    return {"none_tok_s": statistics.median(a for a, _ in pairs),
            "mlx_lm_tok_s": statistics.median(b for _, b in pairs),
            "ratio": statistics.median(a / b for a, b in pairs), "runs": runs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="none,ngram,draft,auto")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--speed", action="store_true", help="also none vs mlx-lm's stream_generate")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--speed-tokens", type=int, default=256)
    ap.add_argument("--top", type=int, default=8, help="functions listed per mode (stderr)")
    args = ap.parse_args(argv)

    engine = mlxspec.load(None, mode="draft")
    prompt = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci("
    print("| mode | target forwards | mlxspec calls per forward | modules entered |")
    print("|---|---|---|---|")
    for mode in args.modes.split(","):
        r = count_calls(engine, prompt, mode, args.max_tokens, args.top)
        print(f"| {mode} | {r['forwards']} | {r['calls_per_forward']:.0f} | {r['modules']} |")
        print("  most entered: " + ", ".join(f"{p}:{f} {n / r['forwards']:.1f}"
                                           for (p, f), n in r["top"]),
              file=sys.stderr)
    if args.speed:
        s = speed(args.runs, args.speed_tokens)
        print(f"\nnone {s['none_tok_s']:.0f} tok/s, mlx-lm stream_generate "
              f"{s['mlx_lm_tok_s']:.0f} tok/s: {s['ratio']:.3f}x (median of {s['runs']} "
              f"interleaved runs, {args.speed_tokens} tokens, 1-layer llama, hidden 96)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
