"""Constrained output under speculation: what each mode gains on answers held to a grammar,
and the grammar mask's cost.

    python bench/bench_constrained.py [-m qwen2.5-coder-0.5b] [--max-tokens 120]

One engine, as a server holds it; three chat requests about the same source file (the first
80 lines of a function-defining part of click's `termui.py`): `free` (list its functions),
`json_schema` (the same as JSON matching a schema) and `tool` (a forced call of a function
taking that list: the server's `tool_choice` grammar, `server.tools.call_grammar`). Each in
every mode, `none` first (a mode's suffix store holds only its own earlier answers): target
forwards, tokens drafted and accepted, tokens per forward, wall seconds, llguidance's time per
committed token, and whether the tokens equal `none`'s. Then the mask alone: llguidance's mask
for 1 and 5 positions on the model's vocabulary, and the step's bias + mask on the logits.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time

import click.termui

import mlxspec  # noqa: F401  (loads OpenBLAS before mlx.core)
from mlxspec import constrain
from mlxspec.batch_step import follow
from mlxspec.chat_session import render_chat
from mlxspec.engine import Engine
from mlxspec.server.tools import call_grammar, tool_syntax

FUNCTIONS = {"type": "array", "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "signature": {"type": "string"}},
    "required": ["name", "signature"], "additionalProperties": False}}
SCHEMA = {"type": "object", "properties": {"functions": FUNCTIONS},
          "required": ["functions"], "additionalProperties": False}
TOOL = {"type": "function", "function": {
    "name": "record_functions", "description": "Record the functions a file defines.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"},
                                                    "functions": FUNCTIONS},
                   "required": ["path", "functions"], "additionalProperties": False}}}


def _array_of(**fields) -> dict:
    return {"type": "array", "items": {"type": "object", "properties": fields,
                                       "required": list(fields), "additionalProperties": False}}


def _object(**fields) -> dict:
    return {"type": "object", "properties": fields, "required": list(fields),
            "additionalProperties": False}


STRING, INTEGER = {"type": "string"}, {"type": "integer"}
STRINGS = {"type": "array", "items": STRING}
# `--workloads schemas`: eight JSON-Schema asks, each on 60 lines of a third-party module this
# project installs (click, starlette, uvicorn, h11): (module, ask, schema)
SCHEMAS = (
    ("click.termui", "List the functions defined in this file, with their signatures",
     _object(functions=FUNCTIONS)),
    ("click.utils", "List the imports of this file",
     _object(imports=_array_of(module=STRING, names=STRINGS))),
    ("starlette.routing", "List the classes of this file with their bases and methods",
     _object(classes=_array_of(name=STRING, bases=STRINGS, methods=STRINGS))),
    ("starlette.requests", "Summarize this file",
     _object(purpose=STRING, public_api=STRINGS, dependencies=STRINGS)),
    ("uvicorn.config", "List the module-level constants of this file with their values",
     _object(constants=_array_of(name=STRING, value=STRING))),
    ("h11._connection", "List each function's name and the first line of its docstring",
     _object(functions=_array_of(name=STRING, doc=STRING))),
    ("click.core", "Review this code: list possible issues",
     _object(issues=_array_of(line=INTEGER, severity={"enum": ["low", "medium", "high"]},
                              message=STRING))),
    ("starlette.responses", "List the parameters of each function or method",
     _object(functions=_array_of(name=STRING, parameters=_array_of(name=STRING,
                                                                   default=STRING)))),
)


def module_window(name: str, lines: int = 60) -> str:
    """`lines` lines of module `name` from its first function or class."""
    import importlib

    text = inspect.getsource(importlib.import_module(name)).splitlines()
    first = next(i for i, line in enumerate(text) if line.startswith(("def ", "class ")))
    return "\n".join(text[max(0, first - 5) : first + lines - 5])


def source() -> str:
    """80 lines of a third-party file that define functions (click's prompt helpers)."""
    lines = inspect.getsource(click.termui).splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("def "))
    return "\n".join(lines[first - 5 : first + 75])


def workloads(engine: Engine) -> dict[str, tuple[str, dict]]:
    """name -> (prompt, grammar options) of the three requests."""
    code = "```python\n" + source() + "\n```"
    ask = "List the functions defined in this file, with their signatures"
    tok = engine.tokenizer
    out = {"free": (render_chat(tok, [{"role": "user", "content": f"{ask}.\n\n{code}"}]), {}),
           "json_schema": (render_chat(tok, [{"role": "user", "content":
                                               f"{ask}, as JSON.\n\n{code}"}]),
                           {"json_schema": SCHEMA})}
    syntax = tool_syntax(tok)
    if syntax is not None:
        grammar = ("lark", call_grammar(syntax, [TOOL], "record_functions", parallel=False))
        prompt = render_chat(tok, [{"role": "user", "content":
                                    f"Record the functions of click/termui.py.\n\n{code}"}],
                             tools=[TOOL])
        out["tool"] = (prompt, {"grammar": grammar})
    for i, (module, ask, schema) in enumerate(SCHEMAS):
        code = "```python\n" + module_window(module) + "\n```"
        out[f"schema{i + 1}"] = (render_chat(tok, [{"role": "user", "content":
                                                     f"{ask}, as JSON.\n\n{code}"}]),
                                 {"json_schema": schema})
    return out


