"""Render models/README.md (the model card) from the recipe's measured figures (card.json)."""

from __future__ import annotations


def _m(x: int) -> str:
    return f"{x / 1e6:.2f} M"


def _steps_text(r: dict) -> str:
    cfg = r["config"]
    short = r.get("short_steps", 0)
    long_steps = r["steps"] - short
    tokens_per_step = r["batch_size"] * r["seq_len"]
    if short:
        ss = cfg["short_seq_len"]
        return (
            f"{r['steps']} steps of {tokens_per_step:,} tokens: {short} steps of "
            f"{tokens_per_step // ss}×{ss}-token rows (sequence-length warm-up, the first "
            f"{cfg['short_frac']:.0%} of the budget), then {long_steps} steps of "
            f"{r['batch_size']}×{r['seq_len']}-token rows"
        )
    return f"{r['steps']} steps of {r['batch_size']}×{r['seq_len']}-token rows"


def _model_section(name: str, r: dict, card: dict, role: str) -> str:
    s = r["shape"]
    ev = r["heldout"]
    lines = [
        f"## {name}",
        "",
        role,
        "",
        "| | |",
        "|---|---|",
        f"| architecture | Llama (`model_type: llama`, mlx-lm `llama.Model`): {s['num_hidden_layers']} layers, "
        f"hidden {s['hidden_size']}, {s['num_attention_heads']} heads (head dim "
        f"{s['hidden_size'] // s['num_attention_heads']}), MLP {s['intermediate_size']} (SwiGLU), "
        f"RMSNorm, RoPE θ=10000, tied embeddings |",
        f"| parameters | {r['params']:,} ({_m(r['params'])}) |",
        f"| compute per token | {_m(r['macs_per_token'])} multiply-accumulates (matmuls incl. LM head) |",
        f"| vocabulary | {r['vocab_size']} (byte-level BPE, shared by target and draft) |",
        f"| context | trained on {r['max_position_embeddings']}-token rows"
        + (f" for the last {r['steps'] - r['short_steps']} steps" if r.get("short_steps") else "")
        + f" (`max_position_embeddings: {r['max_position_embeddings']}`) |",
        "| weights | float16 safetensors (compute in float32 on CPU) |",
        f"| training | {_steps_text(r)}, AdamW "
        f"(β 0.9/0.95, wd 0.1), lr {r['lr']:g} with {r['config']['warmup_steps']} warm-up steps "
        f"and cosine decay to {r['config']['min_lr_ratio']:g}×, grad clip 1.0, float32 |",
        f"| tokens seen | {r['tokens_seen']:,} ({r['tokens_seen'] / max(1, card['corpus']['tokens']):.2f} "
        f"epochs of the corpus) |",
        f"| training time | {r['train_minutes']:.1f} min on the machine below "
        f"({r['tokens_per_s']:.0f} tokens/s) |",
        f"| final training loss | {r['final_loss']:.4f} nats/token (mean of the last 20 steps) |",
        f"| held-out bits per byte | **{ev['bits_per_byte']:.4f}** on {ev['bytes']:,} bytes "
        f"({ev['tokens']:,} tokens, {ev['bytes_per_token']:.2f} bytes/token) |",
    ]
    t = r.get("heldout_test_subset")
    if t:
        lines.append(
            f"| held-out bits per byte, test subset | {t['bits_per_byte']:.4f} on the first "
            f"{t['bytes']:,} bytes (what `tests/test_models.py` re-measures) |"
        )
    return "\n".join(lines) + "\n"


def _notes(card: dict) -> str:
    t = card["target"]
    bpb = t["heldout"]["bits_per_byte"]
    sub = (t.get("heldout_test_subset") or {}).get("bits_per_byte")
    aim = "meets" if bpb <= 1.5 else "misses"
    lines = [
        f"- Quality: the target's {bpb:.2f} bits/byte on the held-out evaluation set {aim} the "
        "project's aim of ≤ 1.5 bits/byte (a uniform byte model scores 8)"
        + (f"; the first {round(t['heldout_test_subset']['bytes'] / 1000)} KB (mostly `argparse`), "
           f"which the tests re-measure, scores {sub:.2f}" if sub else "")
        + f". It saw {t['tokens_seen'] / max(1, card['corpus']['tokens']):.2f} epochs of the "
        "corpus in its budget and its loss was still falling: a longer budget buys a better model.",
        "- The chain-acceptance figure counts all k drafted tokens of a step as proposed, also "
        "those after the first rejection; the agreement figure is the per-token probability that "
        "greedy speculative decoding accepts a drafted token given that its predecessors were "
        "accepted.",
        "- Prompts in the training formats: `mlxspec.recipe.format_chat`, `format_fim`, "
        "`edit_messages` + `make_edit_example` (edit requests), and `heldout_functions(n)` / "
        "`heldout_files()` / `heldout_eval_texts()` for held-out material (never trained on).",
        "- Throughput figures were measured on a 2-core machine shared with other work; the "
        "training run itself is single-process.",
    ]
    return "\n".join(lines)


