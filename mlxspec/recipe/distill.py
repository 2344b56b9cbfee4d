"""`mlxspec train --draft-for -m MODEL`: distil a small draft for a real target on this machine.

The draft (`mlxspec.reduced_draft`): the target's first few layers as a start, the target's own
token embedding (shared, frozen), and a head over the N tokens most frequent in the corpus. It
learns the target's next-token distribution restricted to the head (cross-entropy to the
target's softmax, from the target's prefill forwards: no labels, no sampling in the loop).

Corpus, local only: answers the target itself generates to chat prompts (batched, greedy and
T = 1; the prompts are this module's own question templates and standard-library functions
outside the benchmark's held-out modules), then the text of the installed packages'
descriptions and of this repository's docs, and standard-library source, all in the target's
chat format.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np


@dataclass
class DistillConfig:
    minutes: float = 60.0  # the whole budget: generation + distillation + evaluation
    gen_fraction: float = 0.3  # share of the budget spent generating chats with the target
    layers: int = 2
    head_tokens: int = 8192
    seq_len: int = 256
    batch_size: int = 4
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    seed: int = 0
    gen_batch: int = 24
    gen_max_tokens: int = 192
    local_text_tokens: int = 400_000  # cap on the local-text part of the corpus
    steps: int | None = None  # a fixed number of training steps (tests), else the budget
    gen_prompts: int | None = None  # a fixed number of generated chats (tests), else the budget
    eval_chats: int = 24  # greedy chats held out of training: acceptance by position
    log_every_s: float = 30.0


# ---------------------------------------------------------------- prompts and corpus

TOPICS = (
    "recursion", "hash tables", "unit tests", "version control", "code review", "sorting",
    "the command line", "regular expressions", "databases", "caching", "APIs", "type hints",
    "exceptions", "logging", "memory leaks", "concurrency", "open source", "documentation",
    "gardening", "the ocean", "coffee", "autumn", "mountains", "friendship", "cooking pasta",
    "learning a language", "the moon", "trains", "a rainy day", "libraries", "music practice",
    "time management", "healthy sleep", "a city at night", "bicycles", "chess", "volcanoes",
    "photosynthesis", "the internet", "electric cars", "birds", "a small bakery", "teamwork",
    "public speaking", "saving money", "the history of writing", "robots", "winter", "deserts",
    "a lost key", "a new job", "keyboards", "spreadsheets", "maps", "clocks", "bridges",
)
TEMPLATES = (
    "Explain {t} in simple terms.", "What are the main benefits of {t}?",
    "Write a short paragraph about {t}.", "Give me three tips about {t}.",
    "Write a short poem about {t}.", "Tell me a short story about {t}.",
    "What are the pros and cons of {t}?", "How would you describe {t} to a child?",
    "What is a common mistake people make with {t}?", "Write a haiku about {t}.",
    "Why does {t} matter?", "Summarize what you know about {t} in a few sentences.",
)
CODE_QUESTIONS = (
    "Explain what this code does.", "What does this function return?",
    "Add a docstring to this function.", "How could this function be simplified?",
    "Describe this function in one paragraph.", "What are the edge cases of this function?",
    "Write a unit test for this function.", "Rewrite this function with clearer names.",
)


def _excluded_prompts() -> set[str]:
    """The benchmark's own questions: never trained on."""
    from ..bench.workloads import CHAT_QUESTION, FREE_QUESTIONS

    return set(FREE_QUESTIONS) | {CHAT_QUESTION}


