"""#40: what verifying k tokens costs on this CPU, op by op. One forward of w rows (w = 1, 5,
9, 17: a plain step, then k = 4, 8, 16 drafted tokens) over a cache of C tokens, timed whole and
split into the model's ops: the matmuls (q/k/v/o, gate/up/down, the output head), attention
(scores and softmax over the cache), RMS norms, RoPE and the elementwise rest. Prints t(w)/t(1)
per op: the policy's arithmetic rests on t(w)/t(1), and ideally extra rows cost only matmul
arithmetic (the weights are read once whatever w is).

    python bench/bench_verify_cost.py -m qwen2.5-coder-1.5b [--context 1024] [--reps 5]
    python bench/bench_verify_cost.py -m qwen2.5-coder-1.5b --both-envs

`--both-envs` runs the profile twice in fresh processes: with OPENBLAS_CORETYPE=Haswell and
OPENBLAS_L2_SIZE=512 (what this project's machines set: ../shared/DESIGN.md), then with both
unset (labelled; OpenBLAS reads them when it loads). Tests and CI never change them.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import mlxspec  # noqa: F401  (OpenBLAS before mlx.core: imported first, see backend.py)

# isort: split
import mlx.core as mx

from mlxspec.loading import load

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_check import timed  # noqa: E402  (median seconds of fn(), after a warm-up)

WIDTHS = (1, 5, 9, 17)
ENV_VARS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")


def filled_cache(model, context: int) -> list:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    tokens = mx.random.randint(0, model.args.vocab_size, (1, context))
    for i in range(0, context, 1024):
        model(tokens[:, i : i + 1024], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def op_times(model, cache: list, context: int, w: int, reps: int) -> dict[str, float]:
    """Seconds per op kind for one forward of w rows after `context` cached, summed over the
    layers (each op timed alone on the inputs it sees there), and the whole forward."""
    from mlx_lm.models.base import scaled_dot_product_attention

    inner = model.model
    layer = inner.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    n_layers = len(inner.layers)
    rows = mx.random.randint(0, model.args.vocab_size, (1, w))

    def whole():
        out = model(rows, cache=cache)
        for c in cache:
            c.trim(w)
        return out

    h = inner.embed_tokens(rows)
    x = layer.input_layernorm(h)
    B, L, _ = x.shape
    q = attn.q_proj(x).reshape(B, L, attn.n_heads, -1).transpose(0, 2, 1, 3)
    k = attn.k_proj(x).reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    keys = mx.concatenate([cache[0].keys[..., :context, :], k], axis=2)
    values = mx.concatenate([cache[0].values[..., :context, :], k], axis=2)
    mask = "causal" if w > 1 else None
    o_in = mx.random.normal((B, L, attn.n_heads * q.shape[-1]))
    g = mx.random.normal((B, L, mlp.down_proj.weight.shape[1]))
    mx.eval(h, x, q, k, keys, values, o_in, g)
    per_layer = {
        "q/k/v matmuls": lambda: [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)],
        "RoPE": lambda: [attn.rope(q, offset=context), attn.rope(k, offset=context)],
        "attention": lambda: scaled_dot_product_attention(q, keys, values, cache=None,
                                                          scale=attn.scale, mask=mask),
        "o matmul": lambda: attn.o_proj(o_in),
        "RMS norms": lambda: [layer.input_layernorm(h), layer.post_attention_layernorm(h)],
        "gate/up matmuls": lambda: [mlp.gate_proj(x), mlp.up_proj(x)],
        "SiLU and product": lambda: mx.sigmoid(g) * g * g,
        "down matmul": lambda: mlp.down_proj(g),
    }
    out = {name: n_layers * timed(fn, reps) for name, fn in per_layer.items()}
    head = model.lm_head if getattr(model, "lm_head", None) is not None else None
    out["output head"] = timed(lambda: head(x) if head is not None
                               else inner.embed_tokens.as_linear(x), reps)
    out["whole forward"] = timed(whole, reps)
    return out


def profile(args) -> None:
    engine = load(args.model, mode="none", no_draft=True)
    model = engine.model
    mx.eval(model.parameters())  # (loading leaves the cast to float32 lazy: done once here)
    env = ", ".join(f"{v}={os.environ.get(v, '(unset)')}" for v in ENV_VARS)
    print(f"\n### {engine.name}, float32, C = {args.context} cached; {env}\n")
    print("| op | " + " | ".join(f"w={w} ms" for w in WIDTHS) + " | "
          + " | ".join(f"t({w})/t(1)" for w in WIDTHS[1:]) + " |")
    print("|---|" + "---:|" * (2 * len(WIDTHS) - 1))
    cache = filled_cache(model, args.context)
    by_width = {w: op_times(model, cache, args.context, w, args.reps) for w in WIDTHS}
    for name in by_width[1]:
        t = [by_width[w][name] for w in WIDTHS]
        print(f"| {name} | " + " | ".join(f"{1000 * x:.1f}" for x in t) + " | "
              + " | ".join(f"{x / t[0]:.2f}" for x in t[1:]) + " |", flush=True)
    parts = [sum(v for k, v in by_width[w].items() if k != "whole forward") for w in WIDTHS]
    print("| (sum of the ops) | " + " | ".join(f"{1000 * x:.1f}" for x in parts) + " | "
          + " | ".join(f"{x / parts[0]:.2f}" for x in parts[1:]) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--both-envs", action="store_true")
    args = ap.parse_args()
    if not args.both_envs:
        profile(args)
        return
    base = [sys.executable, __file__, "-m", args.model, "--context", str(args.context),
            "--reps", str(args.reps)]
    unset = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    subprocess.run(base, check=True, env={**unset, "OPENBLAS_CORETYPE": "Haswell",
                                          "OPENBLAS_L2_SIZE": "512"})
    print("\n(the same with OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset: a benchmark-only "
          "figure; tests and CI keep the environment as given)")
    subprocess.run(base, check=True, env=unset)


if __name__ == "__main__":
    main()
