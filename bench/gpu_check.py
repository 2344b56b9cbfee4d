"""On a GPU (MLX's CUDA or Metal backend): what a step costs there, the
roofline that predicts it, and whether every mode stays exact in half precision.

    bash bench/gpu_check.sh                # installs mlx[cuda], then runs this
    python bench/gpu_check.py [--model DIR | --like qwen2.5-coder-1.5b] [--dtype float16]
        [--contexts 1024,4096,16384] [--max-tokens 64] [--json FILE]

`--model DIR`: an MLX model folder (real weights: acceptance means something). `--like NAME`
(the default, for a machine that cannot fetch the weights): random weights with that model's
architecture, its tokenizer from `--tokenizer DIR` (else bytes). A step's cost does not depend
on what the weights mean, so the timings hold; acceptance and speed-ups of the end-to-end runs
do not, and are labelled.

It prints, as Markdown:
1. the device and its measured copy bandwidth;
2. the verification profile: one forward of w tokens over a cache of C tokens, t(w)/t(1), for
   the model in `--dtype` and with 4-bit weights (QuantSpec's draft), each the median of reps;
3. the roofline: the bytes a plain step reads (weights + KV) over the measured bandwidth
   against the measured t(1), and a PROJECTION of QuantSpec's and the draft's speed-up from
   those step times and an acceptance (tokens per target forward) measured elsewhere,
   `--tokens-per-forward` (default: the coder pair's on this project's CPU runs);
4. end-to-end runs of `none`, `none` on the hierarchical cache, `quantspec`, `ngram` and
   `draft` on prompts of real source text, each checked token-identical to its reference.
Exits 1 if any run is not token-identical.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import mlxspec  # noqa: E402, F401  (OpenBLAS before mlx.core, on a CPU: imported first)

# isort: split
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from mlxspec.bench.run import measure_bandwidth, weight_bytes  # noqa: E402

# The architectures of the coder pair (Qwen2.5-Coder-1.5B/0.5B-Instruct's config.json)
LIKE = {
    "qwen2.5-coder-1.5b": dict(
        model_type="qwen2", hidden_size=1536, num_hidden_layers=28, intermediate_size=8960,
        num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True),
    "qwen2.5-coder-0.5b": dict(
        model_type="qwen2", hidden_size=896, num_hidden_layers=24, intermediate_size=4864,
        num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True),
    # a smoke test of this script on any machine (bytes as tokens)
    "tiny": dict(model_type="qwen2", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                 max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-6,
                 tie_word_embeddings=True),
    "tiny-draft": dict(model_type="qwen2", hidden_size=64, num_hidden_layers=1,
                       intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=256, max_position_embeddings=4096, rope_theta=10000.0,
                       rms_norm_eps=1e-6, tie_word_embeddings=True),
}
DRAFT_OF = {"qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b", "tiny": "tiny-draft"}
# Tokens per target forward measured on this project's CPU with the real coder pair, k = 4
# (docs/PERFORMANCE.md, bench-results/coder-1.5b-quiet): QuantSpec 4.4-4.8, the draft ~3.6.
MEASURED_TPF = {"quantspec": 4.4, "draft": 3.6}
WIDTHS = (1, 2, 3, 5, 9, 17)


def random_model(name: str, dtype, seed: int = 0):
    from mlx_lm.models import qwen2

    mx.random.seed(seed)
    model = qwen2.Model(qwen2.ModelArgs.from_dict(LIKE[name]))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def quantized_copy(model, bits: int = 4, group_size: int = 64):
    """A 4-bit copy of `model` (QuantSpec's draft weights), the original left as it is."""
    from mlx.utils import tree_flatten

    clone = type(model)(model.args)
    clone.load_weights(list(tree_flatten(model.parameters())))
    nn.quantize(clone, group_size=group_size, bits=bits)
    mx.eval(clone.parameters())
    return clone


def kv_bytes(model, context: int, dtype) -> int:
    args = model.args
    head_dim = args.hidden_size // args.num_attention_heads
    return 2 * args.num_hidden_layers * args.num_key_value_heads * head_dim * context * dtype.size


def timed(fn, reps: int) -> float:
    """Median seconds of fn() (evaluated), after one warm-up."""
    mx.eval(fn())
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def filled_cache(model, context: int, chunk: int = 2048):
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    tokens = mx.random.randint(0, model.args.vocab_size, (1, context), dtype=mx.int32)
    for i in range(0, context, chunk):
        model(tokens[:, i : i + chunk], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def verification_profile(model, context: int, reps: int) -> dict[int, float]:
    """Seconds of one forward of w tokens over a cache of `context`, per w in WIDTHS (the
    cache trimmed back after each, as a rejected proposal is)."""
    cache = filled_cache(model, context)
    out = {}
    for w in WIDTHS:
        inputs = mx.random.randint(0, model.args.vocab_size, (1, w), dtype=mx.int32)

        def step(inputs=inputs, w=w):
            logits = model(inputs, cache=cache)
            for c in cache:
                c.trim(w)
            return logits

        out[w] = timed(step, reps)
    return out


def source_prompts(tokenizer, length: int, n: int) -> list[list[int]]:
    """`n` prompts of `length` tokens of this repository's own Python source."""
    text = "".join(p.read_text() for p in sorted((REPO / "mlxspec").rglob("*.py")))
    tokens = tokenizer.encode(text)
    while len(tokens) < (n + 1) * length:
        tokens = tokens + tokens
    step = (len(tokens) - length) // n
    return [tokens[i * step : i * step + length] for i in range(n)]


def end_to_end(model, draft, tokenizer, contexts, max_tokens: int, prompts: int) -> list[dict]:
    from mlxspec.engine import Engine, PromptCache

    engine = Engine(model, tokenizer, mode="none", draft_model=draft)
    hier = Engine(model, tokenizer, mode="none", kv="hierarchical")
    rows = []
    for context in contexts:
        # every mode once first, not counted: the GPU backend compiles its kernels on first use
        # (on the H200 the first prompt of each context ran at half the second one's speed)
        warm = source_prompts(tokenizer, context, 1)[0]
        hier.generate(warm, max_tokens=8, prompt_cache=PromptCache())
        for mode in ("none", "quantspec", "ngram") + (("draft",) if draft is not None else ()):
            engine.generate(warm, max_tokens=8, mode=mode, prompt_cache=PromptCache())
        for prompt in source_prompts(tokenizer, context, prompts):
            ref = engine.generate(prompt, max_tokens=max_tokens, prompt_cache=PromptCache())
            ref_hier = hier.generate(prompt, max_tokens=max_tokens, prompt_cache=PromptCache())
            runs = [("none", ref, ref), ("none+hier", ref_hier, ref_hier)]
            for mode, want in (("quantspec", ref_hier), ("ngram", ref), ("draft", ref)):
                if mode == "draft" and draft is None:
                    continue
                runs.append((mode, engine.generate(prompt, max_tokens=max_tokens, mode=mode,
                                                   prompt_cache=PromptCache()), want))
            for mode, r, want in runs:
                s = r.stats
                rows.append(dict(context=context, mode=mode, tokens=s.generated_tokens,
                                 decode_s=s.decode_seconds, prefill_s=s.prefill_seconds,
                                 forwards=s.target_forwards, drafted=s.drafted,
                                 accepted=s.accepted, identical=r.tokens == want.tokens,
                                 peak_gb=s.peak_memory_gb))
            print(f"  {context} tokens: " + ", ".join(
                f"{m} {r.stats.generated_tokens / max(r.stats.decode_seconds, 1e-9):.0f} tok/s"
                + ("" if r.tokens == w.tokens else " NOT IDENTICAL") for m, r, w in runs),
                file=sys.stderr, flush=True)
    return rows


def load_tokenizer(path: str | None):
    if path:
        from mlx_lm.tokenizer_utils import load

        return load(Path(path))
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import ByteTokenizer

    return ByteTokenizer(256)


def device_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=20).stdout.strip() or str(mx.default_device())
    except (OSError, subprocess.SubprocessError):
        return str(mx.default_device())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--like", default="qwen2.5-coder-1.5b", choices=sorted(LIKE))
    ap.add_argument("--model", help="an MLX model folder (real weights) instead of --like")
    ap.add_argument("--draft-model", help="its draft's folder (with --model)")
    ap.add_argument("--tokenizer", help="a tokenizer folder for --like (default: bytes)")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--contexts", default="1024,4096,16384")
    ap.add_argument("--e2e-contexts", default="1024,4096")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--tokens-per-forward", type=json.loads, default=MEASURED_TPF,
                    help='JSON {"quantspec": 4.4, "draft": 3.6}: acceptance for the projection')
    ap.add_argument("--project-bandwidth", default="",
                    help="GB/s, comma-separated (e.g. 120,273,546: M4, M4 Pro, M4 Max): also "
                         "project QuantSpec from bytes alone at these bandwidths")
    ap.add_argument("--json", help="write every figure here")
    args = ap.parse_args()
    dtype = getattr(mx, args.dtype)
    contexts = [int(c) for c in args.contexts.split(",") if c]
    e2e = [int(c) for c in args.e2e_contexts.split(",") if c]
    report: dict = {"device": device_name(), "mlx": mx.__version__, "dtype": args.dtype,
                    "backend": str(mx.default_device())}

    if args.model:
        from mlx_lm import load

        model, tokenizer = load(args.model)
        draft = load(args.draft_model)[0] if args.draft_model else None
        weights = f"real weights: {args.model}"
    else:
        model = random_model(args.like, dtype)
        draft = random_model(DRAFT_OF[args.like], dtype, seed=1) if args.like in DRAFT_OF \
            else None
        tokenizer = load_tokenizer(args.tokenizer)
        weights = f"RANDOM weights shaped like {args.like} (timings hold; acceptance does not)"
    report["weights"] = weights
    gbs = measure_bandwidth(1024)
    report["bandwidth_gb_s"] = gbs / 1e9
    print(f"# GPU check\n\n{report['device']} · MLX {mx.__version__} · {report['backend']} · "
          f"{args.dtype} · {weights}\n\nmeasured copy bandwidth: {gbs / 1e9:.0f} GB/s\n")

    q4 = quantized_copy(model)
    profile = {}
    print("## Verification profile: one forward of w tokens over C cached, ms (t(w)/t(1))\n")
    print("| weights | C | " + " | ".join(f"w={w}" for w in WIDTHS) + " |")
    print("|---|---:|" + "---:|" * len(WIDTHS))
    for label, m in ((args.dtype, model), ("4-bit", q4)):
        for c in contexts:
            try:
                t = verification_profile(m, c, args.reps)
            except Exception as e:  # noqa: BLE001  (one failure must not end the check)
                print(f"| {label} | {c} | failed: {type(e).__name__}: {e} |")
                continue
            profile[f"{label}@{c}"] = t
            print(f"| {label} | {c} | " + " | ".join(
                f"{1000 * t[w]:.2f} ({t[w] / t[1]:.2f})" for w in WIDTHS) + " |", flush=True)

    print("\n## Roofline: a plain step's bytes over the measured bandwidth\n")
    print("| C | weights MB | KV MB | roofline ms | measured t(1) ms | measured / roofline |")
    print("|---:|---:|---:|---:|---:|---:|")
    w_bytes = weight_bytes(model)
    roof = {}
    for c in contexts:
        t1 = profile.get(f"{args.dtype}@{c}", {}).get(1)
        kv = kv_bytes(model, c, dtype)
        ideal = (w_bytes + kv) / gbs
        roof[c] = dict(weights=w_bytes, kv=kv, roofline_s=ideal, measured_s=t1)
        print(f"| {c} | {w_bytes / 1e6:.0f} | {kv / 1e6:.0f} | {1000 * ideal:.2f} | "
              + (f"{1000 * t1:.2f} | {t1 / ideal:.2f} |" if t1 else "– | – |"))
    report["roofline"] = roof

    print("\n## PROJECTION (not measured end to end): speed-up from these step times\n")
    print("Tokens per target forward from the real coder pair on this project's CPU runs "
          f"({args.tokens_per_forward}); k = 4; QuantSpec drafts with the 4-bit forward, the "
          "draft model with a forward of the draft's architecture (≈ its weights' share).\n")
    print("| C | mode | draft ms/token | verify ms (w=5) | plain ms | projected × none |")
    print("|---:|---|---:|---:|---:|---:|")
    projections = {}
    ratio = weight_bytes(draft) / w_bytes if draft is not None else None
    for c in contexts:
        full, quant = profile.get(f"{args.dtype}@{c}"), profile.get(f"4-bit@{c}")
        if not full:
            continue
        plain, verify = full[1], full[5]
        drafts = {"quantspec": quant[1] if quant else None,
                  "draft": plain * ratio if ratio else None}
        for mode, per_token in drafts.items():
            tpf = args.tokens_per_forward.get(mode)
            if per_token is None or tpf is None:
                continue
            x = tpf * plain / (4 * per_token + verify)
            projections[f"{mode}@{c}"] = x
            print(f"| {c} | {mode} | {1000 * per_token:.2f} | {1000 * verify:.2f} | "
                  f"{1000 * plain:.2f} | {x:.2f} |")
    report["projection"] = projections

    if args.project_bandwidth:
        print("\n## PROJECTION at other memory bandwidths (bytes only: a bandwidth-bound step)\n")
        print("QuantSpec: k = 4 draft steps reading 4-bit weights and the 4-bit KV view, then one "
              "verify reading the weights and the 8-bit view; plain: the weights and a float16 "
              f"KV cache; tokens per target forward {args.tokens_per_forward.get('quantspec')}."
              "\n")
        print("| GB/s | C | plain ms | QuantSpec draft + verify ms | projected x none |")
        print("|---:|---:|---:|---:|---:|")
        from mlxspec.quant.report import step_bytes

        tpf = args.tokens_per_forward.get("quantspec", 4.4)
        for gbps in [float(b) for b in args.project_bandwidth.split(",")]:
            for c in contexts:
                b = step_bytes(model, q4, c, 64, kv_dtype=mx.float16, weight_dtype=mx.float16)
                plain, draft_s, verify = (b["plain_step"] / gbps / 1e9, b["draft_step"] / gbps
                                          / 1e9, b["verify_step"] / gbps / 1e9)
                x = tpf * plain / (4 * draft_s + verify)
                projections[f"quantspec@{c}@{gbps:.0f}GB/s"] = x
                print(f"| {gbps:.0f} | {c} | {1000 * plain:.2f} | {1000 * (4 * draft_s + verify):.2f}"
                      f" | {x:.2f} |")
    report["profile"] = {k: {str(w): s for w, s in v.items()} for k, v in profile.items()}

    print(f"\n## End to end ({weights}), {args.max_tokens} tokens, {args.prompts} prompts "
          "per context\n")
    rows = end_to_end(model, draft, tokenizer, e2e, args.max_tokens, args.prompts)
    report["runs"] = rows
    print("| C | mode | tok/s | × none | tokens / target forward | acceptance | identical |")
    print("|---:|---|---:|---:|---:|---:|---|")
    for c in e2e:
        base = [r for r in rows if r["context"] == c and r["mode"] == "none"]
        base_tps = sum(r["tokens"] for r in base) / sum(r["decode_s"] for r in base)
        for mode in dict.fromkeys(r["mode"] for r in rows):
            rs = [r for r in rows if r["context"] == c and r["mode"] == mode]
            if not rs:
                continue
            tps = sum(r["tokens"] for r in rs) / sum(r["decode_s"] for r in rs)
            drafted = sum(r["drafted"] for r in rs)
            acc = f"{100 * sum(r['accepted'] for r in rs) / drafted:.0f}%" if drafted else "–"
            tpf = sum(r["tokens"] for r in rs) / max(1, sum(r["forwards"] for r in rs))
            same = all(r["identical"] for r in rs)
            print(f"| {c} | {mode} | {tps:.0f} | {tps / base_tps:.2f} | {tpf:.2f} | {acc} | "
                  f"{'yes' if same else 'NO'} |")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    bad = [r for r in rows if not r["identical"]]
    if bad:
        print(f"\nNOT token-identical: {len(bad)} runs", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