def chat_questions(rng: random.Random, n: int) -> list[str]:
    """`n` user messages: generic questions, and standard-library training functions (the
    benchmark's held-out modules excluded) with a code question; about 2 : 1."""
    from .heldout import extract_functions, read_source, training_files

    excluded = _excluded_prompts()
    generic = [tpl.format(t=t) for t in TOPICS for tpl in TEMPLATES]
    generic = [q for q in generic if q not in excluded]
    rng.shuffle(generic)
    functions = []
    files = training_files()
    rng.shuffle(files)
    for f in files[:200]:
        if len(functions) >= n:
            break
        for _, src in extract_functions(read_source(f) or ""):
            if 4 <= src.count("\n") <= 30:
                functions.append(src)
    rng.shuffle(functions)
    out = []
    for i in range(n):
        if i % 3 == 2 and functions:
            src = functions[(i // 3) % len(functions)]
            out.append(f"```python\n{src.rstrip()}\n```\n\n{rng.choice(CODE_QUESTIONS)}")
        else:
            out.append(generic[i % len(generic)])
    return out


def render(tokenizer, user: str, answer: str | None = None) -> str:
    """The user's message in the model's chat template (plain text without one), followed by
    `answer` when given."""
    if getattr(tokenizer, "chat_template", None):
        from ..chat_session import render_chat

        prompt = render_chat(tokenizer, [{"role": "user", "content": user}])
    else:
        prompt = user + "\n"
    return prompt if answer is None else prompt + answer


def generate_chats(target, tokenizer, questions: list[str], seconds: float, cfg: DistillConfig,
                   log) -> list[tuple[list[int], list[int], bool]]:
    """(prompt ids, answer ids, greedy?) for as many questions as `seconds` allows (all of
    them when cfg.gen_prompts is set), in batches of cfg.gen_batch, alternating greedy and
    T = 1 batches."""
    from mlx_lm.generate import batch_generate
    from mlx_lm.sample_utils import make_sampler

    out = []
    t0 = time.perf_counter()
    done = 0
    b = 0
    while done < len(questions):
        if cfg.gen_prompts is None and time.perf_counter() - t0 >= seconds:
            break
        chunk = questions[done : done + cfg.gen_batch]
        prompts = [tokenizer.encode(render(tokenizer, q), add_special_tokens=False) for q in chunk]
        greedy = b % 2 == 0
        sampler = make_sampler(temp=0.0 if greedy else 1.0)
        res = batch_generate(target, tokenizer, prompts, max_tokens=cfg.gen_max_tokens,
                             return_token_ids=True, sampler=sampler)
        for p, ids in zip(prompts, res.token_ids):
            out.append((p, [int(t) for t in ids], greedy))
        done += len(chunk)
        b += 1
        el = time.perf_counter() - t0
        ntok = sum(len(a) for _, a, _ in out)
        log(f"[generate] {done} chats, {ntok} answer tokens, {ntok / el:.0f} tok/s, "
            f"{el / 60:.1f} min")
    return out


def local_texts(rng: random.Random, extra: Path | None = None) -> list[tuple[str, str]]:
    """(user, answer) pairs from local text: installed packages' descriptions, this
    repository's docs, files under `extra` (.md, .txt, .rst, .py), standard-library source."""
    import importlib.metadata as md

    from .heldout import read_source, training_files

    pairs = []
    for dist in md.distributions():
        text = dist.metadata.get_payload() if hasattr(dist.metadata, "get_payload") else None
        text = text or dist.metadata.get("Description") or ""
        name = dist.metadata.get("Name") or "this package"
        if len(text) > 400:
            pairs.append((f"Tell me about the Python package {name}.", text))
    repo = Path(__file__).resolve().parent.parent.parent
    docs = sorted(repo.glob("docs/*.md")) + [repo / "README.md"]
    if extra is not None:
        docs += sorted(p for ext in ("md", "txt", "rst", "py") for p in Path(extra).rglob(f"*.{ext}"))
    for p in docs:
        try:
            text = p.read_text(errors="replace")
        except OSError:
            continue
        for i in range(0, len(text), 4000):
            pairs.append((f"Explain {p.stem}.", text[i : i + 4000]))
    files = training_files()
    rng.shuffle(files)
    for f in files[:300]:
        src = read_source(f) or ""
        if src:
            pairs.append((f"Show me the source of {f.stem}.",
                          f"```python\n{src[:4000]}\n```"))
    rng.shuffle(pairs)
    return pairs


def make_rows(docs: list[list[int]], seq_len: int, eos: int) -> np.ndarray:
    """Documents joined with eos and cut into rows of seq_len tokens."""
    stream = []
    for d in docs:
        stream += d + [eos]
    n = max(1, len(stream) // seq_len)
    if len(stream) < n * seq_len:
        stream = (stream * math.ceil(n * seq_len / max(1, len(stream))))
    return np.array(stream[: n * seq_len], np.int32).reshape(n, seq_len)


def choose_head(rows: np.ndarray, n: int, vocab: int, always: list[int]) -> np.ndarray:
    """The `n` most frequent token ids of `rows` (ties by id), `always` included; sorted."""
    counts = np.bincount(rows.ravel(), minlength=vocab).astype(np.float64)
    counts[list(always)] = np.inf
    n = min(n, vocab)
    top = np.argsort(-counts, kind="stable")[:n]
    return np.sort(top)


# ---------------------------------------------------------------- the draft


def init_draft(target, layers: int, head_ids: np.ndarray):
    """A draft with the target's shape per layer, its first `layers` layers, final norm and
    (tied or not) output rows for the head; the embedding is the target's own module."""
    import mlx.core as mx

    from ..reduced_draft import ReducedHeadDraft, draft_args, target_embedding

    targs = {k: v for k, v in vars(target.args).items() if v is not None}
    targs.pop("layer_types", None)
    targs.update(model_type="llama", num_hidden_layers=layers, tie_word_embeddings=False)
    args = draft_args(targs)
    draft = ReducedHeadDraft(args, mx.array(head_ids))
    draft.model.embed_tokens = target_embedding(target)
    tlayers = getattr(target, "layers", [])
    for i in range(min(layers, len(tlayers))):
        try:
            draft.model.layers[i].update(tlayers[i].parameters())
        except Exception:  # another family's layer: keep the random start
            pass
    if hasattr(target.model, "norm"):
        draft.model.norm.update(target.model.norm.parameters())
    out_w = getattr(getattr(target, "lm_head", None), "weight", None)
    if out_w is None or out_w.ndim != 2:
        out_w = target_embedding(target)(mx.array(head_ids.astype(np.int32)))
    else:
        out_w = out_w[mx.array(head_ids.astype(np.int32))]
    draft.lm_head.weight = out_w.astype(mx.float32)
    mx.eval(draft.parameters())
    return draft


def distill(draft, target, rows: np.ndarray, cfg: DistillConfig, seconds: float, log) -> dict:
    """Train the draft's layers, norm and head (the shared embedding frozen) to the target's
    distribution over the head: AdamW, warm-up then cosine decay over the time budget (or
    cfg.steps)."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim

    head = mx.array(np.asarray(draft.head_ids.tolist(), np.int32))
    draft.model.embed_tokens.freeze()
    opt = optim.AdamW(learning_rate=cfg.lr, weight_decay=0.0, betas=[0.9, 0.98])

    def loss_fn(m, x, p):
        logq = nn.log_softmax(m.reduced(x).astype(mx.float32), axis=-1)
        return -(p * logq).sum(axis=-1).mean()

    loss_and_grad = nn.value_and_grad(draft, loss_fn)

    def step_fn(x, p):
        loss, grads = loss_and_grad(draft, x, p)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(draft, grads)
        return loss

    state = [draft.state, opt.state]
    step_c = mx.compile(step_fn, inputs=state, outputs=state)
    rng = np.random.default_rng(cfg.seed)
    t0 = time.perf_counter()
    last = t0
    step, tokens, ema = 0, 0, None
    order, pos = rng.permutation(len(rows)), 0
    bs = min(cfg.batch_size, len(rows))
    while True:
        el = time.perf_counter() - t0
        if cfg.steps is not None:
            if step >= cfg.steps:
                break
            prog = step / cfg.steps
        else:
            if el >= seconds:
                break
            prog = el / seconds
        if pos + bs > len(order):
            order, pos = rng.permutation(len(rows)), 0
        x = mx.array(rows[order[pos : pos + bs]])
        pos += bs
        tl = target(x)
        p = mx.stop_gradient(mx.softmax(tl.astype(mx.float32), axis=-1)[..., head])
        lo = cfg.lr * cfg.min_lr_ratio
        lr = (cfg.lr * (step + 1) / cfg.warmup_steps if step < cfg.warmup_steps
              else lo + 0.5 * (cfg.lr - lo) * (1 + math.cos(math.pi * min(1.0, prog))))
        opt.learning_rate = mx.array(lr, dtype=mx.float32)
        loss = step_c(x, p)
        mx.eval(loss, state)
        lv = float(loss.item())
        ema = lv if ema is None else 0.9 * ema + 0.1 * lv
        step += 1
        tokens += x.size
        now = time.perf_counter()
        if now - last >= cfg.log_every_s or step == 1:
            log(f"[distill] step {step} loss {lv:.3f} (ema {ema:.3f}) lr {lr:.1e} "
                f"{tokens / (now - t0):.0f} tok/s {(now - t0) / 60:.1f} min ({100 * prog:.0f}%)")
            last = now
    el = time.perf_counter() - t0
    log(f"[distill] done: {step} steps, {tokens} tokens, {el / 60:.1f} min, loss ema {ema:.3f}")
    return {"steps": step, "tokens": tokens, "minutes": round(el / 60, 2),
            "final_loss": round(ema or float("nan"), 4), "tokens_per_s": round(tokens / el, 1)}


def acceptance_by_position(draft, target, docs: list[tuple[list[int], list[int]]],
                           kmax: int = 8) -> dict:
    """Greedy drafting on the target's own greedy answers: the draft's argmax against the
    target's at every answer position (teacher-forced on the target's path, which is what
    greedy speculation accepts). Returns top-1 agreement, P(draft i accepted | drafts before
    it were), i = 1..kmax, and the tokens per target forward a k-chain would give."""
    import mlx.core as mx

    matches = []
    for prompt, answer in docs:
        seq = prompt + answer
        x = mx.array([seq[:-1]])
        t_arg = mx.argmax(target(x)[0, len(prompt) - 1 :], axis=-1)
        d_arg = mx.argmax(draft(x)[0, len(prompt) - 1 :], axis=-1)
        matches.append(np.array((t_arg == d_arg).tolist(), bool))
    cond, per_k = [], {}
    for i in range(kmax):
        # chains start at every position; position i is reached when the i before matched
        reached = ok = 0
        for m in matches:
            for s in range(len(m) - i):
                if m[s : s + i].all():
                    reached += 1
                    ok += int(m[s + i])
        cond.append(round(ok / max(1, reached), 4))
    for k in (2, 3, 4, 5, 6, 8):
        if k > kmax:
            continue
        steps = emitted = 0
        for m in matches:
            s = 0
            while s < len(m):
                n = 0
                while n < k and s + n < len(m) and m[s + n]:
                    n += 1
                steps += 1
                emitted += n + 1
                s += n + 1
        per_k[k] = round(emitted / max(1, steps), 3)
    allm = np.concatenate(matches) if matches else np.zeros(0, bool)
    return {"agreement": round(float(allm.mean()) if allm.size else 0.0, 4),
            "accept_at_position": cond, "tokens_per_forward": per_k,
            "positions": int(allm.size), "docs": len(docs)}


def draft_step_ms(draft, target, context: int = 160, reps: int = 9) -> dict:
    """Median ms of one draft token and of one and five target tokens, at `context`."""
    import mlx.core as mx

    from .. import caches
    from ..errors import MlxspecError

    def timed(model, k):
        cache = caches.make_cache(model)
        model(mx.array([[5] * context]), cache=cache)
        mx.eval([c.state for c in cache])
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            mx.eval(mx.argmax(model(mx.array([[7] * k]), cache=cache)[0, -1]))
            ts.append(time.perf_counter() - t)
            if not caches.trim_exact(cache, k):
                raise MlxspecError(f"cannot time {type(model).__name__}: its cache cannot trim")
        return round(1000 * sorted(ts)[len(ts) // 2], 2)

    return {"draft_1": timed(draft, 1), "target_1": timed(target, 1), "target_5": timed(target, 5)}


# ---------------------------------------------------------------- the command


def run(model: str, out: Path | None, cfg: DistillConfig, extra_corpus: Path | None = None,
        log=print) -> Path:
    """Train a draft for `model` and write it to `out` (default: where `-m model` finds it)."""
    import mlx.core as mx

    from ..errors import MlxspecError
    from ..loading import load_model
    from ..reduced_draft import (
        cached_drafts_dir,
        draft_key,
        embedding_fingerprint,
        save_reduced_draft,
        target_embedding,
        tokenizer_digest,
    )

    t_start = time.perf_counter()
    budget = cfg.minutes * 60.0
    target, tokenizer, _, name = load_model(model)
    target_embedding(target)  # refuses a target without one, before any work
    args = target.args
    if cfg.layers < 1 or cfg.layers > getattr(args, "num_hidden_layers", 1):
        raise MlxspecError(f"--layers must be between 1 and the target's "
                           f"{getattr(args, 'num_hidden_layers', 1)} layers, got {cfg.layers}")
    out = Path(out) if out is not None else cached_drafts_dir() / draft_key(model)
    log(f"target {name}: {args.num_hidden_layers} layers, width {args.hidden_size}, "
        f"vocabulary {args.vocab_size}; draft: {cfg.layers} layers, head {cfg.head_tokens} tokens; "
        f"budget {cfg.minutes:g} min; output {out}")
    rng = random.Random(cfg.seed)
    mx.random.seed(cfg.seed)
    eos = tokenizer.eos_token_id if getattr(tokenizer, "eos_token_id", None) is not None else 0

    # 1. chats the target answers itself
    n_q = cfg.gen_prompts if cfg.gen_prompts is not None else 5000
    questions = chat_questions(rng, n_q + cfg.eval_chats)
    eval_q, train_q = questions[: cfg.eval_chats], questions[cfg.eval_chats :]
    cfg_eval = DistillConfig(**{**asdict(cfg), "gen_batch": max(1, cfg.eval_chats),
                                "gen_prompts": 1})
    eval_docs = [(p, a) for p, a, g in generate_chats(
        target, tokenizer, eval_q, 0, cfg_eval, log) if g and a]
    gen = generate_chats(target, tokenizer, train_q, budget * cfg.gen_fraction, cfg, log)
    docs = [p + a for p, a, _ in gen]
    n_gen = sum(len(d) for d in docs)
    # 2. local text, capped
    n_local = 0
    for user, answer in local_texts(rng, extra_corpus):
        ids = tokenizer.encode(render(tokenizer, user, answer), add_special_tokens=False)
        docs.append(ids)
        n_local += len(ids)
        if n_local >= cfg.local_text_tokens:
            break
    # generated chats weigh more: they are what the draft will see
    rows_gen = make_rows([p + a for p, a, _ in gen] or docs[:1], cfg.seq_len, eos)
    rows_all = make_rows(docs, cfg.seq_len, eos)
    rows = np.concatenate([rows_gen, rows_gen, rows_all]) if gen else rows_all
    log(f"corpus: {len(gen)} generated chats ({n_gen} tokens), local text {n_local} tokens; "
        f"{len(rows)} rows of {cfg.seq_len}")
    specials = sorted(set(getattr(tokenizer, "all_special_ids", []) or []) | {eos})
    specials = [t for t in specials if 0 <= t < args.vocab_size]
    head_ids = choose_head(rows, cfg.head_tokens, args.vocab_size, specials)
    cover = float(np.isin(rows_gen.ravel(), head_ids).mean())
    log(f"head: {len(head_ids)} tokens cover {100 * cover:.1f}% of the generated chats' tokens")

    # 3. distil
    draft = init_draft(target, cfg.layers, head_ids)
    before = acceptance_by_position(draft, target, eval_docs[:4]) if eval_docs else None
    if before:
        log(f"before training: agreement {before['agreement']:.3f}")
    spent = time.perf_counter() - t_start
    reserve = min(120.0, 0.05 * budget)  # evaluation and saving
    stats = distill(draft, target, rows, cfg, max(0.0, budget - spent - reserve), log)

    # 4. evaluate, save
    acc = acceptance_by_position(draft, target, eval_docs) if eval_docs else {}
    cost = draft_step_ms(draft, target)
    if acc:
        log(f"held-out greedy chats: agreement {acc['agreement']:.3f}, accept at position "
            f"{acc['accept_at_position']}, tokens per forward {acc['tokens_per_forward']}")
    log(f"cost: draft token {cost['draft_1']} ms, target 1 token {cost['target_1']} ms, "
        f"5 tokens {cost['target_5']} ms")
    meta = {
        "target": model, "vocab_size": int(args.vocab_size), "hidden_size": int(args.hidden_size),
        "tokenizer": tokenizer_digest(tokenizer),
        "embedding_fingerprint": embedding_fingerprint(target),
        "head_tokens": int(len(head_ids)), "head_coverage": round(cover, 4),
        "corpus": {"generated_chats": len(gen), "generated_tokens": n_gen,
                   "local_text_tokens": n_local, "rows": int(len(rows)),
                   "extra_corpus": str(extra_corpus) if extra_corpus else None},
        "training": stats, "config": asdict(cfg), "acceptance": acc, "cost_ms": cost,
        "total_minutes": round((time.perf_counter() - t_start) / 60, 2),
        "command": "mlxspec train --draft-for -m " + model + (
            f" --minutes {cfg.minutes:g}" if cfg.minutes != DistillConfig.minutes else ""),
        "date": time.strftime("%Y-%m-%d"),
    }
    save_reduced_draft(draft, out, meta)
    log(f"wrote {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1e6:.1f} MB) in "
        f"{meta['total_minutes']} min")
    return out


def main(argv: list[str] | None = None, prog: str = "mlxspec train --draft-for") -> int:
    from ..errors import MlxspecError

    ap = argparse.ArgumentParser(prog=prog, description=(
        "Distil a small draft for a target (-m MODEL) from the target's own forwards over local "
        "text and chats it generates; -m MODEL then finds it for --mode draft and auto."))
    ap.add_argument("--draft-for", nargs="?", const=True, default=None, metavar="MODEL",
                    help="train a draft for MODEL (or for -m MODEL)")
    ap.add_argument("-m", "--model", default=None, help="the target (e.g. smollm2)")
    ap.add_argument("--out", type=Path, default=None,
                    help="output folder (default: the cache folder -m MODEL searches)")
    d = DistillConfig()
    ap.add_argument("--minutes", type=float, default=d.minutes,
                    help="time budget, generation and training included (default %(default)s)")
    ap.add_argument("--layers", type=int, default=d.layers)
    ap.add_argument("--head-tokens", type=int, default=d.head_tokens)
    ap.add_argument("--gen-fraction", type=float, default=d.gen_fraction,
                    help="share of the budget spent generating chats (default %(default)s)")
    ap.add_argument("--corpus", type=Path, default=None, help="extra local text (.md .txt .rst .py)")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--smoke", action="store_true",
                    help="a seconds-long check: 3 training steps, 4 generated chats")
    a = ap.parse_args(argv)
    model = a.draft_for if isinstance(a.draft_for, str) else a.model
    try:
        if not model:
            raise MlxspecError("--draft-for needs a target: --draft-for -m MODEL")
        if a.model and isinstance(a.draft_for, str) and a.model != a.draft_for:
            raise MlxspecError(f"--draft-for {a.draft_for} and -m {a.model} name different targets")
        if not a.minutes > 0:
            raise MlxspecError(f"--minutes must be positive, got {a.minutes}")
        if a.head_tokens < 2:
            raise MlxspecError(f"--head-tokens must be at least 2, got {a.head_tokens}")
        if not 0 <= a.gen_fraction < 1:
            raise MlxspecError(f"--gen-fraction must be in [0, 1), got {a.gen_fraction}")
        if a.corpus is not None and not a.corpus.is_dir():
            raise MlxspecError(f"corpus folder {a.corpus} does not exist")
        cfg = DistillConfig(minutes=a.minutes, layers=a.layers, head_tokens=a.head_tokens,
                            gen_fraction=a.gen_fraction, seed=a.seed)
        if a.smoke:
            cfg.steps, cfg.gen_prompts, cfg.gen_batch = 3, 4, 4
            cfg.gen_max_tokens, cfg.seq_len, cfg.local_text_tokens = 8, 64, 5000
            cfg.eval_chats, cfg.head_tokens = 2, min(cfg.head_tokens, 128)
        run(model, a.out, cfg, a.corpus,
            log=lambda m: print(f"{time.strftime('%H:%M:%S')} {m}", flush=True))
    except MlxspecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
