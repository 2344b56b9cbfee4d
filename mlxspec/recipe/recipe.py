"""The recipe: corpus -> tokenizer -> target -> draft -> evaluation -> model card.

    python -m mlxspec.recipe --out models --target-minutes 55 --draft-minutes 15 --seed 0
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from . import heldout as H


class RecipeError(Exception):
    """Bad input, detected before any training."""


def _log_default(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


def _split_custom(root: Path, seed: int) -> tuple[list[Path], list[Path]]:
    files = H.corpus_files(root)
    files = [f for f in files if (H.read_source(f) or "").strip()]
    if len(files) < 2:
        return files, []
    order = list(files)
    random.Random(seed).shuffle(order)
    n_hold = max(1, len(files) // 10)
    held = sorted(order[:n_hold])
    return [f for f in files if f not in held], held


SMOKE_TRAIN_BYTES = 400_000  # --smoke trains its tokenizer and models on about this much source
SMOKE_STEPS = 6  # --smoke's default step count per model (no time budget to wait for)


def _smoke_subset(files: list[Path]) -> list[Path]:
    """The first files (in the corpus's order) up to SMOKE_TRAIN_BYTES, at least one."""
    out, total = [], 0
    for f in files:
        if out and total >= SMOKE_TRAIN_BYTES:
            break
        try:
            size = f.stat().st_size
        except OSError:
            continue
        if size > SMOKE_TRAIN_BYTES and out:
            continue
        out.append(f)
        total += size
    return out


def _check_inputs(out_dir, corpus_dir, target_minutes, draft_minutes, min_minutes):
    for label, m in (("target", target_minutes), ("draft", draft_minutes)):
        if m is None or not (m >= min_minutes):
            hint = "" if min_minutes < 1 else " (use --smoke for a fractional-minute test run)"
            raise RecipeError(
                f"--{label}-minutes must be at least {min_minutes:g} minute(s), got {m}{hint}"
            )
    root = Path(corpus_dir) if corpus_dir is not None else H.stdlib_dir()
    if not root.exists():
        raise RecipeError(f"corpus folder {root} does not exist")
    if not root.is_dir():
        raise RecipeError(f"corpus path {root} is not a folder")
    files = [f for f in H.corpus_files(root) if (H.read_source(f) or "").strip()]
    if not files:
        raise RecipeError(f"corpus folder {root} holds no readable, non-empty .py files")
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".recipe-tmp-", dir=out))
    except OSError as e:
        raise RecipeError(f"output folder {out} is not writable: {e}") from None
    return root, tmp


def run_recipe(
    out_dir,
    target_minutes: float = 55.0,
    draft_minutes: float = 15.0,
    seed: int = 0,
    corpus_dir=None,
    *,
    min_minutes: float = 1.0,
    smoke: bool = False,
    vocab_size: int | None = None,
    seq_len: int | None = None,
    target_steps: int | None = None,
    draft_steps: int | None = None,
    eval_bytes: int | None = None,
    log=_log_default,
) -> dict:
    """Build the corpus, train the tokenizer and both models, evaluate, write the card.

    Writes `out_dir/target`, `out_dir/draft`, `out_dir/README.md` and `out_dir/card.json`,
    staged in a temporary folder inside `out_dir` and renamed into place at the end.
    `smoke=True` uses tiny shapes (seconds) and allows budgets down to ~0.01 minute.
    Raises RecipeError on bad input before training. Returns the card dictionary.
    """
    if smoke:
        min_minutes = min(min_minutes, 0.005)
    root, tmp = _check_inputs(out_dir, corpus_dir, target_minutes, draft_minutes, min_minutes)
    out = Path(out_dir)
    keep_tmp = os.environ.get("MLXSPEC_RECIPE_KEEP_TMP", "") not in ("", "0")
    try:
        card = _run(out, tmp, root, corpus_dir is None, target_minutes, draft_minutes, seed,
                    smoke, vocab_size, seq_len, target_steps, draft_steps, eval_bytes, log)
        # Move into place: old folders aside first, then the new ones in, then drop the old.
        names = ["target", "draft", "README.md", "card.json"]
        old = tmp / "_old"
        old.mkdir()
        for n in names:
            if (out / n).exists():
                (out / n).rename(old / n)
        for n in names:
            (tmp / n).rename(out / n)
        shutil.rmtree(tmp, ignore_errors=True)
        log(f"wrote {out / 'target'}, {out / 'draft'}, {out / 'README.md'}")
        return card
    except BaseException:
        if not keep_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            log(f"kept the staging folder {tmp} (MLXSPEC_RECIPE_KEEP_TMP)")
        raise


