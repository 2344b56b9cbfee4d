"""What the adaptive policies and the cost model measured, kept between processes: one JSON
file per model and machine (`cli.common.policy_file`), read when an engine's policies start
(`resume`), merged into at exit (`save`). It holds measurements only: a damaged file is
warned about and ignored, a failed write never fails a command.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from .policy import AdaptiveK

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger("mlxspec")
COST_KEY = "step-cost"  # the cost model's entry (no mode has this name)


def keep(engine: Engine, path: Path | None) -> None:
    """Start `engine`'s adaptive policies from what earlier processes kept at `path`, and keep
    this one's there (`save`)."""
    engine.policy_file = path
    resume(engine)


def resume(engine: Engine) -> None:
    """The engine's adaptive policies and cost model that have measured nothing yet start from
    their kept states."""
    states = read_states(engine.policy_file) if engine.policy_file is not None else {}
    if not engine.cost.seconds and states.get(COST_KEY):
        engine.cost.resume(states[COST_KEY])
    for key, policy in engine.policies.values():
        if isinstance(policy, AdaptiveK) and not policy.sources and states.get(key):
            policy.resume(states[key])


def save(engine: Engine) -> None:
    """Keep what the engine's adaptive policies measured at its `policy_file`."""
    states = {key: policy.snapshot() for key, policy in engine.policies.values()
              if isinstance(policy, AdaptiveK) and policy.sources}
    if states and engine.cost.seconds:
        states[COST_KEY] = engine.cost.snapshot()
    if states and engine.policy_file is not None:
        try:
            write_states(engine.policy_file, states)
        except OSError as e:  # measurements only: never fail a command over them
            log.warning("could not keep the policy at %s (%s)", engine.policy_file, e)


def read_states(path: Path) -> dict[str, dict]:
    """The policies' snapshots at `path`, by mode; {} if none (a damaged file is only warned
    about: it holds nothing but measurements)."""
    try:
        data = json.loads(Path(path).read_text())
        states = data["policies"]
        if not isinstance(states, dict):
            raise TypeError("policies is not an object")
        return states
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("ignoring the policy file %s (%s)", path, e)
        return {}


def write_states(path: Path, states: dict[str, dict]) -> None:
    """Merge `states` into `path` (written whole, then renamed: never seen half written)."""
    path = Path(path)
    merged = {**read_states(path), **states}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"policies": merged}))
    os.replace(tmp, path)
