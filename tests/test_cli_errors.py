"""What a newcomer sees when something is off (issue 19): one `error:` line and exit code 2 for
every usage error, numeric options checked before any model loads and named as typed, a JSON
refusal from `edit --json`, a word when the context cut an answer, no transformers noise."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from mlxspec.cli.main import main


def invoke(*args):
    return CliRunner().invoke(main, list(args))


def mlxspec_process(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "mlxspec.cli.main", *args], capture_output=True,
                          text=True, env=env, timeout=timeout)


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if a command gets as far as loading a model."""
    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr("mlxspec.loading.load", refuse)


USAGE_ERRORS = {
    "unknown mode": (["generate", "-p", "x", "--mode", "banana"], "'--mode': 'banana'"),
    "unknown option": (["generate", "-p", "x", "--bogus"], "No such option '--bogus'"),
    "missing value": (["generate", "-p"], "Option '-p' requires an argument"),
    "not a number": (["generate", "-p", "x", "--max-tokens", "many"], "'many' is not a valid integer"),
    "unknown command": (["nope"], "No such command 'nope'"),
    "edit without instruction": (["edit", "f.py"], "Missing option '--instruction'"),
    "chat bad temp": (["chat", "--temp", "-0.5"], "--temp must be >= 0, got -0.5"),
    "edit bad lines value": (["edit", "f.py", "-i", "x", "--max-tokens", "0"],
                             "--max-tokens must be >= 1, got 0"),
    "bench bad prompts": (["bench", "--prompts", "0"], "--prompts must be >= 1, got 0"),
    "bench bad k": (["bench", "-k", "70"], "--num-draft-tokens/-k must be between 1 and 64"),
}


@pytest.mark.parametrize("case", list(USAGE_ERRORS))
def test_usage_errors_are_one_error_line_and_exit_2(case, no_model_load):
    args, message = USAGE_ERRORS[case]
    r = invoke(*args)
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert message in lines[0] and "Usage:" not in r.output
    assert r.stdout == ""


def test_usage_error_in_a_real_process():
    proc = mlxspec_process("generate", "--mode", "banana", "-p", "x")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "error: Invalid value for '--mode': 'banana' is not one of 'none', 'ngram', 'draft', "
        "'quantspec', 'lookahead', 'suffix', 'auto'. (see `mlxspec generate --help`)"]


def test_help_and_version_still_exit_0():
    assert invoke("--version").exit_code == 0
    r = invoke("generate", "--help")
    assert r.exit_code == 0 and "Usage: main generate" in r.output


def test_numeric_options_are_checked_before_the_model_loads(no_model_load):
    # A model path that does not exist: the option error comes first, naming the flag.
    r = invoke("generate", "-m", "/no/such/model", "-p", "x", "--max-tokens", "0")
    assert r.exit_code == 2 and "error: --max-tokens must be >= 1" in r.stderr
    assert "max_tokens" not in r.stderr and "no such model" not in r.stderr
    r = invoke("generate", "-m", "/no/such/model", "-p", "x", "-k", "0")
    assert r.exit_code == 2 and "--num-draft-tokens/-k" in r.stderr and "num_draft" not in r.stderr


def test_bad_lines_is_refused_before_the_model_loads(tmp_path, no_model_load):
    path = tmp_path / "f.py"
    path.write_text("x = 1\ny = 2\n")
    r = invoke("edit", str(path), "-i", "rename x to z", "--lines", "5:9")
    assert r.exit_code == 2 and r.stderr.startswith("error: ") and "5:9" in r.stderr


def test_help_lists_options_in_declaration_order():
    out = invoke("generate", "--help").output
    order = ["--prompt", "--prompt-file", "--model", "--draft-model", "--mode",
             "--num-draft-tokens", "--max-tokens", "--temp", "--top-p", "--top-k", "--seed",
             "--json", "--tree", "--window", "--buffer-size"]
    flag_columns = [line.strip().split("  ")[0] for line in out.split("Options:")[1].splitlines()
                    if line.lstrip().startswith("-")]
    listed = [word.rstrip(",") for column in flag_columns for word in column.split()
              if word.startswith("--")]
    listed = [flag.split("/")[0] for flag in listed]
    assert [flag for flag in listed if flag in order] == order, out
    assert "at least 2G" in out  # --buffer-size says what the program accepts


