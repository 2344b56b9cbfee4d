"""`mlxspec bench editor` (mlxspec/bench/editor.py), the llama.vim replay: its port of
llama.vim's client (requests, cache of answers, follow-ups, ring warm-ups) against a scripted
server, then a short replay against a real in-process server on a tiny model, the report's
figures, and the command's options."""

from __future__ import annotations

import json
import random

import pytest
from click.testing import CliRunner

import mlxspec.bench.editor as be
from mlxspec.cli.main import main


class ScriptedServer:
    """Answers /infill from a function of the body; records every body."""

    def __init__(self, answer):
        self.answer, self.bodies = answer, []

    def infill(self, body: dict, kind: str):
        self.bodies.append(body)
        return be.Reply(kind, content=self.answer(body), ttft=0.01, total=0.02,
                        fields={"tokens_evaluated": 10, "timings/cache_n": 4,
                                "timings/prompt_n": 6, "timings/predicted_n": 3},
                        forwards=2)


BUFFER = ["a = 1", "b = 2", "", "print(c)"]  # the file without the line being typed
OTHER = [f"def g{i}(x):" if i % 2 == 0 else "    return x" for i in range(10)]


def answer(body):
    if body["n_predict"] == 0:
        return ""
    if body["t_max_predict_ms"] == 250:  # a first request: the rest of the line
        return "c = a + b\n"[len(body["prompt"]):] if "c = a + b".startswith(
            body["prompt"]) else "\n"
    return "\nd = c\n"  # a follow-up


def editor(server):
    ed = be.Editor(server, random.Random(0), [])
    ed.open_file("pkg/a.py", BUFFER, 3, [("pkg/other.py", OTHER, 5)])
    return ed


def test_warm_ups_first_request_follow_up_and_accepting_a_line():
    server = ScriptedServer(answer)
    ed = editor(server)
    got = ed.type_block(["c = a + b"], 3)
    kinds = [e["kind"] for e in ed.log]
    assert kinds == ["warmup", "warmup", "first", "follow", "follow"]
    warm = [e["body"] for e in ed.log[:2]]
    # s:ring_update: one warm-up per chunk moved into the ring, with the whole ring
    assert [len(b["input_extra"]) for b in warm] == [1, 2]
    assert all(b["n_predict"] == 0 and b["input_prefix"] == "" and b["prompt"] == ""
               and b["input_extra"][0]["filename"] == "pkg/other.py" for b in warm)
    first = ed.log[2]["body"]
    assert first["input_prefix"] == "a = 1\nb = 2\n"
    assert first["prompt"] == ""
    assert first["input_suffix"] == "\n\nprint(c)\n"
    assert (first["n_predict"], first["t_max_predict_ms"], first["t_max_prompt_ms"]) == (128, 250, 500)
    assert (first["top_k"], first["samplers"], first["cache_prompt"], first["stream"]) == (
        40, ["top_k", "top_p", "infill"], True, True)
    assert first["n_indent"] == 0 and "content" in first["response_fields"]
    # the chunk of this very file was evicted (too similar to the text around the cursor)
    assert [c["filename"] for c in first["input_extra"]] == ["pkg/other.py"]
    # the speculative follow-up: the context as if the suggestion had been accepted
    follow = ed.log[3]["body"]
    assert follow["t_max_predict_ms"] == 1000
    assert follow["input_prefix"] == first["input_prefix"] and follow["prompt"] == "c = a + b"
    assert follow["input_suffix"] == first["input_suffix"]
    # accepted: the cursor at the line's end finds the follow-up's answer in llama.vim's
    # cache (no first request), and its own follow-up goes out
    assert got == {"typed_chars": 0, "accepted_chars": 9, "accepts": 1}
    assert [s["hint_from"] for s in ed.stops] == ["request:first", "cache:follow"]
    assert ed.stops[0]["wait"] == pytest.approx(0.02) and ed.stops[1]["wait"] == 0.0
    last = ed.log[4]
    assert last["prev"] == ["", "d = c"]
    assert last["body"]["input_prefix"] == "a = 1\nb = 2\nc = a + b\n"
    assert last["body"]["prompt"] == "d = c"
    assert ed.lines == ["a = 1", "b = 2", "c = a + b", "", "print(c)"]


