"""Where the bundled target + draft pair lives.

Resolution order for `bundled_model_path(which)`:
1. `$MLXSPEC_MODELS_DIR/<which>` when MLXSPEC_MODELS_DIR is set (and nothing else if it is set
   but lacks the model, so a wrong setting is reported, not silently bypassed);
2. `models/<which>` at the repository root, next to the `mlxspec/` package (a source checkout
   or an editable install);
3. `<prefix>/share/mlxspec/models/<which>`, where a wheel installs them (pyproject's
   `[tool.setuptools.data-files]`), for sys.prefix, the sysconfig data path and the user base.
"""

from __future__ import annotations

import os
import site
import sys
import sysconfig
from pathlib import Path

MODELS = ("target", "draft")
ENV_VAR = "MLXSPEC_MODELS_DIR"


def _is_model_dir(p: Path) -> bool:
    return (p / "config.json").is_file() and any(p.glob("*.safetensors"))


def candidate_dirs() -> list[Path]:
    """The folders searched for `target/` and `draft/`, in order."""
    env = os.environ.get(ENV_VAR)
    if env:
        return [Path(env).expanduser()]
    dirs = [Path(__file__).resolve().parent.parent / "models"]
    prefixes = [sys.prefix, sysconfig.get_paths().get("data", sys.prefix), sys.base_prefix]
    try:
        prefixes.append(site.getuserbase())
    except Exception:  # pragma: no cover - site without a user base
        pass
    for pre in prefixes:
        d = Path(pre) / "share" / "mlxspec" / "models"
        if d not in dirs:
            dirs.append(d)
    return dirs


def bundled_model_path(which: str = "target") -> Path:
    """The folder of the bundled `target` or `draft` model (mlx-lm format)."""
    if which not in MODELS:
        raise ValueError(f"which must be one of {MODELS}, got {which!r}")
    dirs = candidate_dirs()
    for d in dirs:
        if _is_model_dir(d / which):
            return d / which
    searched = ", ".join(str(d / which) for d in dirs)
    raise FileNotFoundError(
        f"the bundled {which} model was not found (searched: {searched}). Install mlxspec from "
        "a source checkout or a wheel that includes models/, point MLXSPEC_MODELS_DIR at a folder "
        "holding target/ and draft/, or train the pair yourself with "
        "`python -m mlxspec.recipe --out models` (see models/README.md)."
    )


def bundled_models_available() -> bool:
    try:
        bundled_model_path("target")
        bundled_model_path("draft")
    except FileNotFoundError:
        return False
    return True