def render_card(card: dict) -> str:
    acc = card["acceptance"]
    m = card["machine"]
    c = card["corpus"]
    held = card["corpus"].get("heldout_modules")
    out = [
        "# mlxspec bundled models",
        "",
        "Two small Llama models with one tokenizer, trained from scratch on this machine by the "
        "recipe in `mlxspec/recipe/` on Python source code: `target/` is the default model of "
        "`mlxspec` and `draft/` is its draft model for `--mode draft`. They are real (if small) "
        "language models of Python code, small enough to ship in the repository, and they give "
        "the speculative-decoding modes a learned distribution to be measured on.",
        "",
        "Both load with `mlx_lm.load(path)` and `mlxspec.load(path)`. Chat uses ChatML "
        "(`<|im_start|>user\\n…<|im_end|>\\n<|im_start|>assistant\\n`); code infilling uses "
        "Qwen2.5-Coder's prefix-suffix-middle format "
        "(`<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>`). Generation stops at "
        f"`<|endoftext|>` or `<|im_end|>` (`eos_token_id: {card['tokenizer']['eos_token_id']}`).",
        "",
        "## How they were made",
        "",
        "```",
        card["command"],
        "```",
        "",
        f"- date: {card['date']}; seed {card['seed']}; whole run {card['total_minutes']:.1f} min",
        f"- machine: {m['processor']} ({m['cpu_count']} cores), {m['platform']}, MLX {m['mlx']} "
        f"CPU backend, BLAS `{m['blas']}`, Python {m['python']}",
        f"- corpus: {c['root']}, {c['training_files']} training files "
        f"({c['bytes'] / 1e6:.1f} MB of documents, {c['tokens']:,} tokens): every file as plain "
        f"source ({c['documents']['source']}), fill-in-the-middle examples ({c['documents']['fim']}), "
        f"chat examples asking what a function does or to show it ({c['documents']['chat']}) and "
        f"edit examples (a function + a mechanical instruction → the whole edited function, "
        f"{c['documents']['edit']}), shuffled by the seed, joined with `<|endoftext|>` and cut "
        "into training rows",
        f"- tokenizer: {card['tokenizer']['type']} (Hugging Face `tokenizers`), "
        f"{card['tokenizer']['vocab_size']} tokens, special tokens "
        + ", ".join(f"`{s}`" for s in card["tokenizer"]["special_tokens"]),
    ]
    if held:
        out.append(
            f"- held out of training ({c['heldout_files']} files, the evaluation set; see "
            "`mlxspec/recipe/heldout.py`): " + ", ".join(f"`{h}`" for h in held)
        )
    out += [
        "- bits per byte: total negative log-likelihood in bits over total UTF-8 bytes, on the "
        f"first {card['eval_bytes']:,} bytes of the held-out files in their fixed order, each "
        "file scored on its own after `<|endoftext|>`, in 1024-token windows, fp16 weights "
        "computed in float32",
        "",
        _model_section("target", card["target"], card, "The model `mlxspec` runs by default."),
        _model_section(
            "draft", card["draft"], card,
            f"The draft model for `--mode draft`: {card['draft_compute_ratio']:.2f}× the target's "
            "compute per token.",
        ),
        "## Draft vs target (greedy)",
        "",
        f"On {acc['prompts']} held-out prompts of {acc.get('prompt_tokens', 256)} tokens (evenly "
        "spaced in the evaluation text), the target's greedy continuation of "
        f"{acc['gen_tokens']} tokens:",
        "",
        f"- next-token agreement (draft argmax = target argmax, both conditioned on the target's "
        f"path): **{acc['agreement']:.3f}**",
        f"- acceptance of {acc['k']}-token greedy draft chains (accepted / proposed): "
        f"**{acc['chain_acceptance']:.3f}**, i.e. {acc['tokens_per_target_step']:.2f} tokens per "
        "target forward",
        "",
        "## Notes",
        "",
        _notes(card),
        "",
        "## Retrain on your own code",
        "",
        "```",
        "pip install 'mlxspec[recipe]'          # adds the `tokenizers` library",
        "python -m mlxspec.recipe --out my-models --target-minutes 55 --draft-minutes 15 "
        "--seed 0 --corpus path/to/your/python",
        "```",
        "",
        "Without `--corpus` it trains on the standard library of the running interpreter (minus "
        "the held-out modules, test suites, `site-packages`, and the table-like or legacy `encodings`, "
        "`pydoc_data`, `lib2to3`, `turtledemo` and `ensurepip`; files over 400 kB are skipped). The budgets are wall-clock "
        "minutes, and the learning-rate schedule and the switch from 256- to 1024-token rows follow "
        "the elapsed fraction of the budget, so a budgeted run depends on the machine's speed. "
        "Corpus, tokenizer, initialisation and data order are deterministic for a seed, and "
        "with `--target-steps N --draft-steps M` the schedule follows the step count instead, "
        "which makes a run bit-for-bit reproducible on the same software stack. "
        "`--smoke` allows fractional-minute budgets with tiny shapes, for tests. Output is staged "
        "in a temporary folder inside `--out` and renamed into place at the end, so an "
        "interrupted run leaves no half-written model folder.",
        "",
        "## Licence",
        "",
        "The training corpus is the CPython standard library, © Python Software Foundation, "
        "licensed under the PSF License Agreement (Python Software Foundation License Version 2). "
        "The weights are a product of that source and are distributed with mlxspec under its MIT "
        "licence with this attribution; generated text may reproduce fragments of the standard "
        "library, which are PSF-licensed.",
        "",
    ]
    return "\n".join(out)
