"""Seeded sampling on a real pair: is every mode token-identical to `none` with the same seed,
and what does the keyed rule (Gumbel-max with noise keyed by seed and position, the rule of
seeded requests) cost a draft model against the rejection rule (requests without a seed)?

    python bench/bench_seeded.py -m qwen2.5-coder-1.5b --workloads fim,edit,chat \
        --prompts 4 --temps 0.7,1 --max-tokens 32 --json bench-results/seeded/coder.json

Per prompt and temperature: `none` with the seed (the reference), then every mode with the
same seed (must equal it), then each of `--compare` without a seed (the rejection rule). The
order of the modes rotates per prompt. Reported per workload and temperature: how many
outputs equal `none`'s, and for `--compare` the draft acceptance (accepted / drafted), tokens
per target forward and tok/s under each rule, as medians over prompts of the per-prompt
figures, with the median of per-prompt ratios keyed / rejection.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import mlxspec  # noqa: F401  (OpenBLAS before mlx.core)
from mlxspec.bench.workloads import build_workload

# name -> (mode, options)
MODES = {"none": ("none", {}), "ngram": ("ngram", {}), "draft": ("draft", {}),
         "draft-tree": ("draft", {"tree_width": 3}), "lookahead": ("lookahead", {}),
         "suffix": ("suffix", {}), "auto": ("auto", {})}


def run(engine, name: str, item, temperature: float, seed: int | None) -> dict:
    mode, options = MODES[name]
    engine.set_mode(mode, **options)
    start = time.perf_counter()
    out = engine.generate(item.prompt, max_tokens=item.max_tokens, temperature=temperature,
                          seed=seed, prediction=item.prediction)
    seconds = time.perf_counter() - start
    s = out.stats
    return {"tokens": out.tokens, "drafted": s.drafted, "accepted": s.accepted,
            "forwards": s.target_forwards, "generated": s.generated_tokens,
            "tps": s.generated_tokens / max(s.decode_seconds, 1e-9), "seconds": seconds}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=None, help="default: the bundled pair")
    ap.add_argument("--workloads", default="fim,edit,chat")
    ap.add_argument("--modes", default="ngram,draft,draft-tree,lookahead,suffix,auto")
    ap.add_argument("--compare", default="draft,auto",
                    help="modes also run without a seed (the rejection rule)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--temps", default="0.7,1")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("-k", "--num-draft", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    modes = [m for m in args.modes.split(",") if m]
    compare = [m for m in args.compare.split(",") if m]
    for m in modes + compare:
        if m not in MODES:
            ap.error(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    drafting = any(MODES[m][0] in ("draft", "auto") for m in modes + compare)
    engine = mlxspec.load(args.model, mode="draft" if drafting else "none",
                          num_draft=args.num_draft, max_context=args.max_context)
    temps = [float(t) for t in args.temps.split(",")]
    results = []
    for workload in args.workloads.split(","):
        items = build_workload(workload, args.prompts, args.max_tokens, 0, engine.tokenizer)
        for i, item in enumerate(items):
            for temperature in temps:
                seed = args.seed + i
                ref = run(engine, "none", item, temperature, seed)
                # the order rotates per prompt: no mode always runs first (a warm cache)
                jobs = [(m, seed) for m in modes] + [(m, None) for m in compare]
                shift = i % len(jobs)
                row = {"workload": workload, "prompt": i, "temperature": temperature,
                       "none": ref, "keyed": {}, "rejection": {}}
                for name, s in jobs[shift:] + jobs[:shift]:
                    got = run(engine, name, item, temperature, s)
                    if s is None:
                        row["rejection"][name] = got
                    else:
                        got["identical"] = got["tokens"] == ref["tokens"]
                        row["keyed"][name] = got
                results.append(row)
                same = sum(r["identical"] for r in row["keyed"].values())
                print(f"{workload} #{i} T={temperature:g}: {same}/{len(modes)} modes equal "
                      f"none", file=sys.stderr, flush=True)
    report(results, modes, compare, temps, args.workloads.split(","))
    draw_cost(engine.model.args.vocab_size if hasattr(engine.model, "args") else 151936, temps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f)
    return 0


def draw_cost(vocab: int, temps: list[float], positions: int = 5, reps: int = 15) -> None:
    """What drawing `positions` tokens costs at this vocabulary: the keyed draw against the
    rejection rule's probabilities and inverse-CDF draw (medians of `reps`)."""
    import mlx.core as mx

    from mlxspec.sampling import SamplingParams, keyed_draw, probs_from_logits, sample

    logits = mx.random.normal((positions, vocab), key=mx.random.key(0)) * 3
    mx.eval(logits)

    def ms(f) -> float:
        f()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            f()
            times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times)

    for t in temps:
        sp = SamplingParams(temperature=t)
        keyed = ms(lambda sp=sp: mx.eval(keyed_draw(logits, sp, 1, 100)))
        rejection = ms(lambda sp=sp: mx.eval(sample(probs_from_logits(logits, sp), None)))
        print(f"T={t:g}, vocabulary {vocab}: {positions} positions drawn keyed {keyed:.2f} ms, "
              f"by the rejection rule's probabilities {rejection:.2f} ms")


def _rate(r: dict) -> float:
    return r["accepted"] / r["drafted"] if r["drafted"] else 0.0


def report(results, modes, compare, temps, workloads) -> None:
    print("| workload | T | modes equal to `none` |" + "".join(
        f" {m} acceptance keyed / rejection | {m} tokens/forward keyed / rejection | "
        f"{m} tok/s keyed ÷ rejection |" for m in compare))
    print("|---|---|---|" + "---|---|---|" * len(compare))
    for w in workloads:
        for t in temps:
            rows = [r for r in results if r["workload"] == w and r["temperature"] == t]
            if not rows:
                continue
            same = sum(k["identical"] for r in rows for k in r["keyed"].values())
            cells = [w, f"{t:g}", f"{same}/{len(rows) * len(modes)}"]
            for m in compare:
                keyed = [r["keyed"][m] for r in rows if m in r["keyed"]]
                rej = [r["rejection"][m] for r in rows]
                if not keyed:
                    cells += ["-", "-", "-"]
                    continue
                med = statistics.median
                cells.append(f"{med(map(_rate, keyed)):.2f} / {med(map(_rate, rej)):.2f}")
                cells.append(f"{med(k['generated'] / k['forwards'] for k in keyed):.2f} / "
                             f"{med(k['generated'] / k['forwards'] for k in rej):.2f}")
                cells.append(f"{med(a['tps'] / b['tps'] for a, b in zip(keyed, rej)):.2f}x")
            print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
