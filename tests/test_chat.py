"""`mlxspec chat`: the conversation keeps its KV cache between turns and stays exact; the
terminal program is driven through a real pseudo-terminal (pexpect)."""

from __future__ import annotations

import json
import os
import sys

import pytest
from conftest import REPO, build_model, save_model_dir, train_tiny_tokenizer

from mlxspec.chat_session import ChatSession, add_turn_end_tokens, render_chat
from mlxspec.engine import PromptCache
from mlxspec.loading import load

pexpect = pytest.importorskip("pexpect")

STATS = r"\d+ tokens · [\d.]+ tok/s · prompt \d+ new \+ \d+ cached"


# ----------------------------------------------------------------------------- the session


@pytest.mark.parametrize("mode", ["none", "ngram"])
def test_cached_turns_equal_a_fresh_prefill_of_the_conversation(model_dirs, mode):
    engine = load(str(model_dirs["llama"]), mode=mode)
    reference = load(str(model_dirs["llama"]), mode="none")
    add_turn_end_tokens(reference.tokenizer)
    session = ChatSession(engine, system="You are terse.", max_tokens=20)
    previous = 0  # tokens of the previous turn's prompt
    for i, message in enumerate(["hello", "what is a for loop?", "def f(x):\n    return x"]):
        conversation = session.conversation() + [{"role": "user", "content": message}]
        turn = session.reply(message)
        fresh = reference.generate(render_chat(reference.tokenizer, conversation), max_tokens=20,
                                   seed=i, prompt_cache=PromptCache())
        assert turn.tokens == fresh.tokens
        assert turn.text == fresh.text
        assert fresh.stats.cached_tokens == 0 and fresh.stats.prompt_tokens == turn.stats.prompt_tokens
        # Everything up to the previous reply came from the cache: only the new part prefilled.
        assert turn.stats.cached_tokens >= previous - 1
        previous = turn.stats.prompt_tokens
    assert session.totals.replies == 3 and session.totals.cached_tokens > 0
    assert [m["role"] for m in session.conversation()] == ["system"] + ["user", "assistant"] * 3


def test_session_interrupt_keeps_the_partial_reply_and_the_cache_exact(model_dirs):
    engine = load(str(model_dirs["llama"]), mode="ngram")
    session = ChatSession(engine, max_tokens=40)
    steps = session.send("tell me a long story")
    for _ in range(3):
        next(steps)
    steps.close()  # what Ctrl-C does between two steps
    assert session.last.interrupted and session.messages[-1]["role"] == "assistant"
    partial = session.messages[-1]["content"]
    conversation = session.conversation() + [{"role": "user", "content": "go on"}]
    turn = session.reply("go on")
    reference = load(str(model_dirs["llama"]), mode="none")
    add_turn_end_tokens(reference.tokenizer)
    fresh = reference.generate(render_chat(reference.tokenizer, conversation), max_tokens=40,
                               seed=1, prompt_cache=PromptCache())
    assert turn.tokens == fresh.tokens
    assert session.totals.interrupted == 1 and partial in render_chat(
        engine.tokenizer, session.conversation())


def test_reset_and_context_overflow(model_dirs):
    engine = load(str(model_dirs["llama"]), mode="none")
    session = ChatSession(engine, max_tokens=8)
    session.reply("hi")
    session.reset()
    assert session.conversation() == []
    # A conversation longer than the context (512 tokens here) drops its oldest exchanges.
    for i in range(8):
        session.reply(f"message {i}: " + "word " * 30)
    assert session.totals.replies == 9
    assert session.dropped > 0 and len(session.messages) == 16 - session.dropped
    assert session.messages[0]["content"].startswith(f"message {session.dropped // 2}:")
    assert all(t["prompt_tokens"] < 512 for t in session.turn_stats)


# ----------------------------------------------------------------------------- the terminal


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """A model with a long context, for a reply long enough to interrupt."""
    model, cfg = build_model("llama", seed=7, layers=2, vocab=300, scale=4.0, max_pos=8192)
    cfg["eos_token_id"] = 0
    d = save_model_dir(model, cfg, tmp_path_factory.mktemp("long") / "model")
    train_tiny_tokenizer(d, vocab=300)
    return d


def spawn_chat(model_dir, tmp_path, *args):
    env = dict(os.environ, HOME=str(tmp_path), MLXSPEC_HISTORY=str(tmp_path / "history"),
               TERM="dumb", PYTHONPATH=str(REPO), COLUMNS="200")
    child = pexpect.spawn(sys.executable, ["-m", "mlxspec.cli.main", "chat", "--model",
                                           str(model_dir), *args],
                          env=env, cwd=str(tmp_path), encoding="utf-8", timeout=60,
                          dimensions=(50, 200))
    child.expect(r"loaded .* parameters")
    child.expect_exact(">>> ")
    return child


