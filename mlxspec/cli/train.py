"""`mlxspec train`: retrain the bundled target + draft pair, on the standard library or your code."""

from __future__ import annotations

import sys

import click


@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                 "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def train(args):
    """Train a target + draft pair (the recipe of the bundled models).

    --out DIR (gets target/ and draft/; use it as `-m DIR`), --target-minutes, --draft-minutes,
    --seed, --corpus DIR (your own .py files), --smoke (a seconds-long check).
    `mlxspec train --help` lists them with their defaults.

    `mlxspec train --draft-for -m MODEL` instead distils a draft for a real target (e.g.
    smollm2) that `-m MODEL` then finds for --mode draft and auto; `mlxspec train --draft-for
    --help` lists its options (--minutes, --out, --layers, --head-tokens, --corpus, --smoke).
    """
    if any(a == "--draft-for" or a.startswith("--draft-for=") for a in args):
        from ..recipe.distill import main as distill_main

        sys.exit(distill_main(list(args)))
    from ..recipe import main as recipe_main

    sys.exit(recipe_main(list(args), prog="mlxspec train"))
