"""mlxspec: lossless speculative decoding for local LLMs on MLX."""

from .backend import full_float32 as _full_float32
from .backend import setup_blas as _setup_blas

# Must happen before anything imports mlx.core (see backend.py).
_setup_blas()
_full_float32()

__version__ = "0.1.0"
__all__ = ["load", "Engine", "GenerationResult", "Stats", "__version__"]


def __getattr__(name):
    # Lazy so that `import mlxspec` stays cheap and the BLAS set-up above runs first.
    if name == "load":
        from .loading import load

        return load
    if name in ("Engine", "GenerationResult", "Stats"):
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'mlxspec' has no attribute {name!r}")
