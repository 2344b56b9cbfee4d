"""Training and evaluation of the bundled pair with MLX (mlx-lm's Llama architecture)."""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

# Model shapes. Target: ~8 M parameters; draft: ~1/10 of the target's compute per token.
TARGET_SHAPE = dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=4, intermediate_size=704)
DRAFT_SHAPE = dict(hidden_size=96, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256)
SMOKE_TARGET_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128)
SMOKE_DRAFT_SHAPE = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=1, intermediate_size=64)


@dataclass
class TrainConfig:
    minutes: float
    seed: int = 0
    batch_size: int = 4
    seq_len: int = 1024
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    steps: int | None = None  # fixed step count (exactly reproducible); None: from the budget
    # Sequence-length warm-up: the first `short_frac` of training (of the steps, or of the time
    # budget) uses rows of `short_seq_len` tokens in batches holding the same number of tokens.
    short_seq_len: int | None = 256
    short_frac: float = 0.5
    log_every_s: float = 30.0


def model_args(shape: dict, vocab_size: int, seq_len: int):
    from mlx_lm.models.llama import ModelArgs

    return ModelArgs(
        model_type="llama",
        vocab_size=vocab_size,
        rms_norm_eps=1e-5,
        max_position_embeddings=seq_len,
        num_key_value_heads=shape["num_attention_heads"],
        rope_theta=10000.0,
        tie_word_embeddings=True,
        **shape,
    )


def build_model(args, seed: int):
    import mlx.core as mx
    from mlx_lm.models.llama import Model

    mx.random.seed(seed)
    model = Model(args)
    mx.eval(model.parameters())
    return model


def count_params(model) -> int:
    from mlx.utils import tree_flatten

    return int(sum(v.size for _, v in tree_flatten(model.parameters())))


def flops_per_token(args) -> int:
    """Multiply-accumulates per token for the matmuls (embedding lookup excluded, LM head
    included; attention over the context excluded)."""
    d, f, L = args.hidden_size, args.intermediate_size, args.num_hidden_layers
    hd = args.head_dim or d // args.num_attention_heads
    kv = args.num_key_value_heads * hd
    per_layer = d * d * 2 + 2 * d * kv + 3 * d * f
    return int(L * per_layer + d * args.vocab_size)