def run(engine: Engine, mode: str, prompt: str, max_tokens: int, **kw) -> dict:
    """One request on `engine` in `mode`: its tokens, stats and wall seconds."""
    start = time.perf_counter()
    batch, row = engine.open(prompt, mode=mode, max_tokens=max_tokens, temperature=0.0, **kw)
    state = row.sampling.state
    outs = [o for o in follow(batch, row) if o is not None]
    c = state.constraint if state is not None else None
    stats = outs[-1].stats
    return {"tokens": [t for o in outs for t in o.tokens], "text": "".join(o.text for o in outs),
            "stats": stats, "seconds": time.perf_counter() - start,
            "mask_ms_token": 1000 * c.mask_seconds / max(1, stats.generated_tokens) if c else 0.0}


def mask_alone(engine: Engine, vocab: int, repeats: int = 200) -> dict:
    import mlx.core as mx

    c = constrain.Constraint(engine.tokenizer, "json_schema", SCHEMA, 0)
    prefix = engine.tokenizer.encode('{"functions": [{"name": "_build', add_special_tokens=False)
    for t in prefix:
        c.matcher.consume_token(t)
    draft = engine.tokenizer.encode('_prompt", "signature": "', add_special_tokens=False)[:4]
    out = {}
    for k in (0, len(draft)):
        start = time.perf_counter()
        for _ in range(repeats):
            bits = c.bitmasks(draft[:k])
        out[f"llguidance_{k + 1}_ms"] = 1000 * (time.perf_counter() - start) / repeats
    logits = mx.random.normal((len(draft) + 1, vocab))
    mx.eval(logits)
    bias = constrain.bias_vector(((13, -2.0),), vocab)
    start = time.perf_counter()
    for _ in range(repeats):
        mask = constrain.allowed(bits, vocab)
        mx.eval(mx.where(mask, logits + bias, -mx.inf))
    out[f"apply_{len(draft) + 1}_ms"] = 1000 * (time.perf_counter() - start) / repeats
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--modes", default="none,ngram,draft,auto",
                    help="`draft` is skipped where the model has no draft")
    ap.add_argument("--workloads", default="free,json_schema,tool",
                    help="requests, or `schemas`: eight JSON-Schema asks (schema1..schema8)")
    ap.add_argument("--max-tokens", type=int, default=120)
    args = ap.parse_args(argv)
    engine = mlxspec.load(args.model)
    drafts = engine.draft_model is not None or engine.draft_source is not None
    modes = [m for m in args.modes.split(",") if m != "draft" or drafts]
    requests = workloads(engine)
    engine.generate(requests["free"][0], max_tokens=4, mode="none")  # warm up
    print(f"model {args.model}, {args.max_tokens} tokens at most, T = 0, one engine")
    print("| request | mode | target forwards | drafted | accepted | tokens/forward | wall s "
          "| llguidance ms/token | = `none` |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    same = True
    names = [n for w in args.workloads.split(",")
             for n in ([f"schema{i + 1}" for i in range(len(SCHEMAS))] if w == "schemas" else [w])]
    forwards: dict[str, dict[str, int]] = {}
    for name in names:
        prompt, grammar = requests[name]
        reference = None
        for mode in modes:
            r = run(engine, mode, prompt, args.max_tokens, **grammar)
            s = r["stats"]
            reference = r["tokens"] if reference is None else reference
            same &= r["tokens"] == reference
            forwards.setdefault(name, {})[mode] = s.target_forwards
            print(f"| {name} | `{mode}` | {s.target_forwards} | {s.drafted} | {s.accepted} | "
                  f"{s.generated_tokens / max(1, s.target_forwards):.2f} | {r['seconds']:.1f} | "
                  f"{r['mask_ms_token']:.3f} | {'yes' if r['tokens'] == reference else 'NO'} |",
                  flush=True)
        print(f"{name} answer:", json.dumps(r["text"][:200]), file=sys.stderr)
    singles = [m for m in modes if m not in ("none", "auto")]
    if "auto" in modes and singles:
        # auto against the best single mode of each request, by target forwards
        ratios = [f["auto"] / min(f[m] for m in singles) for f in forwards.values()]
        total = sum(f["auto"] for f in forwards.values()) / sum(
            min(f[m] for m in singles) for f in forwards.values())
        print(f"auto's forwards over the best single mode's: total {total:.3f}, per request "
              f"median {sorted(ratios)[len(ratios) // 2]:.3f}, max {max(ratios):.3f}")
    import mlx.core as mx

    vocab = engine.model(mx.array([[0]]))[0].shape[-1]
    alone = mask_alone(engine, vocab)
    print("mask alone (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in alone.items()))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
