"""Is `auto` at least 0.97x the best single mode (a change to the policy must keep it so)?
`auto` against every single mode, paired and interleaved, on workloads at chosen
temperatures, as the median of per-prompt ratios to `none` and to the best other mode
(`mlxspec bench` gives the first only, and always runs `free` at temperature 1; this also
runs it greedy).

    python bench/bench_auto.py --modes none,ngram,auto --workloads completion@0,free@0,free@1 \
        --prompts 8 --rounds 3
    python bench/bench_auto.py -m smollm2 --modes none,ngram,ngram:k=8,auto --rounds 2

Without -k the fixed-k modes propose 4 tokens and `auto` adapts k up to 8, as `generate` does.

Every prompt runs every mode (the order rotates per prompt); `--rounds` repeats the whole set,
so that each prompt has several paired ratios; each round starts with every mode's store of
earlier requests empty (it would hold the earlier rounds' answers). The report is the median over prompts and
rounds of (mode tok/s) / (reference tok/s) for the same prompt in the same round, against
`none` and against the best other mode of the workload.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import mlxspec  # noqa: F401  (OpenBLAS before mlx.core)
from mlxspec.bench.run import make_runners
from mlxspec.bench.workloads import build_workload, uses_bundled_formats, workloads_for
from mlxspec.engine import Engine, PromptCache
from mlxspec.errors import MlxspecError
from mlxspec.policy import DEFAULT_NUM_DRAFT
from mlxspec.suffix_store import SuffixIndex


def fresh_stores(engine: Engine, runners: list) -> None:
    """Every mode's store of earlier requests emptied: the prompts recur from round to round,
    and a store kept between rounds would copy the earlier rounds' answers."""
    for runner in runners:
        proposer = engine.proposer_of(runner.mode) if hasattr(runner, "mode") else None
        if hasattr(proposer, "set_store"):
            proposer.set_store(SuffixIndex())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="none,ngram,auto")
    ap.add_argument("-m", "--model", default=None, help="default: the bundled pair")
    ap.add_argument("--workloads", default=None,
                    help="default: the bundled model's completion@0,fim@0,edit@0,doc-qa@0,"
                         "chat@0,free@0,free@1; another model's chat workloads at 0, free@1")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("-k", "--num-draft", type=int, default=None,
                    help=f"default {DEFAULT_NUM_DRAFT}; given, it also caps auto's k")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the raw per-prompt figures here")
    args = ap.parse_args(argv)

    # The model with its draft (the bundled pair, a named model's default draft) where a mode
    # needs one, as `mlxspec bench` loads it.
    needs = {m.partition(":")[0] for m in args.modes.split(",")}
    try:
        engine = mlxspec.load(args.model, num_draft=args.num_draft,
                              mode="draft" if needs & {"draft", "auto", "mlx_lm_spec"} else "none")
    except MlxspecError:
        if "draft" in needs:
            raise
        engine = mlxspec.load(args.model, mode="none", num_draft=args.num_draft)  # none to load
    if not isinstance(engine, Engine):
        raise SystemExit(f"could not load {args.model or 'the bundled pair'}")
    if args.workloads is None:
        bundled = uses_bundled_formats(engine.tokenizer)
        args.workloads = ("completion@0,fim@0,edit@0,doc-qa@0,chat@0,free@0,free@1" if bundled
                          else ",".join(f"{w}@{1 if w == 'free' else 0}"
                                        for w in workloads_for(engine.tokenizer)))
    runners = make_runners(engine, args.modes.split(","), args.num_draft or DEFAULT_NUM_DRAFT)
    labels = [r.label for r in runners]
    report, raw = {}, {}
    start = time.perf_counter()
    for spec in args.workloads.split(","):
        name, _, temp = spec.partition("@")
        temp = float(temp or 0)
        items = build_workload(name, args.prompts, args.max_tokens, args.seed, engine.tokenizer)
        tps = {label: [] for label in labels}  # [round][prompt]
        tokens = {label: 0 for label in labels}
        for rnd in range(args.rounds):
            for label in labels:
                tps[label].append([])
            fresh_stores(engine, runners)
            for i, item in enumerate(items):
                prompt = engine.encode(item.prompt)
                shift = (i + rnd) % len(runners)
                shared = PromptCache()  # the prompt prefilled once for our modes (untimed)
                for runner in runners[shift:] + runners[:shift]:
                    run = runner.run(prompt, item.max_tokens, temp, args.seed + i, item.prediction,
                                     prompt_cache=shared)
                    tps[runner.label][rnd].append(run.tps)
                    tokens[runner.label] += len(run.tokens)
            sys.stderr.write(f"\r{spec} round {rnd + 1}/{args.rounds} "
                             f"({time.perf_counter() - start:.0f}s)   ")
            sys.stderr.flush()

        def ratio(a: str, b: str, tps=tps) -> float:
            pairs = [x / y for ra, rb in zip(tps[a], tps[b]) for x, y in zip(ra, rb) if y > 0]
            return statistics.median(pairs) if pairs else float("nan")

        rows = {}
        for label in labels:
            others = [o for o in labels if o != label]
            best = max(others, key=lambda o: ratio(o, "none") if "none" in labels else 0.0,
                       default=None)
            rows[label] = {
                "tok_s": statistics.median(x for r in tps[label] for x in r),
                "vs_none": ratio(label, "none") if "none" in labels else None,
                "best_other": best,
                "vs_best_other": ratio(label, best) if best else None,
            }
        report[spec] = rows
        raw[spec] = tps
        if args.json:  # after every workload: a long run interrupted keeps what it measured
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "report": report, "raw": raw}, f, indent=1)
    sys.stderr.write("\n")
    print("| workload | T | mode | tok/s (median) | vs none (paired median) | "
          "vs best other mode |")
    print("|---|---|---|---:|---:|---|")
    for spec, rows in report.items():
        name, _, temp = spec.partition("@")
        for label, r in rows.items():
            other = (f"{r['vs_best_other']:.3f}× `{r['best_other']}`"
                     if r["best_other"] else "")
            vs_none = "–" if r["vs_none"] is None else f"{r['vs_none']:.3f}×"  # (none not run)
            print(f"| {name} | {temp or 0} | {label} | {r['tok_s']:.1f} | {vs_none} | {other} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "report": report, "raw": raw}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