def make_rows(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """Cut the token stream into rows of seq_len + 1 (inputs and shifted targets)."""
    n = (len(tokens) - 1) // seq_len
    if n < 1:
        # Tiny corpora: repeat the stream until one row fits.
        reps = math.ceil((seq_len + 1) / max(1, len(tokens)))
        tokens = np.tile(tokens, reps + 1)
        n = (len(tokens) - 1) // seq_len
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return tokens[idx]


def train(model, stream: np.ndarray, cfg: TrainConfig, name: str, log=print) -> dict:
    """Train `model` on the token stream for cfg.minutes (or exactly cfg.steps steps).

    AdamW, linear warm-up then cosine decay to min_lr_ratio * lr, gradient clipping at 1.0.
    The schedule follows progress p = step / steps, or with a time budget p = elapsed / budget,
    so the decay ends when the budget does. Rows of cfg.short_seq_len tokens while
    p < cfg.short_frac, then rows of cfg.seq_len tokens (same tokens per step).
    """
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim

    rng = np.random.default_rng(cfg.seed)
    opt = optim.AdamW(learning_rate=cfg.lr, weight_decay=cfg.weight_decay, betas=[0.9, 0.95])

    def loss_fn(m, x, y):
        logits = m(x)
        return nn.losses.cross_entropy(logits, y, reduction="mean")

    loss_and_grad = nn.value_and_grad(model, loss_fn)
    state = [model.state, opt.state]

    def step_fn(x, y):
        loss, grads = loss_and_grad(model, x, y)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        return loss

    step_c = mx.compile(step_fn, inputs=state, outputs=state)

    phases = []  # (seq_len, batch_size, rows)
    use_short = bool(cfg.short_seq_len and cfg.short_seq_len < cfg.seq_len and cfg.short_frac > 0)
    if use_short:
        bs_short = cfg.batch_size * cfg.seq_len // cfg.short_seq_len
        phases.append((cfg.short_seq_len, bs_short, make_rows(stream, cfg.short_seq_len)))
    phases.append((cfg.seq_len, cfg.batch_size, make_rows(stream, cfg.seq_len)))
    short_frac = cfg.short_frac if use_short else 0.0

    budget_s = cfg.minutes * 60.0
    warm = cfg.warmup_steps
    if cfg.steps:
        warm = min(warm, max(1, cfg.steps // 10))

    def lr_at(step, p):
        if step < warm:
            return cfg.lr * (step + 1) / warm
        lo = cfg.lr * cfg.min_lr_ratio
        return lo + 0.5 * (cfg.lr - lo) * (1 + math.cos(math.pi * min(1.0, p)))

    t0 = time.perf_counter()
    last_log = t0
    step = 0
    tokens_seen = 0
    short_steps = 0
    losses: list[float] = []
    ema = None
    cur = None
    order = None
    pos = 0
    while True:
        elapsed = time.perf_counter() - t0
        if cfg.steps:
            if step >= cfg.steps:
                break
            p = step / cfg.steps
        else:
            if elapsed >= budget_s:
                break
            p = elapsed / budget_s
        ph = 0 if (use_short and p < short_frac) else len(phases) - 1
        if ph != cur:
            cur = ph
            seq, bs, rows = phases[ph]
            order = rng.permutation(len(rows))
            pos = 0
            if step:
                log(f"[{name}] step {step}: switching to {seq}-token rows, batch {bs}")
        if pos + bs > len(order):
            order = rng.permutation(len(rows))
            pos = 0
        idx = order[pos : pos + bs] if len(order) >= bs else rng.integers(0, len(rows), bs)
        pos += bs
        batch = mx.array(rows[np.sort(idx)].astype(np.int32))
        lr = lr_at(step, p)
        opt.learning_rate = mx.array(lr, dtype=mx.float32)
        loss = step_c(batch[:, :-1], batch[:, 1:])
        mx.eval(loss, state)
        lv = float(loss.item())
        losses.append(lv)
        ema = lv if ema is None else 0.95 * ema + 0.05 * lv
        tokens_seen += bs * seq
        short_steps += int(ph == 0 and use_short)
        step += 1
        now = time.perf_counter()
        if now - last_log >= cfg.log_every_s or step == 1:
            el = now - t0
            log(
                f"[{name}] step {step} loss {lv:.4f} (ema {ema:.4f}) lr {lr:.2e} "
                f"seq {seq} tok/s {tokens_seen / el:.0f} elapsed {el / 60:.1f} min "
                f"({100 * p:.0f}%)"
            )
            last_log = now
    el = time.perf_counter() - t0
    final = float(np.mean(losses[-20:])) if losses else float("nan")
    log(f"[{name}] done: {step} steps, {tokens_seen} tokens, {el / 60:.2f} min, "
        f"final loss {final:.4f}")
    return {
        "steps": step,
        "short_steps": short_steps,
        "tokens_seen": tokens_seen,
        "train_minutes": round(el / 60, 2),
        "final_loss": round(final, 4),
        "tokens_per_s": round(tokens_seen / max(el, 1e-9), 1),
        "batch_size": cfg.batch_size,
        "seq_len": cfg.seq_len,
        "lr": cfg.lr,
        "config": asdict(cfg),
    }


def save_model(model, args, out: Path, eos: list[int]) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(mx.float16) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    cfg = {k: v for k, v in vars(args).items() if v is not None}
    cfg.pop("layer_types", None)
    cfg.update(
        architectures=["LlamaForCausalLM"],
        torch_dtype="float16",
        eos_token_id=list(eos),
        hidden_act="silu",
    )
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


# ---------------------------------------------------------------- evaluation


def bits_per_byte(model, tokenizer_encode, texts: list[str], eos_id: int, window: int = 1024,
                  batch: int = 8) -> dict:
    """Total NLL (bits) of `texts` over their total UTF-8 bytes. Each text is scored on its own,
    conditioned on a leading <|endoftext|>, in non-overlapping windows of `window` tokens.
    `tokenizer_encode(text) -> list[int]` must be lossless (byte-level BPE is)."""
    import mlx.core as mx
    import mlx.nn as nn

    xs, ys = [], []
    nbytes = 0
    for text in texts:
        ids = [eos_id] + list(tokenizer_encode(text))
        nbytes += len(text.encode("utf-8"))
        for s in range(0, len(ids) - 1, window):
            x = ids[s : s + window]
            y = ids[s + 1 : s + window + 1]
            x = x[: len(y)]
            xs.append(x)
            ys.append(y)
    total_nll = 0.0
    ntok = 0
    order = sorted(range(len(xs)), key=lambda i: len(xs[i]))
    for b in range(0, len(order), batch):
        group = [order[i] for i in range(b, min(b + batch, len(order)))]
        L = max(len(xs[i]) for i in group)
        X = np.zeros((len(group), L), np.int32)
        Y = np.zeros((len(group), L), np.int32)
        M = np.zeros((len(group), L), np.float32)
        for r, i in enumerate(group):
            n = len(xs[i])
            X[r, :n] = xs[i]
            Y[r, :n] = ys[i]
            M[r, :n] = 1
        logits = model(mx.array(X)).astype(mx.float32)
        nll = nn.losses.cross_entropy(logits, mx.array(Y), reduction="none") * mx.array(M)
        total_nll += float(nll.sum().item())
        ntok += int(M.sum())
    bits = total_nll / math.log(2)
    return {
        "bits_per_byte": bits / max(1, nbytes),
        "bytes": nbytes,
        "tokens": ntok,
        "bytes_per_token": nbytes / max(1, ntok),
        "nll_per_token": total_nll / max(1, ntok),
    }


def greedy_acceptance(target, draft, prompts: list[list[int]], gen_tokens: int = 64, k: int = 4) -> dict:
    """Draft vs target, greedy, on the target's own greedy continuations of `prompts`.

    - agreement: fraction of continuation positions where argmax(draft) == argmax(target), both
      conditioned on the target's greedy path.
    - chain acceptance with k drafted tokens per step (exactly what greedy speculative decoding
      with a k-token draft chain accepts, since accepted tokens are the target's path): accepted
      / proposed, and mean tokens emitted per target forward (accepted + 1).
    """
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    matches_all: list[list[bool]] = []
    for p in prompts:
        cache = make_prompt_cache(target)
        logits = target(mx.array([p]), cache=cache)
        tok = int(mx.argmax(logits[0, -1]).item())
        gen = [tok]
        for _ in range(gen_tokens - 1):
            logits = target(mx.array([[tok]]), cache=cache)
            tok = int(mx.argmax(logits[0, -1]).item())
            gen.append(tok)
        seq = p + gen
        dl = draft(mx.array([seq[:-1]]))
        dpred = np.array(mx.argmax(dl[0, len(p) - 1 :], axis=-1).tolist())
        matches_all.append(list(dpred == np.array(gen)))
    agree = float(np.mean([m for ms in matches_all for m in ms]))
    proposed = accepted = steps = emitted = 0
    for ms in matches_all:
        i = 0
        while i < len(ms):
            n = 0
            while n < k and i + n < len(ms) and ms[i + n]:
                n += 1
            prop = min(k, len(ms) - i)
            proposed += prop
            accepted += n
            steps += 1
            emitted += n + 1
            i += n + 1
    return {
        "agreement": agree,
        "k": k,
        "chain_acceptance": accepted / max(1, proposed),
        "tokens_per_target_step": emitted / max(1, steps),
        "prompts": len(prompts),
        "gen_tokens": gen_tokens,
    }
