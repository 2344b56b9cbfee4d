"""Chain n-gram vs tree n-gram vs lookahead: tokens per target forward and tokens/s.

    python bench/bench_tree.py                       # bundled models/target if present
    python bench/bench_tree.py --random              # random-weight llama (no bundled model)
    python bench/bench_tree.py --grid                # also sweep lookahead (W, N, G)

Every mode decodes exactly --max-tokens greedy tokens per prompt (EOS ignored) after the prompt
is prefilled outside the timed region; outputs are checked token-identical to plain decoding.
"modelled vs none" replaces wall time, which a busy machine makes noisy, by the median forward
cost of each step's input size (measured first, interleaved): (tokens / sum of step costs) over
(1 / cost of a one-token forward). Plain decoding is mlx-lm's pipelined `generate_step`; speculative modes run
`mlxspec.batch_step.decode` (the engine's loop; trees and chains alike), chain n-gram included, so
the comparison between proposers is like for like.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import mlxspec  # noqa: E402  (loads OpenBLAS: must precede mlx.core)

assert mlxspec

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from mlxspec.batch_step import decode  # noqa: E402
from mlxspec.policy import FixedK  # noqa: E402
from mlxspec.proposers.lookahead import LookaheadProposer  # noqa: E402
from mlxspec.proposers.ngram import NgramProposer  # noqa: E402
from mlxspec.proposers.ngram_tree import TreeNgramProposer  # noqa: E402
from mlxspec.sampling import SamplingParams  # noqa: E402
from mlxspec.stats import Stats  # noqa: E402


def load_target(random_model: bool, path: str | None):
    if not random_model:
        p = Path(path) if path else ROOT / "models" / "target"
        if (p / "config.json").exists():
            from mlxspec.loading import load_model

            model, tok, _, _ = load_model(str(p))
            return model, tok, f"bundled:{p.name}"
        print(f"# no model at {p}; using a random-weight model", file=sys.stderr)
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import build_model

    model, _ = build_model("llama", seed=11, scale=4.0, hidden=384, layers=6, heads=6,
                           kv_heads=2, vocab=8192)
    return model, None, "random llama d=384 L=6 V=8k"


def workloads(tok, n: int, seed: int = 0) -> dict[str, list[list[int]]]:
    rng = random.Random(seed)
    if tok is None:
        rep, non = [], []
        for _ in range(n):
            unit = [rng.randrange(1, 8192) for _ in range(rng.randint(3, 12))]
            rep.append((unit * 20)[: rng.randint(40, 120)])
            non.append([rng.randrange(1, 8192) for _ in range(rng.randint(20, 120))])
        return {"repetitive": rep, "non-repetitive": non}
    from mlxspec.bench.workloads import build_workload

    out = {}
    for name, label in [("completion", "code-completion"), ("edit", "edit"),
                        ("chat", "chat")]:
        items = build_workload(name, n, seed=seed)
        out[label] = [tok.encode(it.prompt) for it in items]
    return out


def run_plain(model, prompt, max_tokens):
    cache = make_prompt_cache(model)
    model(mx.array(prompt[:-1], mx.uint32)[None], cache=cache)
    mx.eval([c.state for c in cache])
    start = time.perf_counter()
    out = [t for t, _ in generate_step(mx.array(prompt[-1:], mx.uint32), model,
                                       max_tokens=max_tokens, prompt_cache=cache)]
    return out, time.perf_counter() - start, len(out)


class StepStats(Stats):
    """Stats that also keep the number of nodes each target forward verified."""

    def __init__(self):
        super().__init__()
        self.nodes_per_step: list[int] = []
        self.pending_nodes = 0  # nodes of the proposal being verified (set by `counting`)

    def record_step(self, source, drafted, accepted, emitted):
        super().record_step(source, drafted, accepted, emitted)
        self.nodes_per_step.append(self.pending_nodes if drafted else 0)
        self.pending_nodes = 0


def counting(proposer, stats: StepStats):
    """Wrap `proposer.propose` so that `stats` learns each proposal's node count."""
    inner = proposer.propose

    def propose(*args, **kwargs):
        proposal = inner(*args, **kwargs)
        stats.pending_nodes = len(proposal) if proposal is not None else 0
        return proposal

    proposer.propose = propose
    return proposer


def forward_cost(model, sizes=(1, 2, 4, 8, 12, 16, 24, 32, 48, 64), context=128, rounds=7):
    """Median seconds of one tree forward over T input tokens (root + T-1 nodes) on a cache of
    `context` tokens, T in `sizes`, measured in interleaved rounds (robust to background load)."""
    import numpy as np

    from mlxspec.tree import tree_forward

    rng = random.Random(0)
    vocab = model.args.vocab_size
    cache = make_prompt_cache(model)
    model(mx.array([rng.randrange(vocab) for _ in range(context)], mx.uint32)[None], cache=cache)
    mx.eval([c.state for c in cache])
    times = {t: [] for t in sizes}
    for _ in range(rounds):
        for t in sizes:
            parents = [-1] + [rng.randrange(-1, i) for i in range(1, t - 1)] if t > 1 else []
            toks = [rng.randrange(vocab) for _ in parents]
            start = time.perf_counter()
            mx.eval(tree_forward(model, cache, 1, toks, parents))
            times[t].append(time.perf_counter() - start)
            for c in cache:
                c.trim(t)
    return {t: float(np.median(v)) for t, v in times.items()}