def test_chat_terminal_session(model_dirs, tmp_path):
    child = spawn_chat(model_dirs["llama"], tmp_path, "--max-tokens", "24")
    try:
        # A reply streams and is followed by the stats line.
        child.sendline("hello there")
        child.expect(STATS + r".* tok/forward .* mode auto")  # the default mode
        child.expect_exact(">>> ")
        # /mode switches without reloading.
        child.sendline("/mode none")
        child.expect_exact("mode none")
        child.expect_exact(">>> ")
        child.sendline("and again")
        child.expect(STATS + r"(?!.*drafted [1-9]).* mode none")
        child.expect_exact(">>> ")
        # A multi-line message between triple quotes is one message.
        child.sendline('"""')
        child.expect_exact("... ")
        child.sendline("line one")
        child.expect_exact("... ")
        child.sendline('line two"""')
        child.expect(STATS)
        child.expect_exact(">>> ")
        # /stats has the session totals; /save writes valid JSON.
        child.sendline("/stats")
        child.expect(r"replies\s+3 \(0 interrupted; by mode: auto 1, none 2\)")
        child.expect_exact(">>> ")
        saved = tmp_path / "conv.json"
        child.sendline(f"/save {saved}")
        child.expect_exact("saved 6 messages")
        child.expect_exact(">>> ")
        data = json.loads(saved.read_text())
        assert [m["content"] for m in data["messages"] if m["role"] == "user"] == [
            "hello there", "and again", "line one\nline two"]
        assert len(data["turn_stats"]) == 3 and data["totals"]["replies"] == 3
        assert data["turn_stats"][1]["cached_tokens"] > 0
        # /system and /reset: the history is emptied, the system prompt stays.
        child.sendline("/system Be brief.")
        child.expect_exact("system prompt set")
        child.sendline("/reset")
        child.expect_exact("new conversation")
        child.expect_exact(">>> ")
        child.sendline(f"/save {saved}")
        child.expect_exact("saved 0 messages")
        child.expect_exact(">>> ")
        data = json.loads(saved.read_text())
        assert data["messages"] == [{"role": "system", "content": "Be brief."}]
        child.sendline("/nonsense")
        child.expect_exact("unknown command /nonsense")
        child.sendline("/help")
        child.expect_exact("/save FILE")
        child.expect_exact(">>> ")
        # One Ctrl-C at the prompt only warns; Ctrl-D exits cleanly.
        child.sendcontrol("c")
        child.expect_exact("Ctrl-C again")
        child.expect_exact(">>> ")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
    assert "hello there" in (tmp_path / "history").read_text()  # readline history


def test_ctrl_c_interrupts_a_reply_and_twice_at_the_prompt_exits(long_model, tmp_path):
    child = spawn_chat(long_model, tmp_path, "--mode", "none", "--max-tokens", "6000")
    try:
        child.sendline("write a very long story")
        child.expect(r"\S{20}")  # the reply is streaming
        child.sendcontrol("c")
        child.expect(STATS + r".* interrupted")
        child.expect_exact(">>> ")
        # The next prompt works, and the conversation goes on from the cache.
        child.sendline("/mode ngram")
        child.expect_exact("mode ngram")
        child.expect_exact(">>> ")
        child.sendline("/stats")
        child.expect(r"replies\s+1 \(1 interrupted")
        child.expect_exact(">>> ")
        child.sendline("go on")
        child.expect(r"\S{20}")
        child.sendcontrol("c")
        child.expect(STATS + r".* mode ngram · interrupted")
        child.expect_exact(">>> ")
        # After an interrupted reply, Ctrl-C at the prompt exits.
        child.sendcontrol("c")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_repl_fences_and_commands_in_process(model_dirs, tmp_path, capsys):
    from mlxspec.cli.chat import ChatREPL

    lines = iter(['"""/not a command"""', '"""', "first", "", 'last"""', "/mode bogus",
                  "/mode none", "/system -", f"/save {tmp_path / 's.json'}", "/exit", "never"])

    def fake_input(prompt):
        print(prompt, end="")
        return next(lines)

    session = ChatSession(load(str(model_dirs["llama"]), mode="ngram"), max_tokens=4)
    ChatREPL(session, input_fn=fake_input).run()
    out = capsys.readouterr()
    assert "unknown mode 'bogus'" in out.err and session.engine.mode == "none"
    saved = json.loads((tmp_path / "s.json").read_text())
    assert [m["content"] for m in saved["messages"] if m["role"] == "user"] == [
        "/not a command", "first\n\nlast"]
    assert next(lines) == "never"  # /exit stopped the loop
