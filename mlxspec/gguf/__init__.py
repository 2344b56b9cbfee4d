"""GGUF models: where the files come from, their tokenizer, and converting their weights to MLX.

`model_folder(spec)` is the one entry point `loading.py` uses: a GGUF file, a folder holding one,
`ollama:NAME[:TAG]` or a named model (`smollm2`) → the converted mlx-lm folder (cached).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import MlxspecError


def gguf_source(spec: str, *, quiet: bool = False) -> Path | None:
    """The GGUF file `spec` names, or None when `spec` is not a GGUF source (a model folder,
    a Hugging Face id). Named models are fetched here."""
    from .convert import is_gguf_file
    from .sources import is_named_model, is_ollama_spec, named_model_gguf, ollama_gguf

    if is_ollama_spec(spec):
        return ollama_gguf(spec)
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix == ".gguf" or is_gguf_file(path):
            return path
        raise MlxspecError(f"{spec}: not a model directory or a GGUF file")
    if path.is_dir() and not (path / "config.json").exists():
        files = sorted(path.glob("*.gguf"))
        if len(files) == 1:
            return files[0]
        if len(files) > 1:
            names = ", ".join(f.name for f in files[:8])
            raise MlxspecError(f"{spec}: holds several GGUF files ({names}): pass one of them")
        return None
    if not path.exists() and is_named_model(spec):
        return named_model_gguf(spec, quiet=quiet)
    return None


def model_folder(spec: str, *, weights: str | None = None, quiet: bool = False) -> Path | None:
    """The mlx-lm folder for a GGUF source (converted once, cached), or None if `spec` is not
    one."""
    from .convert import cached_conversion

    source = gguf_source(spec, quiet=quiet)
    if source is None:
        return None
    return cached_conversion(source, weights=weights, quiet=quiet)