def cost_of(costs: dict, tokens: int) -> float:
    sizes = sorted(costs)
    if tokens <= sizes[0]:
        return costs[sizes[0]]
    for a, b in zip(sizes, sizes[1:]):
        if tokens <= b:
            return costs[a] + (costs[b] - costs[a]) * (tokens - a) / (b - a)
    return costs[sizes[-1]] * tokens / sizes[-1]


def run_spec(model, prompt, max_tokens, proposer, num_draft):
    cache = make_prompt_cache(model)
    model(mx.array(prompt[:-1], mx.uint32)[None], cache=cache)
    mx.eval([c.state for c in cache])
    stats = StepStats()
    proposer.reset(prompt, SamplingParams())
    start = time.perf_counter()
    out = []
    for new in decode(model, cache, list(prompt), counting(proposer, stats),
                                  FixedK(num_draft), SamplingParams(), max_tokens,
                                  mx.random.key(0), stats):
        out += new
    return out, time.perf_counter() - start, stats.target_forwards, stats


def bench(model, prompts, max_tokens, configs, costs):
    """Per prompt, plain decoding then every config back to back (interleaved, so background
    load hits all modes alike); totals over prompts."""
    acc = {label: {"t": 0.0, "n": 0, "f": 0, "drafted": 0, "est": 0.0, "same": True}
           for label in ["none", *configs]}
    for p in prompts:
        ref, t, f = run_plain(model, p, max_tokens)
        a = acc["none"]
        a["t"] += t
        a["n"] += len(ref)
        a["f"] += f
        a["est"] += f * cost_of(costs, 1)
        for label, (factory, k) in configs.items():
            out, t, f, st = run_spec(model, p, max_tokens, factory(), k)
            a = acc[label]
            a["same"] &= out == ref
            a["t"] += t
            a["n"] += len(out)
            a["f"] += f
            a["drafted"] += st.drafted
            a["est"] += sum(cost_of(costs, d + 1) for d in st.nodes_per_step)
    base = acc["none"]
    rows = {}
    for label, a in acc.items():
        rows[label] = {"tok_per_fwd": a["n"] / a["f"], "nodes_per_fwd": a["drafted"] / a["f"],
                       "tps": a["n"] / a["t"],
                       "speedup": (a["n"] / a["t"]) / (base["n"] / base["t"]),
                       "est_speedup": (a["n"] / a["est"]) / (base["n"] / base["est"]),
                       "identical": a["same"]}
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--random", action="store_true")
    ap.add_argument("--model")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-draft", type=int, default=4)
    ap.add_argument("--grid", action="store_true", help="sweep lookahead (W, N, G)")
    ap.add_argument("--lookahead", nargs="*", default=[], metavar="W,N,G",
                    help="extra lookahead settings to measure")
    ap.add_argument("--budgets", nargs="*", type=int, default=[8, 16, 32],
                    help="tree n-gram node budgets to measure")
    ap.add_argument("--json")
    args = ap.parse_args()
    model, tok, name = load_target(args.random, args.model)
    k = args.num_draft
    configs = {
        f"ngram chain k={k}": (lambda: NgramProposer(), k),
        **{f"ngram tree k={k} B={b}": (lambda b=b: TreeNgramProposer(budget=b), k)
           for b in args.budgets},
        "lookahead default": (lambda: LookaheadProposer(model), k),
    }
    for spec in args.lookahead:
        w, n, g = (int(x) for x in spec.split(","))
        configs[f"lookahead W={w} N={n} G={g}"] = (
            lambda w=w, n=n, g=g: LookaheadProposer(model, w, n, g), k)
    if args.grid:
        for w, n, g in [(2, 3, 2), (4, 3, 4), (4, 4, 4), (6, 4, 6), (8, 4, 8), (5, 5, 5),
                        (8, 5, 8), (15, 5, 15), (3, 4, 8), (0, 4, 8), (2, 4, 4), (1, 3, 4)]:
            configs[f"lookahead W={w} N={n} G={g}"] = (
                lambda w=w, n=n, g=g: LookaheadProposer(model, w, n, g), k)
        configs["lookahead W=4 N=4 G=4 candidates-only"] = (
            lambda: LookaheadProposer(model, 4, 4, 4, verify_window=False), k)
        configs["lookahead W=4 N=4 G=4 no-output-pool"] = (
            lambda: LookaheadProposer(model, 4, 4, 4, pool_from_output=False), k)
    report = {"model": name, "max_tokens": args.max_tokens, "prompts": args.prompts,
              "workloads": {}}
    for wname, prompts in workloads(tok, args.prompts).items():
        costs = forward_cost(model)  # per workload: close in time to the runs it models
        ms = {t: round(c * 1e3, 2) for t, c in costs.items()}
        print(f"# forward ms by input tokens: {ms}", flush=True)
        rows = bench(model, prompts, args.max_tokens, configs, costs)
        report["workloads"][wname] = {"forward_ms": ms, "rows": rows}
        print(f"\n## {wname} ({name}, {args.prompts} prompts x {args.max_tokens} tokens)")
        print("| mode | tokens/forward | nodes/forward | tokens/s | vs none | modelled vs none "
              "| identical |")
        print("|---|---|---|---|---|---|---|")
        for label, r in rows.items():
            print(f"| {label} | {r['tok_per_fwd']:.2f} | {r.get('nodes_per_fwd', 0):.1f} | "
                  f"{r['tps']:.1f} | {r['speedup']:.2f}x | {r['est_speedup']:.2f}x | "
                  f"{r['identical']} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