def _run(out, tmp, root, is_stdlib, target_minutes, draft_minutes, seed, smoke, vocab_size,
         seq_len, target_steps, draft_steps, eval_bytes, log):
    import mlx.core as mx
    import numpy as np

    import mlxspec  # noqa: F401  (OpenBLAS before mlx.core)

    from . import corpus as C
    from . import tok as T
    from . import train as TR

    t_start = time.time()
    vocab_size = vocab_size or (512 if smoke else 6144)
    seq_len = seq_len or (128 if smoke else 1024)
    if eval_bytes is None:
        eval_bytes = 16_000 if smoke else H.EVAL_BYTES

    if is_stdlib:
        train_files, held_files = H.training_files(root), H.heldout_files(root)
    else:
        train_files, held_files = _split_custom(root, seed)
    if smoke:  # a check that the recipe runs, not a model: a few files keep it to seconds
        train_files, held_files = _smoke_subset(train_files), held_files[:2]
    log(f"corpus: {root} ({len(train_files)} training files, {len(held_files)} held out)")
    docs, counts = C.build_documents(train_files, root, seed)
    corpus_bytes = sum(len(d.encode("utf-8")) for d in docs)
    log(f"documents: {counts}, {corpus_bytes / 1e6:.2f} MB")

    tok = T.train_tokenizer(docs, vocab_size)
    vocab_size = tok.get_vocab_size()
    eos = T.eos_ids(tok)
    enc = tok.encode_batch(docs)
    stream = np.fromiter((i for e in enc for i in e.ids), dtype=np.int32)
    del enc
    log(f"tokenizer: vocab {vocab_size}; corpus {len(stream)} tokens "
        f"({corpus_bytes / len(stream):.2f} bytes/token)")

    held_texts = _eval_texts(held_files, eval_bytes, is_stdlib, root)
    if not held_texts:  # a one-file corpus: evaluate on (a prefix of) the training text
        held_texts = [(H.read_source(train_files[0]) or "")[:eval_bytes]]

    results = {}
    models = {}
    for which, minutes, steps in (("target", target_minutes, target_steps),
                                  ("draft", draft_minutes, draft_steps)):
        shape = (TR.SMOKE_TARGET_SHAPE if which == "target" else TR.SMOKE_DRAFT_SHAPE) if smoke \
            else (TR.TARGET_SHAPE if which == "target" else TR.DRAFT_SHAPE)
        args = TR.model_args(shape, vocab_size, seq_len)
        model = TR.build_model(args, seed + (0 if which == "target" else 1))
        n_params = TR.count_params(model)
        log(f"{which}: {n_params / 1e6:.2f} M parameters, {TR.flops_per_token(args) / 1e6:.2f} M "
            f"MACs/token, shape {shape}")
        cfg = TR.TrainConfig(
            minutes=minutes, seed=seed, seq_len=seq_len,
            batch_size=(4 if which == "target" else 8) if not smoke else 2,
            warmup_steps=100 if not smoke else 2, steps=steps,
            log_every_s=30.0 if not smoke else 1.0,
            short_seq_len=None if smoke else 256,
        )
        stats = TR.train(model, stream, cfg, which, log)
        TR.save_model(model, args, tmp / which, eos)
        T.save_tokenizer(tok, tmp / which, seq_len)
        # Evaluate the saved (fp16) weights, computed in float32 as the runtime does on CPU.
        model.update(_fp16_roundtrip(model))
        ev = TR.bits_per_byte(model, lambda s: tok.encode(s).ids, held_texts, eos[0],
                              window=seq_len)
        log(f"{which}: held-out {ev['bits_per_byte']:.4f} bits/byte over {ev['bytes']} bytes")
        test_ev = None
        if is_stdlib and not smoke:
            test_texts = H.heldout_eval_texts(H.TEST_EVAL_BYTES, root)
            test_ev = TR.bits_per_byte(model, lambda s: tok.encode(s).ids, test_texts, eos[0],
                                       window=seq_len)
        results[which] = {
            "params": n_params,
            "macs_per_token": TR.flops_per_token(args),
            "shape": shape,
            "vocab_size": vocab_size,
            "max_position_embeddings": seq_len,
            **stats,
            "heldout": ev,
            "heldout_test_subset": test_ev,
        }
        models[which] = model
        mx.clear_cache()

    prompts = _acceptance_prompts(tok, held_texts, eos[0], n=4 if smoke else 16,
                                  length=32 if smoke else 256)
    acc = TR.greedy_acceptance(models["target"], models["draft"], prompts,
                               gen_tokens=16 if smoke else 64, k=4)
    acc["prompt_tokens"] = 32 if smoke else 256
    log(f"draft vs target: agreement {acc['agreement']:.3f}, 4-token chain acceptance "
        f"{acc['chain_acceptance']:.3f}, {acc['tokens_per_target_step']:.2f} tokens/target step")

    from .. import backend

    card = {
        "command": _command_line(out, target_minutes, draft_minutes, seed, root, is_stdlib,
                                 smoke, target_steps, draft_steps),
        "seed": seed,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"),
        "machine": {
            "platform": platform.platform(),
            "processor": backend._cpu_name() if hasattr(backend, "_cpu_name") else "",
            "cpu_count": os.cpu_count(),
            "blas": backend.blas_in_use,
            "mlx": mx.__version__,
            "python": platform.python_version(),
        },
        "corpus": {
            "root": str(root) if not is_stdlib else f"CPython {platform.python_version()} stdlib",
            "training_files": len(train_files),
            "heldout_files": len(held_files),
            "heldout_modules": list(H.HELDOUT_MODULES) if is_stdlib else None,
            "documents": counts,
            "bytes": corpus_bytes,
            "tokens": int(len(stream)),
        },
        "tokenizer": {"type": "byte-level BPE", "vocab_size": vocab_size,
                      "special_tokens": C.SPECIAL_TOKENS, "eos_token_id": eos},
        "eval_bytes": eval_bytes,
        "test_eval_bytes": H.TEST_EVAL_BYTES if is_stdlib else None,
        "target": results["target"],
        "draft": results["draft"],
        "acceptance": acc,
        "draft_compute_ratio": results["draft"]["macs_per_token"] / results["target"]["macs_per_token"],
        "total_minutes": round((time.time() - t_start) / 60, 2),
    }
    (tmp / "card.json").write_text(json.dumps(card, indent=2) + "\n")
    from .card import render_card

    (tmp / "README.md").write_text(render_card(card))
    return card


