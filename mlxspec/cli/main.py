"""Entry point: `mlxspec COMMAND`."""

from __future__ import annotations

import click

import mlxspec  # noqa: F401  (BLAS set-up before mlx.core)

from .generate import generate


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(mlxspec.__version__, prog_name="mlxspec")
def main():
    """mlxspec: lossless speculative decoding for local LLMs on MLX."""


@main.command()
def doctor():
    """Report the backend, BLAS, versions and where the bundled models are."""
    import json

    from .. import backend

    info = backend.machine_info()
    try:
        from ..models import bundled_model_path

        info["bundled_target"] = str(bundled_model_path("target"))
    except Exception as e:  # the report must not fail on a missing model
        info["bundled_target"] = f"missing ({e})"
    click.echo(json.dumps(info, indent=2))


main.add_command(generate)

for _name in ("chat", "edit", "serve", "bench", "quantize", "train"):
    # Commands that live in their own modules join when present.
    try:
        _module = __import__(f"mlxspec.cli.{_name}", fromlist=[_name])
    except ModuleNotFoundError as e:
        if e.name != f"mlxspec.cli.{_name}":
            raise
        continue
    main.add_command(getattr(_module, _name))

if __name__ == "__main__":
    main()
