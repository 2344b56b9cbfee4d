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
    ap.add_argument("--workloads", default="free,json_schema,tool")
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
    for name in args.workloads.split(","):
        prompt, grammar = requests[name]
        reference = None
        for mode in modes:
            r = run(engine, mode, prompt, args.max_tokens, **grammar)
            s = r["stats"]
            reference = r["tokens"] if reference is None else reference
            same &= r["tokens"] == reference
            print(f"| {name} | `{mode}` | {s.target_forwards} | {s.drafted} | {s.accepted} | "
                  f"{s.generated_tokens / max(1, s.target_forwards):.2f} | {r['seconds']:.1f} | "
                  f"{r['mask_ms_token']:.3f} | {'yes' if r['tokens'] == reference else 'NO'} |",
                  flush=True)
        print(f"{name} answer:", json.dumps(r["text"][:200]), file=sys.stderr)
    import mlx.core as mx

    vocab = engine.model(mx.array([[0]]))[0].shape[-1]
    alone = mask_alone(engine, vocab)
    print("mask alone (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in alone.items()))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
