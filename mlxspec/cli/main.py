"""Entry point: `mlxspec COMMAND`."""

from __future__ import annotations

import logging
import sys

import click

import mlxspec  # noqa: F401  (BLAS set-up before mlx.core)

from .generate import generate


def quiet_transformers() -> None:
    """transformers warns "Token indices sequence length is longer than the specified maximum
    sequence length ... will result in indexing errors" whenever a tokenizer encodes more tokens
    than its model_max_length, before mlxspec's own check says the same cleanly (or when the
    text is encoded for a purpose other than a forward). Silence that logger; its errors still
    show."""
    logging.getLogger("transformers.tokenization_utils_base").setLevel(logging.ERROR)


class MlxspecGroup(click.Group):
    """click's group, with usage errors (`--mode banana`, an unknown option, a missing value)
    reported as one `error: ...` line on stderr and exit code 2, as mlxspec's own errors are."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.UsageError as e:
            if type(e).__name__ == "NoArgsIsHelpError":  # `mlxspec` alone: the help
                e.show()
                sys.exit(e.exit_code)
            where = e.ctx.command_path if e.ctx is not None else "mlxspec"
            click.echo(f"error: {e.format_message()} (see `{where} --help`)", err=True)
            sys.exit(2)
        except click.ClickException as e:
            click.echo(f"error: {e.format_message()}", err=True)
            sys.exit(e.exit_code)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        # Without standalone mode click returns the command's value, or the code of an
        # explicit exit (--help, --version): commands here return None.
        sys.exit(rv if isinstance(rv, int) else 0)


@click.group(cls=MlxspecGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(mlxspec.__version__, prog_name="mlxspec")
def main():
    """mlxspec: lossless speculative decoding for local LLMs on MLX."""
    quiet_transformers()


@main.command()
def doctor():
    """Report the backend, BLAS, versions and where the bundled models are."""
    import json

    from .. import backend

    info = backend.machine_info()
    from ..models import bundled_model_path

    for which in ("target", "draft"):
        try:
            info[f"bundled_{which}"] = str(bundled_model_path(which))
        except Exception as e:  # the report must not fail on a missing model
            info[f"bundled_{which}"] = f"missing ({e})"
    for warning in getattr(backend, "blas_warnings", []):
        info.setdefault("warnings", []).append(warning)
    click.echo(json.dumps(info, indent=2))


main.add_command(generate)

for _name in ("chat", "edit", "serve", "bench", "convert", "quantize", "train", "models"):
    # Commands that live in their own modules join when present.
    try:
        _module = __import__(f"mlxspec.cli.{_name}", fromlist=[_name])
    except ModuleNotFoundError as e:
        if e.name != f"mlxspec.cli.{_name}":
            raise
        continue
    main.add_command(getattr(_module, _name))

if __name__ == "__main__":
    main(prog_name="mlxspec")
