"""How often does `mlxspec edit` carry out "rename X to Y" on held-out functions, and what does
the predicted output save?

    python bench/bench_edit.py --n 20                 # the bundled model, modes none and ngram
    python bench/bench_edit.py --model DIR --n 5 --out /tmp/edit.json

For each of the first N held-out standard-library functions (mlxspec.recipe.heldout_functions,
never trained on) that has a renamable identifier and whose request fits the model's context,
a deterministic rename is chosen (an argument, a local variable or the function's own name, to
the name plus a suffix) and the expected answer is the function with every occurrence of the
NAME token replaced, as the bundled model's edit examples were made. A rename counts as done
when the edited function equals the expected one exactly.

Every function is edited through `mlxspec.editing.edit_text` (the code path of `mlxspec edit`)
in mode `none` and in mode `ngram`; the two must produce the same tokens. Reported: success
rate, target forwards, decode time and accepted prediction tokens per mode. `--verbatim` also
runs the lowercase phrasing "rename X to Y" without the rewrite into the training wording.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import keyword
import random
import sys
import tokenize
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlxspec  # noqa: E402,F401  (OpenBLAS before mlx.core)
from mlxspec.editing import edit_text  # noqa: E402
from mlxspec.errors import MlxspecError  # noqa: E402
from mlxspec.recipe.corpus import function_node  # noqa: E402

SUFFIXES = ("_value", "_tmp", "_new", "_x", "2", "_item", "_obj", "_data")


def pick_rename(src: str, rng: random.Random) -> tuple[str, str] | None:
    """(old, new): an argument or assigned local (or, half the time, the function's name)."""
    node = function_node(src)
    if node is None:
        return None
    names = sorted(
        {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        | {a.arg for a in ast.walk(node) if isinstance(a, ast.arg) and a.arg not in ("self", "cls")})
    if not names:
        names = [node.name]
    old = rng.choice(names)
    if rng.random() < 0.5 and not node.name.startswith("__"):
        old = node.name
    for suffix in rng.sample(SUFFIXES, len(SUFFIXES)):
        new = old + suffix
        if not keyword.iskeyword(new) and new not in src:
            return old, new
    return None


def rename_tokens(src: str, old: str, new: str) -> str:
    """Every NAME token `old` replaced by `new` (strings and comments untouched)."""
    toks = [t for t in tokenize.generate_tokens(io.StringIO(src).readline)
            if t.type == tokenize.NAME and t.string == old]
    lines = src.splitlines(keepends=True)
    for t in sorted(toks, key=lambda t: t.start, reverse=True):
        (r, c0), (_, c1) = t.start, t.end
        lines[r - 1] = lines[r - 1][:c0] + new + lines[r - 1][c1:]
    return "".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: the bundled model)")
    ap.add_argument("--n", type=int, default=20, help="functions to edit")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-draft", type=int, default=8)
    ap.add_argument("--modes", default="none,ngram")
    ap.add_argument("--verbatim", action="store_true",
                    help="also run the plain phrasing without the rewrite (mode ngram)")
    ap.add_argument("--out", default=None, help="write the per-function results as JSON here")
    args = ap.parse_args(argv)

    from mlxspec.loading import load
    from mlxspec.recipe import heldout_functions

    engine = load(args.model, mode="none", num_draft=args.num_draft)
    modes = args.modes.split(",")
    print(f"model {engine.name}, context {engine.max_context}, k={args.num_draft}, "
          f"modes {modes}", file=sys.stderr)
    rows, skipped = [], []
    for i, (mod, name, src) in enumerate(heldout_functions()):
        if len(rows) >= args.n:
            break
        pick = pick_rename(src, random.Random(args.seed * 1000 + i))
        if pick is None:
            skipped.append((name, "no renamable name"))
            continue
        old, new = pick
        expected = rename_tokens(src, old, new)
        row = {"module": mod, "function": name, "old": old, "new": new,
               "lines": src.count("\n")}
        try:
            for mode in modes:
                r = edit_text(engine, src, f"Rename `{old}` to `{new}`.", mode=mode, language="python",
                              seed=args.seed)
                s = r.stats
                row[mode] = {
                    "ok": r.edited.rstrip("\n") == expected.rstrip("\n"),
                    "finish_reason": r.finish_reason, "tokens": r.tokens,
                    "generated": s.generated_tokens, "forwards": s.target_forwards,
                    "decode_s": s.decode_seconds, "prefill_s": s.prefill_seconds,
                    "accepted_prediction": s.accepted_by_source.get("prediction", 0),
                    "drafted": s.drafted, "accepted": s.accepted,
                    "old_left": r.edited.count(old) - expected.count(old),
                }
            if args.verbatim:
                r = edit_text(engine, src, f"rename {old} to {new}", mode=modes[-1], language="python",
                              seed=args.seed, canonical=False)
                row["verbatim_ok"] = r.edited.rstrip("\n") == expected.rstrip("\n")
        except MlxspecError as e:  # too large for the context
            skipped.append((name, str(e).split(";")[0]))
            continue
        rows.append(row)
        flags = " ".join(f"{m}={'ok' if row[m]['ok'] else 'no'}:{row[m]['forwards']}fw"
                         f"/{row[m]['decode_s']:.1f}s" for m in modes)
        print(f"{len(rows):2d} {name:40s} {old}->{new:24s} {flags}", file=sys.stderr)

    summary = {"model": engine.name, "functions": len(rows), "skipped": len(skipped),
               "num_draft": args.num_draft}
    for mode in modes:
        rs = [r[mode] for r in rows]
        gen = sum(r["generated"] for r in rs)
        dec = sum(r["decode_s"] for r in rs)
        summary[mode] = {
            "renamed_correctly": sum(r["ok"] for r in rs),
            "complete_answers": sum(r["finish_reason"] == "stop" for r in rs),
            "generated_tokens": gen, "target_forwards": sum(r["forwards"] for r in rs),
            "decode_seconds": round(dec, 2), "tokens_per_second": round(gen / dec, 1) if dec else 0,
            "accepted_prediction_tokens": sum(r["accepted_prediction"] for r in rs),
        }
    if len(modes) > 1:
        a, b = modes[0], modes[-1]
        summary["token_identical"] = sum(r[a]["tokens"] == r[b]["tokens"] for r in rows)
        fa, fb = summary[a]["target_forwards"], summary[b]["target_forwards"]
        summary["forward_ratio"] = round(fa / fb, 2) if fb else None
        da, db = summary[a]["decode_seconds"], summary[b]["decode_seconds"]
        summary["decode_speedup"] = round(da / db, 2) if db else None
    if args.verbatim:
        summary["verbatim_renamed_correctly"] = sum(r.get("verbatim_ok", False) for r in rows)
    print(json.dumps(summary, indent=2))
    if args.out:
        for r in rows:
            for m in modes:
                r[m].pop("tokens")
        Path(args.out).write_text(json.dumps({"summary": summary, "rows": rows,
                                              "skipped": skipped}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
