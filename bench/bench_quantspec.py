"""QuantSpec on the bundled model: acceptance and speed at several context lengths, the KV memory
table, the bytes each step reads, and how far the hierarchical-cache target is from the fp one.

    python bench/bench_quantspec.py [--model DIR] [--contexts 1024,4096,16384] [--max-tokens 64]

Modes run interleaved in one process: `none` (fp cache), `none` with the hierarchical cache (the
reference quantspec is exact to) and `quantspec`. Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import statistics

import mlxspec  # noqa: F401  (OpenBLAS before mlx.core)
from mlxspec.engine import PromptCache, load
from mlxspec.quant.memory import format_memory_table, kv_memory_for_model
from mlxspec.quant.report import quality_report, step_bytes
from mlxspec.recipe.heldout import heldout_eval_texts


def context_prompts(engine, length: int, n: int) -> list[list[int]]:
    """`n` prompts of `length` held-out tokens, starting at different offsets."""
    text = "".join(heldout_eval_texts(max_bytes=max(256_000, length * 6 * (n + 1))))
    tokens = engine.encode(text)
    step = max(1, (len(tokens) - length) // max(1, n))
    return [tokens[i * step : i * step + length] for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--contexts", default="1024,4096,16384")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-draft", type=int, default=5)
    ap.add_argument("--group-size", type=int, default=64)
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    G = args.group_size
    engine = load(args.model, mode="quantspec", num_draft=args.num_draft,
                  max_context=max(contexts) + args.max_tokens + 1, group_size=G)
    ref = load(args.model, mode="none", max_context=max(contexts) + args.max_tokens + 1,
               kv="hierarchical", kv_group_size=G)
    proposer = engine.proposer

    print("## Acceptance and speed\n")
    print("| context | mode | tok/s | speedup vs none (median) | acceptance | tok/forward |")
    print("|---:|---|---:|---:|---:|---:|")
    for length in contexts:
        rows = {"none": [], "none+hier": [], "quantspec": []}
        for prompt in context_prompts(engine, length, args.prompts):
            runs = [("none", engine, "none"), ("none+hier", ref, "none"),
                    ("quantspec", engine, "quantspec")]
            for label, eng, mode in runs:
                r = eng.generate(prompt, max_tokens=args.max_tokens, mode=mode,
                                 prompt_cache=PromptCache())
                rows[label].append(r)
            assert rows["quantspec"][-1].tokens == rows["none+hier"][-1].tokens, "not lossless"
        base = [r.stats.generation_tps for r in rows["none"]]
        for label, rs in rows.items():
            tps = statistics.median(r.stats.generation_tps for r in rs)
            ratio = statistics.median(r.stats.generation_tps / b for r, b in zip(rs, base))
            drafted = sum(r.stats.drafted for r in rs)
            acc = f"{100 * sum(r.stats.accepted for r in rs) / drafted:.1f}%" if drafted else "–"
            tpf = sum(r.stats.generated_tokens for r in rs) / sum(r.stats.target_forwards for r in rs)
            print(f"| {length} | {label} | {tps:.1f} | {ratio:.2f}× | {acc} | {tpf:.2f} |")

    print("\n## KV memory (bytes per token, all layers)\n")
    try:
        print(format_memory_table(kv_memory_for_model(engine.model, (1024, 8192, 32768))))
    except ValueError as e:  # mlx-lm's QuantizedKVCache needs head_dim divisible by 32/64
        print(f"(not measurable for this model: {e})")

    print("\n## Bytes read per step (weights + KV)\n")
    print("| context | draft step | verify step | plain step (fp16 KV) |")
    print("|---:|---:|---:|---:|")
    import mlx.core as mx

    for length in contexts:
        b = step_bytes(engine.model, proposer.draft_model, length, G, kv_dtype=mx.float16)
        print(f"| {length} | {b['draft_step']:,} | {b['verify_step']:,} | {b['plain_step']:,} |")

    print("\n## Quality on held-out text (bits per byte)\n")
    text = "".join(heldout_eval_texts(max_bytes=16_000))
    q = quality_report(engine.model, proposer.draft_model, engine.encode(text), G,
                       num_bytes=len(text.encode()))
    for key, value in q.items():
        print(f"- {key}: {value:.4f}" if isinstance(value, float) else f"- {key}: {value}")


if __name__ == "__main__":
    main()
