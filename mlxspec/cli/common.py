"""Options and error handling shared by the commands."""

from __future__ import annotations

import functools
import sys

import click

from ..errors import MlxspecError
from ..proposers import MODES


def exits_cleanly(fn):
    """Bad input -> 'error: ...' on stderr and exit code 2, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except MlxspecError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)

    return wrapper


def model_options(fn):
    fn = click.option("--model", "-m", default=None,
                      help="Model directory or Hugging Face repo id (default: the bundled model).")(fn)
    fn = click.option("--draft-model", default=None,
                      help="Draft model for --mode draft (default with the bundled model: its bundled draft).")(fn)
    fn = click.option("--mode", type=click.Choice(MODES), default="ngram", show_default=True,
                      help="Speculation mode.")(fn)
    fn = click.option("--num-draft-tokens", "-k", "num_draft", type=int, default=4, show_default=True,
                      help="Tokens proposed per step (1-64).")(fn)
    return fn


def sampling_options(fn):
    fn = click.option("--max-tokens", type=int, default=256, show_default=True)(fn)
    fn = click.option("--temp", type=float, default=0.0, show_default=True, help="Sampling temperature (0: greedy).")(fn)
    fn = click.option("--top-p", type=float, default=1.0, show_default=True)(fn)
    fn = click.option("--top-k", type=int, default=0, show_default=True, help="0 disables top-k.")(fn)
    fn = click.option("--seed", type=int, default=0, show_default=True)(fn)
    return fn


def load_engine(model, draft_model, mode, num_draft, quiet: bool = False, **options):
    from .. import backend
    from ..engine import load

    if not quiet:
        click.echo(f"loading {model or 'the bundled model'} (backend {backend.device_name()}, "
                   f"BLAS {backend.blas_in_use})", err=True)
    engine = load(model, mode=mode, draft=draft_model, num_draft=num_draft, **options)
    return engine


def mode_options(fn):
    """Options of particular modes (each ignored by the others)."""
    fn = click.option("--tree", is_flag=True,
                      help="ngram: propose every earlier continuation as a token tree.")(fn)
    fn = click.option("--tree-budget", type=int, default=16, show_default=True,
                      help="ngram --tree: nodes per step.")(fn)
    fn = click.option("--window", type=int, default=None, help="lookahead: Jacobi window W.")(fn)
    fn = click.option("--ngram-size", type=int, default=None, help="lookahead: n-gram size N.")(fn)
    fn = click.option("--candidates", type=int, default=None,
                      help="lookahead: verification candidates G.")(fn)
    fn = click.option("--group-size", type=click.Choice(["32", "64", "128"]), default="64",
                      show_default=True, help="quantspec: KV quantization group (tokens).")(fn)
    fn = click.option("--buffer-size", type=int, default=None,
                      help="quantspec: full-precision KV buffer, G..2G tokens (default 2G).")(fn)
    fn = click.option("--weight-bits", type=click.Choice(["2", "3", "4", "8"]), default="4",
                      show_default=True, help="quantspec: bits of the draft's weight copies.")(fn)
    fn = click.option("--quantize", "quantize_layers", type=click.Choice(["mlp", "all"]),
                      default="mlp", show_default=True,
                      help="quantspec: which linear layers the draft runs in low precision.")(fn)
    return fn


def mode_kwargs(mode: str, *, tree=False, tree_budget=16, window=None, ngram_size=None,
                candidates=None, group_size="64", buffer_size=None, weight_bits="4",
                quantize_layers="mlp") -> dict:
    """The constructor options of `mode`'s proposer from the CLI flags."""
    if mode == "ngram" and tree:
        return {"tree": True, "budget": tree_budget}
    if mode == "lookahead":
        given = {"window": window, "ngram": ngram_size, "candidates": candidates}
        return {k: v for k, v in given.items() if v is not None}
    if mode == "quantspec":
        return {"group_size": int(group_size), "buffer_size": buffer_size,
                "weight_bits": int(weight_bits), "quantize": quantize_layers}
    return {}