def _fp16_roundtrip(model):
    import mlx.core as mx
    from mlx.utils import tree_map

    return tree_map(lambda v: v.astype(mx.float16).astype(mx.float32), model.parameters())


def _eval_texts(held_files, eval_bytes, is_stdlib, root):
    if is_stdlib:
        return H.heldout_eval_texts(eval_bytes, root)
    texts, total = [], 0
    for p in held_files:
        t = H.read_source(p) or ""
        b = t.encode("utf-8")[: max(0, eval_bytes - total)].decode("utf-8", errors="ignore")
        if b:
            texts.append(b)
            total += len(b.encode("utf-8"))
        if total >= eval_bytes:
            break
    return texts


def _acceptance_prompts(tok, texts, eos_id, n, length):
    return acceptance_prompts(lambda t: tok.encode(t).ids, texts, eos_id, n, length)


def acceptance_prompts(encode, texts, eos_id, n=16, length=256):
    """`n` prompts of `length` tokens at evenly spaced offsets of the held-out text (each text
    preceded by <|endoftext|>): the prompts of the card's draft-acceptance figure."""
    ids = []
    for t in texts:
        ids += [eos_id] + list(encode(t))
    if len(ids) < length + 1:
        ids = ids * (length // max(1, len(ids)) + 2)
    stride = max(1, (len(ids) - length) // n)
    return [ids[i * stride : i * stride + length] for i in range(n)]


def _command_line(out, tm, dm, seed, root, is_stdlib, smoke, ts, ds):
    parts = ["python -m mlxspec.recipe", f"--out {out}", f"--target-minutes {tm:g}",
             f"--draft-minutes {dm:g}", f"--seed {seed}"]
    if not is_stdlib:
        parts.append(f"--corpus {root}")
    if smoke:
        parts.append("--smoke")
    if ts:
        parts.append(f"--target-steps {ts}")
    if ds:
        parts.append(f"--draft-steps {ds}")
    return " ".join(parts)


class _DefaultsFormatter(argparse.HelpFormatter):
    """Shows an option's default where it has one and its help does not already say it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("default" not in text and action.default is not None and action.default is not False
                and action.default is not argparse.SUPPRESS and action.option_strings):
            text += " (default: %(default)s)"
        return text


def build_parser(prog: str = "python -m mlxspec.recipe") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Train a target + draft model pair with the recipe of mlxspec's bundled "
        "models (tokenizer, both models, evaluation, model card) on the standard library or on "
        "your own Python code. Output is staged and moved into place at the end: an "
        "interrupted run leaves no half-written model.",
        epilog=f"Using the result: `mlxspec generate -m OUT -p 'def '` (OUT holds target/ and "
        f"draft/: the target is the model, the draft the draft of --mode draft), or "
        f"`-m OUT/target --draft-model OUT/draft`; `mlxspec serve -m OUT`, `mlxspec chat -m "
        f"OUT`. Check that the recipe runs first: `{prog} --smoke --out /tmp/pair` takes "
        f"seconds and writes a tiny, useless pair.",
        formatter_class=_DefaultsFormatter,
    )
    p.add_argument("--out", required=True,
                   help="output folder (gets target/, draft/, README.md, card.json)")
    p.add_argument("--target-minutes", type=float, default=None,
                   help="target training budget in minutes (default 55; with --smoke "
                        f"{SMOKE_STEPS} steps instead)")
    p.add_argument("--draft-minutes", type=float, default=None,
                   help="draft training budget in minutes (default 15; with --smoke "
                        f"{SMOKE_STEPS} steps instead)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data order and weights")
    p.add_argument("--corpus", default=None,
                   help="folder of .py files (default: the running interpreter's standard "
                        "library)")
    p.add_argument("--target-steps", type=int, default=None,
                   help="fixed step count instead of the time budget (exact reproduction)")
    p.add_argument("--draft-steps", type=int, default=None,
                   help="fixed step count for the draft")
    p.add_argument("--vocab-size", type=int, default=None, help="default 6144 (512 with --smoke)")
    p.add_argument("--seq-len", type=int, default=None, help="default 1024 (128 with --smoke)")
    p.add_argument("--smoke", action="store_true",
                   help="a seconds-long check that the recipe runs end to end: tiny shapes, "
                        f"about {SMOKE_TRAIN_BYTES // 1000} kB of the corpus, {SMOKE_STEPS} "
                        "steps per model unless budgets or steps are given")
    return p


def smoke_defaults(args) -> None:
    """--smoke alone: fixed small step counts rather than the 55 + 15 minute budgets."""
    if args.target_minutes is None and args.target_steps is None:
        args.target_steps = SMOKE_STEPS
    if args.draft_minutes is None and args.draft_steps is None:
        args.draft_steps = SMOKE_STEPS


def main(argv=None, prog: str = "python -m mlxspec.recipe") -> int:
    args = build_parser(prog).parse_args(argv)
    if args.smoke:
        smoke_defaults(args)
    # Budgets (ignored where a step count is given).
    args.target_minutes = 55.0 if args.target_minutes is None else args.target_minutes
    args.draft_minutes = 15.0 if args.draft_minutes is None else args.draft_minutes
    try:
        run_recipe(
            args.out, args.target_minutes, args.draft_minutes, args.seed, args.corpus,
            smoke=args.smoke, vocab_size=args.vocab_size, seq_len=args.seq_len,
            target_steps=args.target_steps, draft_steps=args.draft_steps,
        )
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    print(f"done: use the pair with `mlxspec generate -m {out} -p 'def '` (the target; "
          f"`--mode draft` uses the draft too) or `mlxspec chat -m {out}`", file=sys.stderr)
    return 0
