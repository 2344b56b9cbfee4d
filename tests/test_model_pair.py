"""A folder holding target/ and draft/ (what `mlxspec train --out` writes) is a model pair:
`-m FOLDER` loads the target as the model and the draft as the draft."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from mlxspec.cli.common import resolve_pair
from mlxspec.cli.main import main
from mlxspec.errors import MlxspecError
from mlxspec.models import describe_pair_problem, model_pair_paths


def fake_model(path):
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"")
    return path


def test_pair_detection(tmp_path):
    pair = tmp_path / "my-models"
    target, draft = fake_model(pair / "target"), fake_model(pair / "draft")
    assert model_pair_paths(pair) == (target, draft)
    assert model_pair_paths(str(pair)) == (target, draft)
    assert model_pair_paths(None) is None
    assert model_pair_paths(tmp_path / "nope") is None
    assert model_pair_paths(target) is None  # a model folder is a model, not a pair
    assert describe_pair_problem(pair) is None
    # A model folder that happens to hold such subfolders stays a model.
    (pair / "config.json").write_text("{}")
    assert model_pair_paths(pair) is None and describe_pair_problem(pair) is None


def test_pair_detection_with_home_and_links(tmp_path, monkeypatch):
    pair = tmp_path / "home" / "pair"
    fake_model(tmp_path / "t")
    fake_model(tmp_path / "d")
    pair.mkdir(parents=True)
    os.symlink(tmp_path / "t", pair / "target")
    os.symlink(tmp_path / "d", pair / "draft")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert model_pair_paths("~/pair") == (pair / "target", pair / "draft")


@pytest.mark.parametrize("make,problem", [
    (lambda p: fake_model(p / "target"), "draft is missing"),
    (lambda p: (fake_model(p / "draft"), (p / "target").mkdir()), "target has no config.json"),
    (lambda p: (fake_model(p / "draft"), fake_model(p / "target"),
                (p / "target" / "model.safetensors").unlink()), "has no *.safetensors"),
])
def test_incomplete_pair_is_explained(tmp_path, make, problem):
    pair = tmp_path / "pair"
    pair.mkdir()
    make(pair)
    assert model_pair_paths(pair) is None
    message = describe_pair_problem(pair)
    assert message is not None and problem in message and "mlxspec train" in message
    with pytest.raises(MlxspecError, match="looks like a model pair"):
        resolve_pair(str(pair), None, "ngram")


def test_resolve_pair_uses_the_draft_only_where_the_mode_does(tmp_path):
    pair = tmp_path / "pair"
    target, draft = fake_model(pair / "target"), fake_model(pair / "draft")
    assert resolve_pair(str(pair), None, "ngram") == (str(target), None, str(draft))
    assert resolve_pair(str(pair), None, "draft") == (str(target), str(draft), str(draft))
    assert resolve_pair(str(pair), "other", "draft") == (str(target), "other", str(draft))
    assert resolve_pair(str(target), None, "draft") == (str(target), None, None)
    assert resolve_pair(None, None, "draft") == (None, None, None)


@pytest.fixture
def pair_dir(model_dirs, tmp_path):
    pair = tmp_path / "my-models"
    pair.mkdir()
    os.symlink(model_dirs["llama"], pair / "target")
    os.symlink(model_dirs["llama-draft"], pair / "draft")
    return pair


def test_generate_with_a_pair_folder(pair_dir, model_dirs):
    prompt = "def f(x): return x + x + x"
    runs = {}
    for args in (["-m", str(pair_dir), "--mode", "draft"],
                 ["-m", str(model_dirs["llama"]), "--draft-model", str(model_dirs["llama-draft"]),
                  "--mode", "draft"],
                 ["-m", str(pair_dir), "--mode", "none"]):
        r = CliRunner().invoke(main, ["generate", *args, "-p", prompt, "--max-tokens", "10",
                                      "--json"])
        assert r.exit_code == 0, r.output
        runs[tuple(args)] = json.loads(r.stdout)
    pair_draft, explicit, plain = runs.values()
    assert pair_draft["mode"] == "draft" and pair_draft["stats"]["drafted"] > 0
    assert pair_draft["tokens"] == explicit["tokens"] == plain["tokens"]
    assert pair_draft["stats"]["drafted"] == explicit["stats"]["drafted"]
    assert pair_draft["model"] == str(pair_dir / "target")
