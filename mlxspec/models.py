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


def model_pair_paths(path: str | os.PathLike | None) -> tuple[Path, Path] | None:
    """(target, draft) when `path` is a folder holding a model pair, as `mlxspec train --out`
    writes it and as `models/` ships: `target/` and `draft/`, each an mlx-lm model folder
    (config.json and *.safetensors), and no config.json of its own (a model folder that
    happens to contain such subfolders is a model, not a pair). None otherwise, also for
    None (the bundled pair is `bundled_model_path`'s business) and for paths that do not
    exist: the caller then goes on with its other resolutions (a model folder, a repo id)."""
    if path is None:
        return None
    p = Path(path).expanduser()
    try:
        if not p.is_dir() or (p / "config.json").exists():
            return None
        target, draft = p / "target", p / "draft"
        if _is_model_dir(target) and _is_model_dir(draft):
            return target, draft
    except OSError:  # unreadable: let the loader report it
        return None
    return None


def describe_pair_problem(path: str | os.PathLike) -> str | None:
    """Why a folder that looks meant as a pair (it has `target/` or `draft/`) is not one, for
    an error message; None when it does not look like a pair at all."""
    p = Path(path).expanduser()
    if not p.is_dir() or (p / "config.json").exists():
        return None
    parts = {name: p / name for name in MODELS if (p / name).is_dir()}
    if not parts:
        return None
    problems = []
    for name in MODELS:
        sub = p / name
        if name not in parts:
            problems.append(f"{sub} is missing")
        elif not (sub / "config.json").is_file():
            problems.append(f"{sub} has no config.json")
        elif not any(sub.glob("*.safetensors")):
            problems.append(f"{sub} has no *.safetensors weights")
    if not problems:
        return None
    return (f"{p} looks like a model pair (target/ and draft/, as `mlxspec train --out` "
            f"writes) but {'; '.join(problems)}")
