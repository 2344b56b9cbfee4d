"""The adaptive policy's measurements kept between processes: snapshot, resume, the file."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, observe_plain, observe_step

import mlxspec
from mlxspec.cost import StepCost
from mlxspec.policy import AdaptiveK
from mlxspec.policy_store import (
    cost_state,
    policy_state,
    read_states,
    resume_cost,
    resume_policy,
    write_states,
)


def measured() -> AdaptiveK:
    policy = AdaptiveK(max_k=8)
    observe_plain(policy, 4, 0.4)
    for _ in range(40):  # a 4-gram arm whose first 6 positions are always accepted
        observe_step(policy, "ngram:4", 8, 6, 0.15)
        observe_step(policy, "ngram:1", 2, 0, 0.11)
    return policy


def test_resume_starts_from_the_measurements_scaled_down():
    before = measured()
    state = json.loads(json.dumps(policy_state(before)))  # it survives JSON
    cost = StepCost()
    assert resume_cost(cost, json.loads(json.dumps(cost_state(before.cost))), weight=8.0)
    fresh, resumed = AdaptiveK(max_k=8), AdaptiveK(max_k=8, cost=cost)
    assert resume_policy(resumed, state, weight=8.0)
    # The prior proposes a few tokens; the resumed policy knows how far 4-gram matches go.
    assert resumed.choose("ngram:4") == 6 > fresh.choose("ngram:4")  # 6 always accepted
    assert resumed.choose("ngram:1") == 0 < fresh.choose("ngram:1")
    # Scaled to 8 observations: this process's own measurements take over quickly.
    assert resumed.sources["ngram:4"].reached[0] == pytest.approx(8.0)
    assert cost.xx[0, 0] == pytest.approx(8.0)
    # ... and it predicts what was measured (its prior counts a little more now)
    assert cost.time(1, 9, 8) == pytest.approx(0.15, rel=0.05)
    assert cost.plain() == pytest.approx(0.1, rel=0.2)


@pytest.mark.parametrize("bad", [{"version": 99}, {"version": 1, "sources": 3},
                                 {"version": 2, "sources": 3},
                                 {"version": 1, "sources": {}, "costs": {"ngram": [1]},
                                  "plain": [0.1, 1]}])
def test_resume_refuses_other_snapshots_and_changes_nothing(bad):
    policy = measured()
    before = policy_state(policy)
    assert not resume_policy(policy, bad)
    assert policy_state(policy) == before


@pytest.mark.parametrize("bad", [{"version": 2}, {"version": 1, "groups": [], "xx": [[1.0]],
                                                  "xt": [1.0], "seconds": [1, 1, 1]},
                                 {"version": 1, "groups": ["draft"], "xx": "x", "xt": [],
                                  "seconds": [1, 1, 1]}])
def test_the_cost_model_refuses_other_snapshots_and_changes_nothing(bad):
    cost = measured().cost
    before = json.dumps(cost_state(cost))
    assert not resume_cost(cost, bad)
    assert json.dumps(cost_state(cost)) == before


def test_the_file_merges_modes_and_a_damaged_one_is_ignored(tmp_path, caplog):
    path = tmp_path / "p" / "model.json"
    write_states(path, {"auto": {"version": 1}})
    write_states(path, {"ngram": {"version": 1}})
    assert set(read_states(path)) == {"auto", "ngram"}
    path.write_text("{not json")
    assert read_states(path) == {}
    assert "ignoring the policy file" in caplog.text
    assert read_states(tmp_path / "missing.json") == {}


def test_a_command_keeps_its_policy_for_the_next_run(model_dirs, tmp_path):
    env = {**os.environ, "MLXSPEC_CACHE": str(tmp_path), "MLXSPEC_POLICY_CACHE": "1"}
    cmd = [sys.executable, "-m", "mlxspec.cli.main", "generate", "-m", str(model_dirs["llama"]),
           "--mode", "auto", "--max-tokens", "48", "-p", "a b c d a b c d a b c d a b c d"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert run.returncode == 0, run.stderr
    files = list((tmp_path / "policy").glob("*.json"))
    assert len(files) == 1
    states = read_states(files[0])
    state = states["auto"]
    assert state["sources"] and states["step-cost"]["seconds"][0] > 0
    # The next engine on this model starts from it.
    engine = mlxspec.load(str(model_dirs["llama"]), mode="auto")
    engine.keep_policies(files[0])
    policy = engine.policy_for(engine.proposer)
    assert set(policy.sources) == set(state["sources"])
    assert policy.cost is engine.cost and engine.cost.seconds > 0
