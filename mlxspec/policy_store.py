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

import numpy as np

from .cost import BASE, StepCost
from .policy import AdaptiveK, SourceEstimate

log = logging.getLogger("mlxspec")
COST_KEY = "step-cost"  # the cost model's entry (no mode has this name)
# the versions of the two states' layouts: another version is ignored, not misread
COST_VERSION, POLICY_VERSION = 1, 2


def resume(path: Path | None, cost: StepCost, policies) -> None:
    """The cost model and the adaptive policies (`policies`: (key, policy) pairs) that have
    measured nothing yet start from their states kept at `path` (None: nothing kept)."""
    states = read_states(path) if path is not None else {}
    if not cost.seconds and states.get(COST_KEY):
        resume_cost(cost, states[COST_KEY])
    for key, policy in policies:
        if isinstance(policy, AdaptiveK) and not policy.sources and states.get(key):
            resume_policy(policy, states[key])


def save(path: Path | None, cost: StepCost, policies) -> None:
    """Keep what the cost model and the adaptive policies ((key, policy) pairs) measured at
    `path` (None: nowhere)."""
    states = {key: policy_state(policy) for key, policy in policies
              if isinstance(policy, AdaptiveK) and policy.sources}
    if states and cost.seconds:
        states[COST_KEY] = cost_state(cost)
    if states and path is not None:
        try:
            write_states(path, states)
        except OSError as e:  # measurements only: never fail a command over them
            log.warning("could not keep the policy at %s (%s)", path, e)


def cost_state(cost: StepCost) -> dict:
    """What the cost model measured, as JSON-able data (`resume_cost`)."""
    cost.fold()
    return {"version": COST_VERSION, "groups": list(cost.groups), "xx": cost.xx.tolist(),
            "xt": cost.xt.tolist(),
            "seconds": [cost.seconds, cost.prior_seconds]}


def resume_cost(cost: StepCost, state: dict, weight: float = 8.0) -> bool:
    """`cost` starts from a `cost_state`, scaled down to at most `weight` steps so that this
    process's measurements soon take over. False, nothing changed, on a bad shape."""
    try:
        if state.get("version") != COST_VERSION:
            return False
        groups = [str(g) for g in state["groups"]]
        xx, xt = np.array(state["xx"], dtype=float), np.array(state["xt"], dtype=float)
        n = BASE + len(groups)
        seconds, prior_seconds = (float(x) for x in state["seconds"][:2])
        if xx.shape != (n, n) or xt.shape != (n,) or not np.isfinite(xx).all():
            return False
    except (KeyError, TypeError, ValueError, AttributeError):
        return False
    scale = min(1.0, weight / xx[0, 0]) if xx[0, 0] > 0 else 1.0
    cost.restore(groups, xx * scale, xt * scale, seconds * scale, prior_seconds * scale)
    return True


def policy_state(policy: AdaptiveK) -> dict:
    """What an adaptive policy measured (its sources' acceptance), as JSON-able data."""
    return {"version": POLICY_VERSION,
            "sources": {a: [e.reached, e.accepted] for a, e in policy.sources.items()}}


def resume_policy(policy: AdaptiveK, state: dict, weight: float = 8.0) -> bool:
    """`policy` starts from a `policy_state`, scaled down to at most `weight` observations.
    False, nothing changed, on a bad shape."""
    try:
        if state.get("version") != POLICY_VERSION:
            return False
        sources = {}
        for arm, (reached, accepted) in state["sources"].items():
            reached = [float(x) for x in reached][: policy.max_k]
            accepted = [float(x) for x in accepted][: len(reached)]
            count = reached[0] if reached else 0
            scale = min(1.0, weight / count) if count > 0 else 1.0
            sources[str(arm)] = SourceEstimate([x * scale for x in reached],
                                               [x * scale for x in accepted])
    except (KeyError, TypeError, ValueError, IndexError, AttributeError):
        return False
    policy.restore(sources)
    return True


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