def test_typing_what_the_suggestion_says_shows_it_from_the_cache():
    """A suggestion that is not the file's text is not accepted; while what is typed matches
    it, it is shown again from llama.vim's cache (s:fim_try_hint's look back), its follow-up is
    not asked twice, and a request still goes out for the exact position."""
    server = ScriptedServer(answer)
    ed = editor(server)
    got = ed.type_block(["c = a - b"], 3)
    assert got == {"typed_chars": 9, "accepted_chars": 0, "accepts": 0}
    assert [(s["col"], s["hint_from"]) for s in ed.stops] == [
        (0, "request:first"), (1, "cache:first"), (3, "cache:first"), (5, "cache:first"),
        (7, "request:first"), (9, "request:first")]
    assert [s["wait"] for s in ed.stops[1:4]] == [0.0, 0.0, 0.0]
    assert [e["kind"] for e in ed.log] == ["warmup"] * 2 + ["first", "follow"] + ["first"] * 5
    assert [e["body"]["prompt"] for e in ed.log[4:]] == ["c", "c =", "c = a", "c = a -",
                                                        "c = a - b"]



def test_accept_all_takes_every_suggestion_and_read_ms_waits_after_each(monkeypatch):
    """--accept-all: the suggestion that is not the file's text is accepted all the same
    (the line becomes the model's), its follow-up's answer is shown next from llama.vim's
    cache; --read-ms: the user waits that long after each suggestion shown."""
    slept = []
    monkeypatch.setattr(be.time, "sleep", slept.append)
    server = ScriptedServer(answer)
    ed = be.Editor(server, random.Random(0), [], read_ms=700, accept_all=True)
    ed.open_file("pkg/a.py", BUFFER, 3, [("pkg/other.py", OTHER, 5)])
    got = ed.type_block(["c = a - b"], 3)
    assert got == {"typed_chars": 0, "accepted_chars": 9, "accepts": 1}
    assert ed.lines[2] == "c = a + b"
    assert [s["hint_from"] for s in ed.stops] == ["request:first", "cache:follow"]
    assert slept == [0.7, 0.7]

def test_the_report_of_a_scripted_run():
    server = ScriptedServer(answer)
    ed = editor(server)
    ed.type_block(["c = a + b"], 3)
    r = be.summarize({"cfg": be.Config("auto"), "log": ed.log, "stops": ed.stops,
                      "typing": {"typed_chars": 0, "accepted_chars": 9, "accepts": 1},
                      "seconds": 1.0, "drafting": False})
    assert r["kinds"]["first"]["requests"] == 1 and r["kinds"]["follow"]["requests"] == 2
    assert r["kinds"]["warmup"]["requests"] == 2
    assert r["generation"]["reused_pct"] == pytest.approx(40.0)
    assert r["generation"]["tokens_per_forward"] == pytest.approx(1.5)
    assert r["stops_from_follow_up"] == 1 and r["wait_p50"] == pytest.approx(0.01)
    assert "| auto | 2/1/2 |" in be.table([r])


@pytest.fixture(scope="module")
def tiny(model_dirs):
    """A random 2-layer llama with a FIM tokenizer (fast; its answers are noise)."""
    from mlxspec.loading import load

    return load(str(model_dirs["llama"]), mode="none", draft=str(model_dirs["llama-draft"]))


def test_a_replay_against_the_server(tiny):
    plan = be.plan_files(["click"], 1, 1, 1, seed=3)
    run = be.replay(tiny, be.Config("auto"), plan, 1, seed=3)
    log = run["log"]
    kinds = [e["kind"] for e in log]
    n_warm = kinds.index("first")
    assert n_warm >= 1 and set(kinds[:n_warm]) == {"warmup"}
    assert [e["ring"] for e in log[:n_warm]] == list(range(1, n_warm + 1))
    assert all(e["reply"].content == "" for e in log[:n_warm])
    assert "follow" in kinds
    for e in log:
        b = e["body"]
        if e["kind"] == "first":
            assert b["t_max_predict_ms"] == 250 and b["n_predict"] == 128
            assert b["input_prefix"].count("\n") <= be.N_PREFIX
            assert b["input_suffix"].count("\n") <= be.N_SUFFIX + 1
        elif e["kind"] == "follow":
            assert b["t_max_predict_ms"] == 1000 and e["prev"]
            assert (b["input_prefix"] + b["prompt"]).endswith("\n".join(e["prev"]))
    for e in log[n_warm:]:
        f = e["reply"].fields
        assert f["tokens_evaluated"] == f["timings/cache_n"] + f["timings/prompt_n"]
        assert e["reply"].forwards >= 1 and e["reply"].total > 0
    r = be.summarize(run)
    first = r["kinds"]["first"]
    assert first["requests"] == kinds.count("first") and r["stops"] >= 2
    assert 0 < first["ttft_p50"] <= first["total_p50"] <= first["total_p95"]
    assert 0 <= r["generation"]["reused_pct"] <= 100
    assert r["generation"]["reused_tokens"] > 0  # the warm-ups' and earlier prompts' caches
    assert 0.5 <= r["generation"]["tokens_per_forward"] <= 9
    assert r["wait_p50"] is not None and r["wait_p95"] >= r["wait_p50"]
    assert sum(r["accepted_by_source"].values()) == r["generation"]["accepted"]
    assert "auto" in be.table([r]) and "prefill" in be.where_time_goes(r)


