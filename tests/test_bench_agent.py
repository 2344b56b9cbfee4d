"""The `agent` bench workload: recorded agent sessions (`bench/record_agent.py`) replayed as the
server renders them, every mode giving `none`'s tokens, figures per turn kind."""

from __future__ import annotations

import json

import pytest

from mlxspec.bench import workloads
from mlxspec.bench.workloads import TURN_KINDS, agent_items, agent_sessions

EDITS = ("write_file", "replace_in_file")


@pytest.fixture(scope="module")
def tokenizer(tools_model_dir):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    return load_tokenizer(tools_model_dir)


def test_the_recorded_sessions_are_an_agents_requests():
    sessions = agent_sessions()
    assert sessions
    kinds, results = set(), []
    for s in sessions:
        assert s["source"]["license"] in ("MIT", "BSD-3-Clause")
        assert 2 <= len(s["turns"]) <= 8
        for t in s["turns"]:
            body = t["request"]
            assert {f["function"]["name"] for f in body["tools"]} >= {"read_file", *EDITS}
            assert body["messages"][0]["role"] == "system"
            names = [c["function"]["name"] for c in t["answer"]["tool_calls"] or []]
            assert t["kind"] == ("edit" if set(names) & set(EDITS) else "answer"
                                 if names in ([], ["finish"]) else "tool_call")
            kinds.add(t["kind"])
        results += [m["content"] for m in s["turns"][-1]["request"]["messages"]
                    if m["role"] == "tool"]
    # tool results hold real files of the packages, as read_file returned them (an agent may
    # also edit without reading first: a session of the 1.5B did)
    assert sum(r.count("\n") > 40 for r in results) >= 2
    assert kinds == set(TURN_KINDS)


def test_agent_items_are_the_servers_prompts_in_session_order(tokenizer):
    from mlxspec.server.protocol import RequestParser, ServerConfig

    items = agent_items(tokenizer)
    sessions = agent_sessions()
    assert len(items) == sum(len(s["turns"]) for s in sessions)
    assert [(it.meta["session"], it.meta["turn"]) for it in items] == [
        (s["name"], j) for s in sessions for j in range(len(s["turns"]))]
    parser = RequestParser(tokenizer, ServerConfig("m", {"m"}, None, accept_any_model=True))
    first = sessions[0]["turns"][0]["request"]
    want = parser.requests("chat", {**first, "model": "m"})[0].prompt
    assert items[0].tokens == want and items[0].max_tokens == 256
    assert "Tools: list_dir read_file write_file replace_in_file" in items[0].prompt
    assert {it.meta["kind"] for it in items} == set(TURN_KINDS)
    for a, b in zip(items, items[1:]):  # a session's next turn extends its prompt
        if a.meta["session"] == b.meta["session"]:
            assert b.tokens[:len(a.tokens)] == a.tokens
    assert len(agent_items(tokenizer, 3, 16)) == 3


@pytest.fixture
def short_sessions(tmp_path, monkeypatch):
    """The first two sessions' first 3 turns, each text cut to 80 characters (the random
    model's context is short); the workload reads them instead of the recorded ones."""
    for s in agent_sessions()[:2]:
        s["turns"] = s["turns"][:3]
        for t in s["turns"]:
            for m in t["request"]["messages"]:
                if isinstance(m.get("content"), str):
                    m["content"] = m["content"][:80]
                for c in m.get("tool_calls") or []:
                    args = json.loads(c["function"]["arguments"])
                    c["function"]["arguments"] = json.dumps(
                        {k: v[:80] if isinstance(v, str) else v for k, v in args.items()})
        (tmp_path / f"{s['name']}.json").write_text(json.dumps(s))
    monkeypatch.setattr(workloads, "AGENT_SESSIONS", tmp_path)
    return tmp_path


def test_every_mode_gives_nones_tokens_on_agent_turns(tools_model_dir, short_sessions):
    import mlxspec
    from mlxspec.bench.run import make_runners, markdown_table, run_workloads

    engine = mlxspec.load(str(tools_model_dir), draft=str(tools_model_dir))
    modes = ["none", "ngram", "suffix", "draft", "auto"]
    runners = make_runners(engine, modes, 4)
    n = len(agent_items(engine.tokenizer))
    assert n >= 3
    results = run_workloads(engine, runners, ["agent"], 8, 24, [0.0], show_progress=False)
    r = results["agent@0"]
    assert r["modes"]["none"]["prompts"] == n
    assert r["exact"] == {m: {"identical": n, "divergences": []} for m in modes[1:]}
    assert set(r["by_kind"]) <= set(TURN_KINDS)
    assert sum(k["none"]["prompts"] for k in r["by_kind"].values()) == n
    table = markdown_table(results)
    assert "identical to none" in table and "| auto |" in table
