"""`mlxspec serve`: an OpenAI- and llama.cpp-compatible local HTTP server (see the README, "Serving editors and chat clients")."""

from __future__ import annotations

__all__ = ["make_server", "MlxspecServer"]


def __getattr__(name):
    if name in __all__:
        from . import app

        return getattr(app, name)
    raise AttributeError(f"module 'mlxspec.server' has no attribute {name!r}")
