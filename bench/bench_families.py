"""Speculation on sliding-window and hybrid recurrent families: exact or refused, tokens per
target forward, speed against `none`, and what rollback costs.

    python bench/bench_families.py                      # the table in docs/PERFORMANCE.md
    python bench/bench_families.py --families qwen3_5 --tokens 64

Random-weight models of each family (tests/families.py, scaled up to d=256, 4-6 layers) in
float32 on this machine. Random models do not copy their prompt, so the n-gram rows use a
*predicted output* (as `mlxspec edit` and OpenAI's `prediction` do): the model's own greedy
answer with every 8th token changed — an edit-like, copy-heavy workload. The draft is the target
plus noise (same size): its rows show acceptance and rollback, not a speed a real (smaller)
draft would give. Modes run interleaved per prompt; speed is the ratio of median times.

Rollback on recurrent layers restores the states kept before the verify forward and re-feeds
the accepted tokens: its cost is one extra forward over (accepted + 1) tokens on a step that
rejected something, measured here directly; its memory is one copy of the recurrent states.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import mlxspec  # noqa: E402  (OpenBLAS before mlx.core)

assert mlxspec

import mlx.core as mx  # noqa: E402
from conftest import ByteTokenizer  # noqa: E402
from families import CONFIGS, RECURRENT, build, noisy_copy  # noqa: E402

from mlxspec import caches  # noqa: E402
from mlxspec.engine import Engine  # noqa: E402
from mlxspec.errors import MlxspecError  # noqa: E402

SIZE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
            vocab_size=512)


def sized(family: str, seed: int, dtype=mx.float32):
    cfg = CONFIGS[family]
    keys = cfg["text_config"] if "text_config" in cfg else cfg
    overrides = {k: v for k, v in SIZE.items() if k in keys}
    if "num_hidden_layers" in keys:
        overrides["num_hidden_layers"] = max(keys["num_hidden_layers"], 4)
    if "head_dim" in keys:
        overrides["head_dim"] = 32
    if "block_dim" in keys:  # lfm2 names its widths differently
        overrides.update(block_dim=256, block_ff_dim=512)
    return build(family, seed=seed, dtype=dtype, **overrides), overrides


def prompts(n: int, vocab: int, length: int = 48) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(n)]


def refeed_cost(model, context: int, accepted: int, rounds: int = 9) -> float:
    """Median seconds of the re-feed forward (accepted + 1 tokens) on a cache of `context`."""
    cache = caches.make_cache(model)
    model(mx.arange(1, context + 1)[None] % 500, cache=cache)
    mx.eval([c.state for c in caches.leaves(cache)])
    times = []
    for _ in range(rounds):
        ckpt = caches.checkpoint(cache)
        start = time.perf_counter()
        out = model(mx.arange(accepted + 1)[None], cache=cache)
        mx.eval(out, [c.state for c in caches.leaves(cache)])
        times.append(time.perf_counter() - start)
        caches.rollback(model, cache, ckpt, list(range(accepted + 1)), 0)
    return statistics.median(times)


def state_bytes(model) -> int:
    """Bytes of one copy of the recurrent states (what a checkpoint keeps alive)."""
    cache = caches.make_cache(model)
    model(mx.array([[1, 2, 3]]), cache=cache)
    return sum(a.nbytes for c in caches.leaves(cache) if caches.is_recurrent(c)
               for a in c.cache if a is not None)


def run(families: list[str], n_prompts: int, max_tokens: int) -> list[dict]:
    rows = []
    for family in families:
        target, overrides = sized(family, seed=3)
        draft = noisy_copy(target, family, noise=0.1, seed=4, **overrides)
        vocab = overrides.get("vocab_size", 128)
        engines = {m: Engine(target, ByteTokenizer(vocab), mode=m, draft_model=draft,
                             num_draft=5) for m in ("none", "ngram", "draft")}
        times = {m: [] for m in engines}
        per = {m: {"tokens": 0, "forwards": 0, "drafted": 0, "accepted": 0, "exact": True}
               for m in engines}
        for engine in engines.values():  # warm up: kernels built, policies primed
            engine.generate(prompts(1, vocab, 16)[0], max_tokens=16)
        for prompt in prompts(n_prompts, vocab):
            want = engines["none"].generate(prompt, max_tokens=max_tokens).tokens
            prediction = [t if i % 8 != 5 else (t + 1) % vocab for i, t in enumerate(want)]
            for mode, engine in engines.items():  # interleaved: load hits every mode alike
                out = engine.generate(prompt, max_tokens=max_tokens, prediction=prediction)
                s = out.stats
                times[mode].append(s.decode_seconds / max(1, s.generated_tokens))
                p = per[mode]
                p["tokens"] += s.generated_tokens
                p["forwards"] += s.target_forwards
                p["drafted"] += s.drafted
                p["accepted"] += s.accepted
                p["exact"] &= out.tokens == want
        base = statistics.median(times["none"])
        for mode in engines:
            p = per[mode]
            rows.append(dict(family=family, mode=mode, exact=p["exact"],
                             tokens_per_forward=p["tokens"] / p["forwards"],
                             acceptance=p["accepted"] / p["drafted"] if p["drafted"] else None,
                             speedup=base / statistics.median(times[mode])))
        for mode in ("lookahead", "quantspec"):
            try:
                Engine(target, ByteTokenizer(vocab), mode=mode).generate(
                    prompts(1, vocab)[0], max_tokens=4)
                rows.append(dict(family=family, mode=mode, exact=True, refused=None))
            except MlxspecError as e:
                rows.append(dict(family=family, mode=mode, exact=None, refused=str(e)))
        if family in RECURRENT:
            one = refeed_cost(target, 256, 0)
            rows.append(dict(family=family, mode="rollback", refeed_1=one,
                             refeed_4=refeed_cost(target, 256, 3),
                             step_5=refeed_cost(target, 256, 5),
                             state_bytes=state_bytes(target)))
    return rows


def markdown(rows: list[dict]) -> str:
    out = ["| family | mode | exact | tokens / forward | acceptance | speed vs none |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        if r["mode"] == "rollback":
            continue
        if r.get("refused"):
            out.append(f"| {r['family']} | {r['mode']} | refused: {r['refused'][:80]}… | | | |")
        elif "tokens_per_forward" in r:
            acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "–"
            out.append(f"| {r['family']} | {r['mode']} | {'yes' if r['exact'] else 'NO'} | "
                       f"{r['tokens_per_forward']:.2f} | {acc} | {r['speedup']:.2f}× |")
        else:
            out.append(f"| {r['family']} | {r['mode']} | yes | | | |")
    out += ["", "| family | re-feed 1 token | re-feed 4 tokens | verify forward, 6 tokens | "
                "checkpoint memory |", "|---|---|---|---|---|"]
    for r in rows:
        if r["mode"] == "rollback":
            out.append(f"| {r['family']} | {r['refeed_1'] * 1e3:.2f} ms | "
                       f"{r['refeed_4'] * 1e3:.2f} ms | {r['step_5'] * 1e3:.2f} ms | "
                       f"{r['state_bytes'] / 1024:.0f} KiB |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default="llama,gemma3_text,gpt_oss,qwen3_5,lfm2,nemotron_h")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=96)
    args = ap.parse_args()
    rows = run(args.families.split(","), args.prompts, args.tokens)
    print(markdown(rows))


if __name__ == "__main__":
    main()
