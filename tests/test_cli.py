"""`mlxspec generate` on local model directories, and clear errors (exit code 2) for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

import mlxspec
from mlxspec.cli.main import main
from mlxspec.errors import MlxspecError


def run(*args):
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


@pytest.mark.parametrize("mode", ["none", "ngram", "draft"])
def test_generate_json(model_dirs, mode):
    args = ["generate", "--model", str(model_dirs["llama"]), "--mode", mode,
            "--prompt", "def f(x): return x + x + x + x", "--max-tokens", "12", "--json"]
    if mode == "draft":
        args += ["--draft-model", str(model_dirs["llama-draft"])]
    code, out = run(*args)
    assert code == 0, out
    data = json.loads(out)
    assert data["mode"] == mode and isinstance(data["text"], str) and 0 < len(data["tokens"]) <= 12
    for key in ("prompt_tokens", "generated_tokens", "target_forwards", "drafted", "accepted",
                "acceptance_rate", "mean_accepted_length", "prompt_tps", "generation_tps",
                "peak_memory_gb"):
        assert key in data["stats"]
    if mode == "none":
        assert data["stats"]["drafted"] == 0


def test_modes_agree_through_the_cli(model_dirs):
    outs = []
    for mode in ("none", "ngram", "draft"):
        code, out = run("generate", "-m", str(model_dirs["qwen2"]), "--mode", mode,
                        "--draft-model", str(model_dirs["qwen2"]), "-p", "x = [1, 2, 3, 1, 2, 3",
                        "--max-tokens", "16", "--json")
        assert code == 0, out
        outs.append(json.loads(out)["tokens"])
    assert outs[0] == outs[1] == outs[2]


def test_streaming_output_has_summary_line(model_dirs):
    result = CliRunner().invoke(main, ["generate", "-m", str(model_dirs["llama"]), "-p", "import",
                                       "--max-tokens", "5"])
    assert result.exit_code == 0
    assert "tok/s" in result.stderr and "mode auto" in result.stderr  # the default mode


BAD = {
    "unknown model path": (["-m", "/no/such/model"], "no such model directory"),
    "max tokens": (["--max-tokens", "0"], "error: --max-tokens must be >= 1, got 0"),
    "negative temperature": (["--temp", "-1"], "error: --temp must be >= 0, got -1.0"),
    "top-p zero": (["--top-p", "0"], "error: --top-p must be in (0, 1], got 0.0"),
    "top-p above one": (["--top-p", "1.5"], "error: --top-p must be in (0, 1], got 1.5"),
    "num draft zero": (["-k", "0"], "error: --num-draft-tokens/-k must be between 1 and 64, got 0"),
    "num draft 65": (["-k", "65"], "error: --num-draft-tokens/-k must be between 1 and 64"),
    "negative top-k": (["--top-k", "-1"], "error: --top-k must be >= 0, got -1"),
    "window zero": (["--mode", "lookahead", "--window", "0"], "error: --window must be >= 1"),
    "ngram size one": (["--ngram-size", "1"], "error: --ngram-size must be >= 2"),
    "tree budget zero": (["--tree", "--tree-budget", "0"], "error: --tree-budget must be >= 1"),
    "buffer below 2G": (["--mode", "quantspec", "--buffer-size", "64"],
                        "error: --buffer-size must be at least 2 x --group-size = 128 tokens"),
    "empty prompt": (["-p", ""], "the prompt is empty"),
    "prompt too long": (["-p", "word " * 2000], "but the model's context is 512 tokens"),
    "draft without model": (["--mode", "draft"], "needs a draft model"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_exits_2_with_a_message(model_dirs, case):
    extra, message = BAD[case]
    args = ["generate", "-m", str(model_dirs["llama"]), "-p", "hello", "--max-tokens", "4"]
    code, out = run(*args, *extra)
    assert code == 2, out
    assert message in out and "Traceback" not in out


def test_unknown_mode_is_rejected(model_dirs):
    code, out = run("generate", "-m", str(model_dirs["llama"]), "-p", "x", "--mode", "magic")
    assert code == 2 and "magic" in out


def test_draft_with_other_tokenizer_is_rejected(model_dirs):
    code, out = run("generate", "-m", str(model_dirs["llama"]), "--mode", "draft",
                    "--draft-model", str(model_dirs["other-tokenizer"]), "-p", "x")
    assert code == 2
    assert "does not share the tokenizer" in out or "vocabulary size" in out
    assert str(model_dirs["other-tokenizer"]) in out and str(model_dirs["llama"]) in out


def test_api_errors(model_dirs):
    with pytest.raises(MlxspecError, match="unknown mode"):
        mlxspec.load(str(model_dirs["llama"]), mode="magic")
    engine = mlxspec.load(str(model_dirs["llama"]), mode="ngram")
    with pytest.raises(MlxspecError, match="max_tokens"):
        engine.generate("x", max_tokens=0)
    with pytest.raises(MlxspecError, match="empty"):
        engine.generate([], max_tokens=3)
    result = engine.generate([5, 6, 7, 5, 6], max_tokens=3)  # raw token ids are accepted
    assert len(result.tokens) == 3


def test_offline_repo_id_says_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(MlxspecError, match="not in the local Hugging Face cache"):
        mlxspec.load("some-org/some-model-that-is-not-cached")


def test_real_process_exit_code(model_dirs):
    proc = subprocess.run([sys.executable, "-m", "mlxspec.cli.main", "generate", "-m",
                           str(model_dirs["llama"]), "-p", "x", "--top-p", "2"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "error: --top-p must be in (0, 1]" in proc.stderr and "Traceback" not in proc.stderr
