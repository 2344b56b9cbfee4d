"""The adaptive policy's measurements kept between processes: snapshot, resume, the file."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

import mlxspec
from mlxspec.policy import AdaptiveK, read_states, write_states


def measured() -> AdaptiveK:
    policy = AdaptiveK(max_k=8)
    policy.observe_plain(4, 0.4)
    for _ in range(40):  # a 4-gram arm whose first 6 positions are always accepted
        policy.observe("ngram:4", 8, 6, 0.15)
        policy.observe("ngram:1", 2, 0, 0.11)
    return policy


def test_resume_starts_from_the_measurements_scaled_down():
    state = json.loads(json.dumps(measured().snapshot()))  # it survives JSON
    fresh, resumed = AdaptiveK(max_k=8), AdaptiveK(max_k=8)
    assert resumed.resume(state, weight=8.0)
    # The prior proposes a few tokens; the resumed policy knows how far 4-gram matches go.
    assert resumed.choose("ngram:4") == 6 > fresh.choose("ngram:4")  # 6 always accepted
    assert resumed.choose("ngram:1") == 0 < fresh.choose("ngram:1")
    # Scaled to 8 observations: this process's own measurements take over quickly.
    assert resumed.sources["ngram:4"].reached[0] == pytest.approx(8.0)
    assert resumed.costs["ngram"].w == pytest.approx(8.0)
    # The plain rate is measured again before the first proposal.
    assert resumed.plan({"ngram:4": 8}) == ("", 0)


@pytest.mark.parametrize("bad", [{"version": 99}, {"version": 1, "sources": 3},
                                 {"version": 1, "sources": {}, "costs": {"ngram": [1]},
                                  "plain": [0.1, 1]}])
def test_resume_refuses_other_snapshots_and_changes_nothing(bad):
    policy = measured()
    before = policy.snapshot()
    assert not policy.resume(bad)
    assert policy.snapshot() == before


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
    state = read_states(files[0])["auto"]
    assert state["sources"] and state["plain"][0] > 0
    # The next engine on this model starts from it.
    engine = mlxspec.load(str(model_dirs["llama"]), mode="auto")
    engine.keep_policies(files[0])
    policy = engine.policy_for(engine.proposer)
    assert set(policy.sources) == set(state["sources"])
