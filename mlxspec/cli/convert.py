"""`mlxspec convert`: a GGUF model → a plain mlx-lm folder."""

from __future__ import annotations

import click

from .common import GGUF_WEIGHTS_HELP, exits_cleanly


@click.command()
@click.argument("source")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--weights", type=click.Choice(["auto", "quantized", "float32", "float16"]),
              default="auto", show_default=True, help=GGUF_WEIGHTS_HELP)
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@exits_cleanly
def convert(source: str, out: str, weights: str, force: bool):
    """Write SOURCE (a GGUF file, a folder holding one, ollama:NAME[:TAG] or smollm2) as an
    mlx-lm model folder OUT, loadable by `mlx_lm.load(OUT)` and `mlxspec -m OUT`."""
    from pathlib import Path

    from ..errors import MlxspecError
    from ..gguf import gguf_source
    from ..gguf.convert import convert_gguf

    target = Path(out)
    if target.exists() and any(target.iterdir()) and not force:
        raise MlxspecError(f"{out} exists and is not empty: pass --force to replace it")
    path = gguf_source(source)
    if path is None:
        raise MlxspecError(f"{source}: not a GGUF file, a folder holding one, ollama:NAME or a "
                           "named model")
    convert_gguf(path, target, weights=weights)
    click.echo(str(target))
