"""The training recipe of mlxspec's bundled target + draft pair, and the corpus helpers that the
tests and benchmarks use to build prompts in the exact training formats.

    python -m mlxspec.recipe --out models --target-minutes 55 --draft-minutes 15 --seed 0
"""

from .corpus import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    edit_messages,
    format_chat,
    format_fim,
    make_edit_example,
)
from .heldout import (
    HELDOUT_MODULES,
    heldout_eval_texts,
    heldout_files,
    heldout_functions,
    training_files,
)


def run_recipe(*args, **kwargs):
    """See mlxspec.recipe.recipe.run_recipe."""
    from .recipe import run_recipe as _run

    return _run(*args, **kwargs)


def main(argv=None, prog: str = "python -m mlxspec.recipe") -> int:
    from .recipe import main as _main

    return _main(argv, prog=prog)


__all__ = [
    "CHAT_TEMPLATE",
    "HELDOUT_MODULES",
    "SPECIAL_TOKENS",
    "edit_messages",
    "format_chat",
    "format_fim",
    "heldout_eval_texts",
    "heldout_files",
    "heldout_functions",
    "main",
    "make_edit_example",
    "run_recipe",
    "training_files",
]