@pytest.mark.parametrize("args,message", [
    (["--json"], "no such file"),
])
def test_edit_json_refusal_is_a_json_object_on_stdout(tmp_path, no_model_load, args, message):
    missing = tmp_path / "missing.py"
    r = invoke("edit", str(missing), "-i", "rename a to b", *args)
    assert r.exit_code == 2
    payload = json.loads(r.stdout)
    assert payload["path"] == str(missing) and message in payload["error"]
    assert payload["written"] is False
    assert r.stderr.startswith("error: ")


def test_edit_json_refusal_of_a_binary_file(tmp_path, no_model_load):
    path = tmp_path / "blob.py"
    path.write_bytes(b"\x7fELF\x00\x00binary")
    r = invoke("edit", str(path), "-i", "rename a to b", "--json", "--write")
    assert r.exit_code == 2 and "binary" in json.loads(r.stdout)["error"]
    assert path.read_bytes() == b"\x7fELF\x00\x00binary"


def test_doctor_lists_target_and_draft():
    info = json.loads(invoke("doctor").stdout)
    for which in ("target", "draft"):
        assert info[f"bundled_{which}"].endswith(which) or info[f"bundled_{which}"].startswith(
            "missing")
    assert info["bundled_draft"] != info["bundled_target"]


def test_missing_mlxspec_blas_warns():
    import os

    env = dict(os.environ, MLXSPEC_BLAS="/no/such/libblas.so.3")
    proc = mlxspec_process("doctor", env=env)
    assert proc.returncode == 0
    assert "warning: MLXSPEC_BLAS=/no/such/libblas.so.3: no such file" in proc.stderr
    assert "MLXSPEC_BLAS=/no/such/libblas.so.3" in json.loads(proc.stdout)["warnings"][0]
    proc = mlxspec_process("doctor")  # unset: no warning
    assert "warning" not in proc.stderr


# ----------------------------------------------------------------------------- generate


def test_generate_json_stats_and_context_cut(model_dirs):
    # The test models have a 512-token context; "a b " is 2 tokens of their tokenizer.
    prompt = "a b " * 120
    r = invoke("generate", "-m", str(model_dirs["llama"]), "-p", prompt, "--max-tokens", "300",
               "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    stats = data["stats"]
    for key in ("cached_tokens", "drafted_by_source", "accepted_by_source",
                "accepted_prediction_tokens", "acceptance_by_position", "generation_tps"):
        assert key in stats
    assert stats["prompt_tokens"] + stats["generated_tokens"] == 512
    assert stats["generated_tokens"] < 300
    assert data["context_exhausted"] is True and "context (512 tokens)" in data["warning"]
    assert "note: the model's context (512 tokens) ended the answer" in r.stderr
    assert sum(stats["drafted_by_source"].values()) == stats["drafted"]
    # Streaming: the same note on stderr, after the stats line.
    r = invoke("generate", "-m", str(model_dirs["llama"]), "-p", prompt, "--max-tokens", "300")
    assert r.exit_code == 0 and r.stderr.strip().splitlines()[-1].startswith("note: the model's")
    # Well inside the context: no note.
    r = invoke("generate", "-m", str(model_dirs["llama"]), "-p", "a b", "--max-tokens", "8",
               "--json")
    data = json.loads(r.stdout)
    assert data["context_exhausted"] is False and "warning" not in data and "note:" not in r.stderr


@pytest.mark.slow
def test_transformers_sequence_length_warning_is_silenced(model_dirs, tmp_path):
    model = tmp_path / "short-tokenizer-limit"
    shutil.copytree(model_dirs["llama"], model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["model_max_length"] = 16
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    prompt = "a b " * 20  # 40 tokens: over the tokenizer's 16, well inside the model's 512
    # Without mlxspec's set-up the tokenizer does warn (so the check below can fail).
    probe = subprocess.run([sys.executable, "-c", (
        "import sys; from mlx_lm import load; m, t = load(sys.argv[1]); t.encode(sys.argv[2])"),
        str(model), prompt], capture_output=True, text=True, timeout=120)
    assert "indexing errors" in probe.stderr
    proc = mlxspec_process("generate", "-m", str(model), "-p", prompt, "--max-tokens", "4")
    assert proc.returncode == 0, proc.stderr
    assert "indexing errors" not in proc.stderr
