"""Repeated-request workloads: `auto` with and without the suffix source (earlier requests and
answers, `mlxspec/proposers/suffix.py`) against `none`, in one process, interleaved.

    python bench/bench_replay.py                        # the bundled model
    python bench/bench_replay.py -m smollm2 --requests 4 --max-tokens 64

Every workload is a sequence of requests built from real source text (the held-out standard
library modules) and the model's own answers, never hand-written answers:

- editor: one file completed at successive cursor positions as it grows: after each
  completion the user takes its first line (two times in three) or types the file's next real
  line, and asks again at the new end;
- agent: the same system prompt with a tool schema and instructions, a new task each time (a
  different function of a different module), the model's own tool call and a tool result (the
  function's real source) fed back as the next request, the last exchange kept;
- chat: a task, then turns asking for the previous answer changed ("rename the function",
  "add a docstring", ...), the whole conversation re-sent each turn;
- retry: an editor re-requesting a completion it already asked for (the same place in the
  file after an edit elsewhere: a comment added at the top), as editors do when the cursor
  comes back or a request was dropped; every other request is such a repeat, whose answer is
  in the store and not in its prompt (what prompt lookup cannot see);
- unrelated (the control): single questions that share nothing.

Each request runs in every configuration (the order rotating per request) on its own engine
(own prompt cache, own policy, own suffix store, fresh per workload), greedy. The report is
the median over a workload's requests of each configuration's decode tokens/s and of its
paired ratio to `none` and to `auto` without suffix on the same request, and the whole
workload's tokens over its decode seconds; every answer is checked token-identical to `none`'s.

It also says how much any source could take from each kind of text: the share of answer tokens
whose next token the request's own text predicts (what followed the longest match, of at
least 4 tokens, of the context's end in it: prompt lookup's long arms), the earlier requests'
text predicts (the same lookup in the store), and the earlier
requests predict while the prompt does not: the ceiling of what the store adds over prompt
lookup. `--max-k 16,32` also runs both `auto` configurations with those caps on k.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time

import mlxspec  # noqa: F401  (OpenBLAS before mlx.core)
from mlxspec.bench.workloads import CHAT_QUESTION, FREE_QUESTIONS, source_windows
from mlxspec.chat_session import add_turn_end_tokens
from mlxspec.engine import Engine, PromptCache
from mlxspec.proposers.suffix import SuffixProposer
from mlxspec.recipe.heldout import heldout_functions
from mlxspec.sampling import SamplingParams
from mlxspec.suffix_store import SuffixIndex

CONFIGS = (("none", "none", {}), ("auto", "auto", {"suffix": False}), ("auto+suffix", "auto", {}))
WORKLOADS = ("editor", "agent", "chat", "retry", "unrelated")

TOOL = {
    "name": "read_function",
    "description": "Return the source code of a function of the Python standard library.",
    "parameters": {"type": "object", "properties": {
        "module": {"type": "string", "description": "the module, e.g. json.decoder"},
        "function": {"type": "string", "description": "the function's name"}},
        "required": ["module", "function"]},
}
AGENT_SYSTEM = (
    "You are a coding agent working on a Python project. You can call this tool:\n"
    + json.dumps(TOOL, indent=2)
    + "\nTo call it, answer with one JSON object only, like "
    '{"tool": "read_function", "arguments": {"module": "...", "function": "..."}}. '
    "After the tool result, answer the user's question in one or two sentences.")
CHAT_TASKS = (
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python function that counts the words in a text file.",
)
CHAT_CHANGES = (
    "Change your previous answer: rename the function to `compute`. Return the whole code.",
    "Change it again: add a docstring to the function. Return the whole code.",
    "Now add type hints to it. Return the whole code.",
    "Now rename its argument to `value`. Return the whole code.",
    "Now add a comment above the return statement. Return the whole code.",
)


def render(tokenizer, messages: list[dict]) -> str:
    from mlxspec.chat_session import render_chat

    return render_chat(tokenizer, messages)


# ----------------------------------------------------------------------------- workloads
# Each is a generator: it yields a prompt (text), receives the model's answer (text).


def editor(tokenizer, n: int, seed: int):
    docs = [w for per_file in source_windows() for w in per_file]
    lines = docs[(7 * seed + 3) % len(docs)].splitlines(keepends=True)
    text, nxt = "".join(lines[:8]), 8
    for i in range(n):
        answer = yield text
        # The suggestion's first line (with any blank lines before it), as an editor shows
        # it: special tokens' text (a bundled model's <|fim_middle|>) left out.
        shown = re.sub(r"<\|[^|]*\|>", "", answer)
        first = re.match(r"(\s*\n)*[^\n]*", shown).group(0) if shown.strip() else ""
        if i % 3 == 2 or not first.strip() or nxt >= len(lines):
            if nxt < len(lines):
                text += lines[nxt]
                nxt += 1
        else:
            text += first + "\n"
            nxt += 1  # the line the suggestion stands for


def agent(tokenizer, n: int, seed: int):
    functions = heldout_functions(n + seed + 2, max_lines=30)[seed:]
    kept: list[dict] = []
    system = {"role": "system", "content": AGENT_SYSTEM}
    i = 0
    while True:
        mod, name, src = functions[i % len(functions)]
        i += 1
        task = {"role": "user", "content": f"What arguments does `{name}` in the `{mod}` module "
                                           "take, and what does it return?"}
        call = yield render(tokenizer, [system] + kept + [task])
        result = {"role": "user", "content": "Tool result:\n```python\n" + src[:800] + "\n```"}
        done = [task, {"role": "assistant", "content": call}, result]
        reply = yield render(tokenizer, [system] + kept + done)
        kept = done + [{"role": "assistant", "content": reply}]  # the last exchange fed back


def chat(tokenizer, n: int, seed: int):
    messages = [{"role": "user", "content": CHAT_TASKS[seed % len(CHAT_TASKS)]}]
    for i in range(n):
        answer = yield render(tokenizer, messages)
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": CHAT_CHANGES[i % len(CHAT_CHANGES)]}]


def retry(tokenizer, n: int, seed: int):
    docs = [w for per_file in source_windows() for w in per_file]
    for i in range(n):
        text = docs[(5 * (i // 2) + seed) % len(docs)]
        yield text if i % 2 == 0 else "# (edited)\n" + text


def unrelated(tokenizer, n: int, seed: int):
    docs = [w for per_file in source_windows() for w in per_file]
    for i in range(n):
        if i % 2 == 0:
            q = FREE_QUESTIONS[(i // 2 + seed) % len(FREE_QUESTIONS)]
        else:
            q = "```python\n" + docs[(11 * i + seed) % len(docs)] + "```\n\n" + CHAT_QUESTION
        yield render(tokenizer, [{"role": "user", "content": q}])


# ----------------------------------------------------------------------------- the run


def predictable(proposer: SuffixProposer, prompt: list[int], answer: list[int]) -> set[int]:
    """The answer positions whose token `proposer` would propose first (its best chain's first
    token), given the prompt and the answer before it: what a source could give at most."""
    proposer.reset(prompt, SamplingParams())
    hits = set()
    for j, token in enumerate(answer):
        chain = proposer.peek(prompt + answer[:j], 1, "")
        if chain and chain[0] == token:
            hits.add(j)
    return hits


def coverage(store: SuffixIndex, prompt: list[int], answer: list[int]) -> dict:
    """How many answer tokens the earlier requests' text (`store`: their prompts and answers)
    and the request's own text (prompt lookup's view) predict, and the store alone: the
    ceiling of what the suffix source adds over prompt lookup."""
    by_store = predictable(SuffixProposer(store=store, local=False), prompt, answer)
    by_prompt = predictable(SuffixProposer(store=None, local=True), prompt, answer)
    store.add(prompt + answer)
    return {"store": len(by_store), "prompt": len(by_prompt),
            "store_only": len(by_store - by_prompt)}


def run_workload(base: Engine, name: str, n: int, max_tokens: int, seed: int,
                 configs=CONFIGS) -> dict:
    engines = {}
    for label, mode, options in configs:  # fresh engines: own prompt cache, policy, store
        e = base.clone()
        e.set_mode(mode, **options)
        engines[label] = e
    caches = {label: PromptCache() for label in engines}
    seen = SuffixIndex()  # the earlier requests' text, as the suffix store holds it
    gen = globals()[name](base.tokenizer, n, seed)
    prompt = next(gen)
    rows = []
    for i in range(n):
        tokens = base.encode(prompt)
        order = list(engines)[i % len(engines):] + list(engines)[: i % len(engines)]
        runs = {}
        for label in order:
            r = engines[label].generate(tokens, max_tokens=max_tokens, temperature=0.0,
                                        prompt_cache=caches[label])
            s = r.stats
            runs[label] = {"tokens": r.tokens, "text": r.text,
                           "tps": len(r.tokens) / s.decode_seconds if s.decode_seconds else 0.0,
                           "forwards": s.target_forwards,
                           "suffix_accepted": s.accepted_by_source.get("suffix", 0),
                           "accepted": s.accepted}
        ref = runs["none"]
        mismatch = [label for label, run in runs.items() if run["tokens"] != ref["tokens"]]
        rows.append({"prompt_tokens": len(tokens), **{
            label: {k: v for k, v in run.items() if k not in ("tokens", "text")}
            for label, run in runs.items()}, "mismatch": mismatch,
            "generated": len(ref["tokens"]),
            "predicted": coverage(seen, list(tokens), list(ref["tokens"]))})
        print(f"  {name} {i + 1}/{n}: prompt {len(tokens)} tokens, answer {len(ref['tokens'])}; "
              + ", ".join(f"{label} {runs[label]['tps']:.1f} tok/s" for label in engines)
              + (f"; NOT IDENTICAL: {mismatch}" if mismatch else ""), file=sys.stderr)
        if i + 1 < n:
            prompt = gen.send(ref["text"])
    return summarize(rows, configs)


def summarize(all_rows: list[dict], configs=CONFIGS) -> dict:
    out = {"requests": len(all_rows), "identical": all(not r["mismatch"] for r in all_rows),
           "rows": all_rows}
    rows = [r for r in all_rows if r["generated"] and all(r[c]["tps"] for c, _, _ in configs)]
    out["timed"] = len(rows)  # answers of no token (an immediate end) time nothing
    if not rows:
        return out
    for label, _, _ in configs:
        tps = [r[label]["tps"] for r in rows]
        gen = sum(r["generated"] for r in rows)
        fw = sum(r[label]["forwards"] for r in rows)
        seconds = sum(r["generated"] / r[label]["tps"] for r in rows)
        out[label] = {
            "tps_total": gen / seconds,  # the workload's tokens over its decode time
            "tps_median": statistics.median(tps),
            "vs_none": statistics.median(r[label]["tps"] / r["none"]["tps"] for r in rows),
            "vs_auto": statistics.median(r[label]["tps"] / r["auto"]["tps"] for r in rows),
            "tokens_per_forward": gen / fw if fw else 0.0,
            "suffix_share": sum(r[label]["suffix_accepted"] for r in rows) / gen if gen else 0.0,
        }
    gen = sum(r["generated"] for r in rows)
    out["predicted"] = {k: sum(r["predicted"][k] for r in rows) / gen
                        for k in ("store", "prompt", "store_only")}
    return out


def markdown(report: dict) -> str:
    lines = ["| workload | requests | `none` tok/s | `auto` | `auto` + suffix | + suffix vs `auto` "
             "| tokens / forward (auto, + suffix) | output from the store |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, w in report.items():
        if not w.get("timed"):
            lines.append(f"| {name} | {w['requests']} | (no answer had a token) |||||")
            continue
        a, s = w["auto"], w["auto+suffix"]
        lines.append(f"| {name} | {w['timed']} | {w['none']['tps_median']:.1f} | "
                     f"{a['vs_none']:.2f}x | {s['vs_none']:.2f}x | {s['vs_auto']:.2f}x | "
                     f"{a['tokens_per_forward']:.2f}, {s['tokens_per_forward']:.2f} | "
                     f"{100 * s['suffix_share']:.0f} % |")
    extra = [(n, c) for n, w in report.items() if w.get("timed") for c in w
             if "@" in c and isinstance(w[c], dict)]
    if extra:
        lines += ["", "| workload | configuration | vs `none` | vs `auto` | tokens / forward |",
                  "|---|---|---:|---:|---:|"]
        lines += [f"| {n} | {c} | {report[n][c]['vs_none']:.2f}x | {report[n][c]['vs_auto']:.2f}x "
                  f"| {report[n][c]['tokens_per_forward']:.2f} |" for n, c in extra]
    totals = [f"{n}: " + ", ".join(f"{c} {w[c]['tps_total']:.1f}" for c in w
                                   if isinstance(w.get(c), dict) and "tps_total" in w[c])
              for n, w in report.items() if w.get("timed")]
    lines += ["", "| workload | answer tokens predictable from: the prompt | earlier requests "
              "| earlier requests only |", "|---|---:|---:|---:|"]
    lines += [f"| {n} | " + " | ".join(f"{100 * w['predicted'][k]:.0f} %"
                                       for k in ("prompt", "store", "store_only")) + " |"
              for n, w in report.items() if w.get("timed")]
    lines += ["", "whole-workload tok/s (tokens over decode seconds): " + "; ".join(totals)]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None, help="model (default: the bundled one)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--requests", type=int, default=6, help="requests per workload")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-k", default="", help="also run auto and auto + suffix with these caps "
                    "on k (comma-separated; labelled auto@K, auto+suffix@K)")
    ap.add_argument("--json", default=None, help="write the per-request figures here")
    args = ap.parse_args(argv)

    base = mlxspec.load(args.model, mode="none")
    add_turn_end_tokens(base.tokenizer)  # chat answers end at the end of their turn
    configs = list(CONFIGS)
    for cap in filter(None, args.max_k.split(",")):
        configs += [(f"{label}@{cap}", mode, {**options, "num_draft": int(cap)})
                    for label, mode, options in CONFIGS if mode == "auto"]
    report = {}
    start = time.perf_counter()
    for name in args.workloads.split(","):
        if name not in WORKLOADS:
            raise SystemExit(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
        report[name] = run_workload(base, name, args.requests, args.max_tokens, args.seed, configs)
    print(f"# {base.name}, {args.requests} requests per workload, max {args.max_tokens} tokens, "
          f"T=0, {time.perf_counter() - start:.0f} s")
    print(markdown(report))
    same = all(w["identical"] for w in report.values())
    print("every answer token-identical to none" if same else "SOME ANSWERS DIFFER FROM none")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
