"""Constrained output under speculation: the grammar mask's cost per token, and what
speculation still gains on a JSON answer that repeats its prompt's keys and values.

    python bench/bench_constrained.py [-m qwen2.5-coder-0.5b] [--max-tokens 160]

For each mode, the same chat request twice: free, and constrained to a JSON Schema
(`json_schema=`); tokens per second of decoding, tokens per target forward, and for the
constrained one the time llguidance spent computing masks (per committed token and per masked
position) and whether its tokens equal `none`'s constrained tokens. Then the mask alone:
llguidance's mask for 1 and 5 positions on the model's vocabulary, and the step's bias + mask
on the logits (unpacked bits, one `where`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import mlxspec  # noqa: F401  (loads OpenBLAS before mlx.core)
from mlxspec import constrain
from mlxspec.batch_step import follow
from mlxspec.chat_session import render_chat
from mlxspec.engine import Engine

RECORDS = [
    {"name": "Ada Lovelace", "email": "ada@example.org", "role": "admin", "team": "engines"},
    {"name": "Alan Turing", "email": "alan@example.org", "role": "editor", "team": "codes"},
    {"name": "Grace Hopper", "email": "grace@example.org", "role": "viewer", "team": "compilers"},
    {"name": "Edsger Dijkstra", "email": "edsger@example.org", "role": "editor",
     "team": "paths"},
    {"name": "Barbara Liskov", "email": "barbara@example.org", "role": "admin",
     "team": "types"},
]
SCHEMA = {"type": "object", "properties": {"users": {"type": "array", "items": {
    "type": "object", "properties": {
        "name": {"type": "string"}, "email": {"type": "string"},
        "role": {"enum": ["admin", "editor", "viewer"]}, "active": {"type": "boolean"}},
    "required": ["name", "email", "role", "active"], "additionalProperties": False},
    "minItems": len(RECORDS), "maxItems": len(RECORDS)}},
    "required": ["users"], "additionalProperties": False}


def request(engine: Engine) -> str:
    lines = "\n".join(json.dumps(r) for r in RECORDS)
    return render_chat(engine.tokenizer, [{"role": "user", "content": (
        "Here are our users, one JSON object a line:\n" + lines + "\n\n"
        "Return them as one JSON object {\"users\": [...]}: every user, in this order, with "
        "their name, email and role, \"active\": true, and without the team.")}])


def run(loaded, mode: str, num_draft: int, prompt: str, max_tokens: int, **kw) -> dict:
    """One request on a fresh engine (no store of earlier answers to propose from)."""
    engine = Engine(loaded.model, loaded.tokenizer, mode=mode, num_draft=num_draft)
    start = time.perf_counter()
    batch, row = engine.open(prompt, max_tokens=max_tokens, **kw)
    state = row.sampling.state
    outs = [o for o in follow(batch, row) if o is not None]
    seconds = time.perf_counter() - start
    stats = outs[-1].stats
    c = state.constraint if state is not None else None
    n = stats.generated_tokens
    return {"tokens": [t for o in outs for t in o.tokens], "text": "".join(o.text for o in outs),
            "tok_s": n / stats.decode_seconds if stats.decode_seconds else 0.0,
            "per_forward": n / max(1, stats.target_forwards), "n": n, "seconds": seconds,
            "mask_ms_token": 1000 * c.mask_seconds / max(1, n) if c else None,
            "mask_ms_position": 1000 * c.mask_seconds / max(1, c.masks) if c else None}


def mask_alone(engine: Engine, vocab: int, repeats: int = 200) -> dict:
    import mlx.core as mx

    c = constrain.Constraint(engine.tokenizer, "json_schema", SCHEMA, 0)
    prefix = engine.tokenizer.encode('{"users": [{"name": "Ada', add_special_tokens=False)
    for t in prefix:
        c.matcher.consume_token(t)
    draft = engine.tokenizer.encode(' Lovelace", "email": "', add_special_tokens=False)[:4]
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
    ap.add_argument("--modes", default="none,ngram,suffix,auto")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--num-draft", type=int, default=6)
    args = ap.parse_args(argv)
    loaded = mlxspec.load(args.model, mode="none", no_draft=True)
    engine = Engine(loaded.model, loaded.tokenizer, mode="none", num_draft=args.num_draft)
    prompt = request(engine)
    engine.generate(prompt, max_tokens=4)  # warm up
    rows, reference = [], None
    for mode in args.modes.split(","):
        free = run(loaded, mode, args.num_draft, prompt, args.max_tokens)
        held = run(loaded, mode, args.num_draft, prompt, args.max_tokens, json_schema=SCHEMA)
        if mode == "none":
            reference = held["tokens"]
        same = reference is not None and held["tokens"] == reference
        try:
            json.loads(held["text"])
            valid = True
        except ValueError:
            valid = False
        rows.append((mode, free, held, same, valid))
    import mlx.core as mx

    vocab = loaded.model(mx.array([[0]]))[0].shape[-1]
    alone = mask_alone(engine, vocab)
    print(f"model {args.model}, {args.max_tokens} tokens at most, T = 0, num_draft "
          f"{args.num_draft}")
    print("| mode | free tok/s | free tokens/forward | JSON tok/s | JSON tokens/forward "
          "| mask ms/token | mask ms/position | JSON = none's | parses |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---|")
    for mode, free, held, same, valid in rows:
        print(f"| `{mode}` | {free['tok_s']:.1f} | {free['per_forward']:.2f} | "
              f"{held['tok_s']:.1f} | {held['per_forward']:.2f} | {held['mask_ms_token']:.3f} | "
              f"{held['mask_ms_position']:.3f} | {'yes' if same else 'NO'} | "
              f"{'yes' if valid else 'no'} ({held['n']} tokens) |")
    print("mask alone (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in alone.items()))
    print("free answer:", json.dumps(rows[0][1]["text"][:300]))
    print("JSON answer:", json.dumps(rows[0][2]["text"][:300]))
    return 0 if all(same for _, _, _, same, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
