"""The three uses on the real Qwen2.5-Coder-0.5B (fetched by .ci/run; the 1.5B's pair works the
same way, it is only larger): `mlxspec serve`'s `/infill` in llama.vim's request shape, the
OpenAI FIM `suffix`, and chat; `mlxspec chat` with its statistics line."""

from __future__ import annotations

import json
import sys

import pytest
from server_helpers import post, start, stop

pytestmark = pytest.mark.slow
MODEL = "qwen2.5-coder-0.5b"

PREFIX = '''import json
from pathlib import Path


def load_settings(path):
    """Read a JSON settings file; missing keys take their defaults."""
    defaults = {"width": 80, "indent": 4}
'''
SUFFIX = '''    return settings


def save_settings(path, settings):
    Path(path).write_text(json.dumps(settings, indent=2))
'''
EXTRA = [{"filename": "app/defaults.py", "text": "WIDTH = 80\nINDENT = 4\n"}]


@pytest.fixture(scope="module")
def engine(coder_small):
    from mlxspec.engine import Engine

    return Engine(coder_small.model, coder_small.tokenizer, mode="auto", name=MODEL)


@pytest.fixture(scope="module")
def server(engine):
    srv = start(engine)
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    stop(srv)


def llama_vim_body(prompt: str, **extra) -> dict:
    """What llama.vim sends for a cursor at the end of `prompt` (its `s:fim_request`)."""
    return {"input_prefix": PREFIX, "input_suffix": SUFFIX, "prompt": prompt,
            "input_extra": EXTRA, "n_predict": 24, "n_indent": 4, "top_k": 40, "top_p": 0.99,
            "stream": False, "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True,
            "t_max_prompt_ms": 500, "t_max_predict_ms": 1000,
            "response_fields": ["content", "timings/prompt_n", "timings/predicted_n",
                                "timings/draft_n", "timings/draft_n_accepted", "truncated",
                                "tokens_cached"], **extra}


def test_infill_in_llama_vims_shape_is_plain_decoding_and_reuses_the_prompt(server, engine):
    status, payload, _ = post(server, "/infill", llama_vim_body("    settings = "))
    assert status == 200, payload
    first = json.loads(payload)
    assert set(first) <= {"content", "timings/prompt_n", "timings/predicted_n",
                          "timings/draft_n", "timings/draft_n_accepted", "truncated",
                          "tokens_cached"}
    assert first["content"].strip(), first
    # The same request in mode none gives the same text (speculation is exact).
    status, payload, _ = post(server, "/infill", llama_vim_body(
        "    settings = ", speculative={"mode": "none"}, cache_prompt=False))
    assert json.loads(payload)["content"] == first["content"]
    # The next keystroke: the prompt cache holds everything before the cursor.
    status, payload, _ = post(server, "/infill", llama_vim_body("    settings = dict"))
    again = json.loads(payload)
    assert status == 200 and again["timings/prompt_n"] < 40, again


def test_openai_fim_suffix_and_chat(server):
    status, payload, _ = post(server, "/v1/completions", {
        "prompt": PREFIX + "    settings = ", "suffix": SUFFIX, "max_tokens": 16,
        "temperature": 0})
    assert status == 200, payload
    assert json.loads(payload)["choices"][0]["text"].strip()
    status, payload, _ = post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Write a Python one-liner that reverses "
                      "a string s."}], "max_tokens": 32, "temperature": 0})
    assert status == 200, payload
    answer = json.loads(payload)["choices"][0]["message"]["content"]
    assert "[::-1]" in answer, answer


def test_mlxspec_chat_on_the_real_coder(tmp_path):
    """`mlxspec chat -m` the coder: a reply, then its statistics line."""
    import os

    pexpect = pytest.importorskip("pexpect")
    env = dict(os.environ, MLXSPEC_HISTORY=str(tmp_path / "history"), TERM="dumb",
               COLUMNS="200")
    child = pexpect.spawn(sys.executable, ["-m", "mlxspec.cli.main", "chat", "-m", MODEL,
                                           "--max-tokens", "24"], env=env, cwd=str(tmp_path),
                          encoding="utf-8", timeout=240, dimensions=(50, 200))
    try:
        child.expect(r"loaded .* parameters")
        child.expect_exact(">>> ")
        child.sendline("How do I reverse a list xs in Python? Code only.")
        child.expect(r"tok/s.* mode auto")  # the statistics line after the reply
        assert "reverse" in child.before or "[::-1]" in child.before, child.before
        child.expect_exact(">>> ")
        child.sendline("/quit")
        child.expect(pexpect.EOF, timeout=60)
    finally:
        child.close(force=True)


def test_mlxspec_edit_performs_a_real_rename(tmp_path):
    """`mlxspec edit --write` on the real coder: the file written holds code only (no prose, no
    fences), parses, and has the rename."""
    import ast
    import subprocess

    path = tmp_path / "stats.py"
    path.write_text(
        "def summarize(values):\n"
        "    total = 0\n"
        "    for v in values:\n"
        "        total += v\n"
        "    mean = total / len(values)\n"
        '    print("total:", total)\n'
        "    return total, mean\n")
    run = subprocess.run(
        [sys.executable, "-m", "mlxspec.cli.main", "edit", str(path), "-i",
         "rename the variable total to acc", "-m", MODEL, "--write"],
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    text = path.read_text()
    tree = ast.parse(text)
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert "acc" in names and "total" not in names, text
    assert "```" not in text and (tmp_path / "stats.py.orig").exists()
