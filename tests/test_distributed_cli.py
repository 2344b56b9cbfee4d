"""chat, serve, bench and generate's input with --distributed, on two ring ranks on 127.0.0.1
(free ports, hard timeouts); a tensor-parallel qwen3. Random-weight models from conftest."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request

import pytest
from dist_helpers import (
    PROMPT,
    TIMEOUT,
    kill_all,
    launch,
    rank_script,
    reference,
    start,
    wait_all,
)
from server_helpers import free_port

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-m", "mlxspec.cli.main"]


def test_chat_reads_and_prints_on_rank_0_only(tmp_path, model_dirs):
    cmd = CLI + ["chat", "--distributed", "-m", str(model_dirs["llama"]), "--mode", "ngram",
                 "--max-tokens", "8"]
    (r0, o0, e0), (r1, o1, e1) = wait_all(start(tmp_path, cmd, stdin0="hello\n/mode none\n"
                                                                       "again\n/exit\n"))
    assert r0 == 0 and r1 == 0, e0 + e1
    assert o0.count(" tok/s") == 2 and "mode none" in o0
    assert o1 == "" and "Traceback" not in e1


def _post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def start_server(tmp_path, model_dir, mode="ngram"):
    """Two ranks of `serve --distributed`, rank 0 answering /health: (procs, base url)."""
    port = free_port()
    cmd = CLI + ["serve", "--distributed", "-m", str(model_dir), "--mode", mode,
                 "--port", str(port), "--temp", "0", "--prefill-chunk", "8"]
    procs = start(tmp_path, cmd)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + TIMEOUT
    while True:
        try:
            urllib.request.urlopen(base + "/health", timeout=2).read()
            return procs, base
        except OSError:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                kill_all(procs)
                raise AssertionError(procs[0].stderr.read() if procs[0].poll() is not None
                                     else "no answer") from None
            time.sleep(0.3)


def test_serve_answers_from_rank_0(tmp_path, model_dirs):
    procs, base = start_server(tmp_path, model_dirs["llama"])
    try:
        got = _post(base + "/v1/completions", {"prompt": PROMPT, "max_tokens": 40,
                                               "temperature": 0})
        ref = reference(model_dirs["llama"])
        from mlxspec import load

        assert got["choices"][0]["text"] == load(str(model_dirs["llama"])).tokenizer.decode(ref)
        # a mode that cannot run sharded: refused on every rank at the same step, and the
        # ranks stay in step (the next requests are answered)
        with pytest.raises(urllib.error.HTTPError) as refused:
            _post(base + "/v1/completions", {"prompt": PROMPT, "max_tokens": 4,
                                             "speculative": {"mode": "quantspec"}})
        assert refused.value.code == 400 and b"quantspec" in refused.value.read()
        again = _post(base + "/v1/completions", {"prompt": PROMPT, "max_tokens": 40,
                                                 "temperature": 0})
        assert again["choices"][0]["text"] == got["choices"][0]["text"]
        # the prompt was prefilled once: every rank reused its cache for the repeat
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        # a prompt sharing a short prefix: rank 0 copies it from its cache, the follower has
        # no such copy, so they agree on reusing nothing (and the answer is still exact)
        other = PROMPT[:12] + " x = 7 y = 8 z = 9 w = 10 q = 11 x = 7 y = 8 z = 9 w = 10"
        third = _post(base + "/v1/completions", {"prompt": other, "max_tokens": 12,
                                                 "temperature": 0})
        assert third["choices"][0]["text"] == load(str(model_dirs["llama"])).generate(
            other, max_tokens=12).text
        assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        turn = [{"role": "user", "content": "hello"}]
        chat = _post(base + "/v1/chat/completions", {"messages": turn, "max_tokens": 8})
        assert chat["choices"][0]["message"]["role"] == "assistant"
        assert chat["usage"]["completion_tokens"] > 0
        turn += [chat["choices"][0]["message"], {"role": "user", "content": "and then?"}]
        follow_up = _post(base + "/v1/chat/completions", {"messages": turn, "max_tokens": 8})
        assert follow_up["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        alone = load(str(model_dirs["llama"]))  # the same turn, one process, nothing cached
        text = alone.tokenizer.apply_chat_template(turn, add_generation_prompt=True,
                                                   tokenize=False)
        assert follow_up["choices"][0]["message"]["content"] == alone.generate(
            text, max_tokens=8).text
        procs[0].send_signal(signal.SIGTERM)  # a clean shutdown ends the other rank too
        (r0, _, e0), (r1, o1, e1) = wait_all(procs, timeout=30)
        assert r0 == 0 and r1 == 0, e0 + e1
        assert o1 == ""
    finally:
        kill_all(procs)


def test_prompt_read_on_rank_0_and_a_signal_stops_every_rank(tmp_path, model_dirs):
    cmd = CLI + ["generate", "--distributed", "-m", str(model_dirs["llama"]), "--mode", "none",
                 "--max-tokens", "100000", "-p", "-"]
    procs = start(tmp_path, cmd, stdin0=PROMPT)  # rank 1's stdin is empty: "the prompt is empty"
    deadline = time.monotonic() + TIMEOUT       # if it read it
    line = ""
    while "sharded:" not in line:  # rank 0 is loaded and generating
        assert time.monotonic() < deadline
        line = procs[0].stderr.readline()
        assert line or procs[0].poll() is None
    time.sleep(1.0)
    assert procs[1].poll() is None
    procs[0].send_signal(signal.SIGINT)  # Ctrl-C on rank 0: it stops, and so does rank 1
    (r0, _, e0), (r1, o1, e1) = wait_all(procs, timeout=30)
    assert r0 == 130 and "Ctrl-C: stopping every rank" in e0
    assert r1 == 1 and "lost another rank" in e1 and o1 == ""


def test_bench_distributed_counts_collectives_and_delays_them(tmp_path, model_dirs):
    out = tmp_path / "bench"
    cmd = CLI + ["bench", "--distributed", "-m", str(model_dirs["llama"]), "--modes",
                 "none,ngram,mlx_lm", "--workloads", "chat,predicted", "--prompts", "1",
                 "--max-tokens", "6", "--collective-delay", "0,1", "--out", str(out)]
    (r0, o0, e0), (r1, o1, e1) = launch(tmp_path, cmd)
    assert r0 == 0 and r1 == 0, e0 + e1
    assert "not run sharded: mlx_lm" in e0
    report = json.loads((out / "bench_distributed.json").read_text())
    # 1 prompt per workload, 2 delays
    assert report["exact"]["ngram"] == {"identical": 4, "compared": 4}
    rows = report["results"]
    assert set(rows) == {"chat@0ms", "chat@1ms", "predicted@0ms", "predicted@1ms"}
    # the predicted output (the answer, one token changed) is copied: several tokens a forward
    assert rows["predicted@0ms"]["modes"]["ngram"]["mean_accepted_length"] >= 1.5
    none0, none1 = rows["chat@0ms"]["modes"]["none"], rows["chat@1ms"]["modes"]["none"]
    # tensor parallel, 2 layers: 2 all-reduces per layer + rank 0's token + the step packet
    assert none0["collectives_per_token"] == pytest.approx(6.0, abs=0.5)
    assert none0["collectives_per_forward"] == pytest.approx(6.0, abs=0.5)  # + the closing packet
    assert none1["slept_per_collective_ms"] >= 1.0
    assert "Speedup over none" in o0 and o1 == ""


def test_qwen3_tensor_parallel_matches_plain_decoding(tmp_path, model_dirs):
    modes = ["none", "ngram"]
    (r0, o0, e0), (r1, o1, e1) = launch(tmp_path, rank_script(model_dirs["qwen3"], None,
                                                              "tensor", 0.0, modes, 24))
    assert r0 == 0 and r1 == 0, e0 + e1
    ref = reference(model_dirs["qwen3"], 24)
    lines = [json.loads(x) for x in o0.splitlines()]
    assert [x["mode"] for x in lines] == modes
    assert all(x["strategy"] == "tensor" and x["tokens"] == ref for x in lines)
    assert [json.loads(x)["tokens"] for x in o1.splitlines()] == [ref] * len(modes)


def test_a_killed_follower_ends_generate_with_an_error(tmp_path, model_dirs):
    cmd = CLI + ["generate", "--distributed", "-m", str(model_dirs["llama"]), "--mode", "none",
                 "--max-tokens", "100000", "-p", PROMPT]
    procs = start(tmp_path, cmd, env_extra={"PYTHONUNBUFFERED": "1"})
    assert procs[0].stdout.read(1)  # rank 0 is streaming its answer
    procs[1].kill()  # rank 1 dies mid-generation (SIGKILL: no goodbye)
    (r0, _, e0), _ = wait_all(procs, timeout=30)  # never a hang
    assert r0 == 1 and "error: rank 0: lost another rank" in e0, e0
    assert "Traceback" not in e0


def test_a_killed_follower_fails_the_request_and_ends_serve(tmp_path, model_dirs):
    procs, base = start_server(tmp_path, model_dirs["llama"], mode="none")
    try:
        req = urllib.request.Request(base + "/v1/completions", data=json.dumps({
            "prompt": PROMPT, "max_tokens": 100000, "stream": True}).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.readline().startswith(b"data: ")  # the answer is streaming
            procs[1].kill()  # rank 1 dies mid-generation
            events = [x for x in r.read().decode().splitlines() if x.startswith("data: ")]
        # the request ends with an error event that says why, and rank 0 exits: it cannot
        # answer anything without the other rank
        error = json.loads(events[-1][6:])["error"]
        assert "lost another rank" in error["message"], events[-3:]
        (r0, _, e0), _ = wait_all(procs, timeout=30)
        assert r0 == 1 and "error: rank 0: lost another rank" in e0, e0
    finally:
        kill_all(procs)


def test_edit_reads_and_writes_on_rank_0_only(tmp_path, model_dirs):
    from mlxspec import load
    from mlxspec.editing import edit_text

    original = "import os\n"  # the random model ends this edit (eos) within 200 tokens
    instruction = "Rename x to y"
    ref = edit_text(load(str(model_dirs["llama"]), mode="ngram"), original, instruction,
                    max_tokens=200)
    assert ref.complete and ref.changed
    dirs = [tmp_path / "rank0", tmp_path / "rank1"]  # rank 1's folder has no file to read
    for d in dirs:
        d.mkdir()
    (dirs[0] / "code.py").write_text(original)
    cmd = CLI + ["edit", "code.py", "--distributed", "-i", instruction, "-m",
                 str(model_dirs["llama"]), "--mode", "ngram", "--max-tokens", "200", "--write"]
    (r0, o0, e0), (r1, o1, e1) = wait_all(start(tmp_path, cmd, cwds=dirs))
    assert r0 == 0 and r1 == 0, e0 + e1
    assert (dirs[0] / "code.py").read_text() == ref.edited  # as one process edits it
    assert (dirs[0] / "code.py.orig").read_text() == original  # the original kept
    assert sorted(os.listdir(dirs[0])) == ["code.py", "code.py.orig"]
    assert os.listdir(dirs[1]) == [] and o1 == ""  # rank 1 wrote and printed nothing
    assert "wrote code.py" in e0


def test_an_idle_server_exits_when_a_follower_dies(tmp_path, model_dirs):
    procs, base = start_server(tmp_path, model_dirs["llama"], mode="none")
    try:
        procs[1].kill()  # no request in flight: the server notices between requests
        (r0, _, e0), _ = wait_all(procs, timeout=20)
        assert r0 == 1 and "error: rank 0: lost another rank" in e0, e0
    finally:
        kill_all(procs)