def test_a_replay_with_cache_reuse_and_its_agreement(tiny):
    """--cache-reuse: the server reuses shifted chunks (no fewer tokens reused than exact) and
    the report compares its answers with the exact run's, request by request."""
    plan = be.plan_files(["click"], 1, 1, 1, seed=5)
    exact = be.summarize(be.replay(tiny, be.Config("none"), plan, 1, seed=5))
    shifted = be.summarize(be.replay(tiny, be.Config("none", cache_reuse=16), plan, 1, seed=5))
    assert shifted["config"] == "none --cache-reuse 16"
    assert shifted["generation"]["reused_tokens"] >= exact["generation"]["reused_tokens"]
    a = be.agreement(shifted, exact)
    assert a["matched_requests"] >= 1 and 0 <= a["identical_answers"] <= a["matched_requests"]
    same = be.agreement(exact, exact)
    assert same["identical_answers"] == same["matched_requests"] >= 1
    assert same["agreeing_chars_pct"] in (None, 100.0)


@pytest.mark.parametrize("args, message", [
    (["--modes", "auto,banana"], "unknown mode 'banana' in --modes"),
    (["--files", "0"], "--files must be >= 1, got 0"),
    (["--bogus"], "No such option '--bogus'"),
])
def test_the_command_refuses_bad_options_before_loading(args, message, monkeypatch):
    monkeypatch.setattr("mlxspec.loading.load", lambda *a, **k: pytest.fail("model loaded"))
    r = CliRunner().invoke(main, ["bench", "editor", *args])
    assert r.exit_code == 2 and message in r.stderr and r.stdout == ""


def test_the_command_runs_the_replays_and_writes_json(monkeypatch, tmp_path):
    """`mlxspec bench editor` passes its options to the replay (and `mlxspec bench`'s own
    options are not asked for); --json gets the figures and the options."""
    got = {}

    def replays(engine, modes, no_suffix, no_draft, n_files, n_lines, n_open, packages, seed,
                cache_reuse=0, no_follow_ahead=False, read_ms=0, accept_all=False):
        got.update(engine=engine, modes=modes, no_suffix=no_suffix, no_draft=no_draft,
                   files=n_files, lines=n_lines, open=n_open, packages=packages, seed=seed,
                   cache_reuse=cache_reuse, no_follow_ahead=no_follow_ahead, read_ms=read_ms,
                   accept_all=accept_all)
        return {"model": "m", "results": []}

    monkeypatch.setattr("mlxspec.cli.bench.load_engine", lambda *a, **k: "engine")
    monkeypatch.setattr(be, "run_replays", replays)
    out = tmp_path / "editor.json"
    r = CliRunner().invoke(main, ["bench", "editor", "--modes", "auto", "--no-draft",
                                  "--lines", "3", "--packages", "click", "--cache-reuse", "64",
                                  "--no-follow-ahead", "--read-ms", "800", "--accept-all",
                                  "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert got == {"engine": "engine", "modes": ["auto"], "no_suffix": False, "no_draft": True,
                   "files": 1, "lines": 3, "open": 2, "packages": ["click"], "seed": 0,
                   "cache_reuse": 64, "no_follow_ahead": True, "read_ms": 800,
                   "accept_all": True}
    report = json.loads(out.read_text())
    assert report["model"] == "m" and report["args"]["lines"] == 3
