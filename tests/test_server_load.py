"""`mlxspec serve` under load and abuse (issue 13): bursts of connections, slow and stuck
clients, the connection cap, request timeouts, graceful shutdown, stop strings that agree on
every path, and a fuzz run over request bodies. Every wait has a hard limit: a hang fails."""

from __future__ import annotations

import http.client
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from server_helpers import free_port, post, sse_events, start, stop

import mlxspec
from mlxspec.stopstrings import StopMatcher, find_stop

PROMPTS = [f"def step_{i}(self, tokens):\n    return {i} + " for i in range(8)]


# ----------------------------------------------------------------------------- helpers


def wait_for(cond, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"not within {timeout} s: {what}")


def metric(srv, name: str) -> float:
    conn = http.client.HTTPConnection(*srv.server_address[:2], timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.fixture(scope="module")
def ref(model_dirs):
    """Reference answers from a separately loaded engine, computed before any server runs."""
    engine = mlxspec.load(str(model_dirs["qwen2"]), mode="none")
    gen = {p: engine.generate(p, max_tokens=8, temperature=0.0).text for p in PROMPTS}
    long = next(p for p in PROMPTS
                if engine.generate(p, max_tokens=300, temperature=0.0).finish_reason == "length")
    full = engine.generate(long, max_tokens=300, temperature=0.0).text
    return {"engine": engine, "short": gen, "long": long, "long_text": full}


@pytest.fixture(scope="module")
def engine(model_dirs, ref):
    return mlxspec.load(str(model_dirs["qwen2"]), mode="ngram", num_draft=4)


# ----------------------------------------------------------------------------- bursts


def test_burst_of_256_connections_nothing_reset(engine, ref):
    """256 clients connect at once and each posts a completion: every one gets an answer, a
    200 identical to its single-request answer or a 503 with Retry-After; none is reset."""
    srv = start(engine, max_queue=64)
    n = 256
    barrier = threading.Barrier(n)
    results: list = [None] * n

    def one(i):
        prompt = PROMPTS[i % len(PROMPTS)]
        try:
            sock = socket.create_connection(srv.server_address[:2], timeout=60)
            barrier.wait(timeout=60)
            body = json.dumps({"prompt": prompt, "max_tokens": 8, "temperature": 0}).encode()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Content-Type: application/json\r\nConnection: close\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
            sock.close()
            head, _, payload = data.partition(b"\r\n\r\n")
            status = int(head.split()[1])
            results[i] = (status, head.decode(), json.loads(payload), prompt)
        except Exception as e:  # a reset, a refusal or a timeout
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a client hung"
        errors = [r for r in results if isinstance(r, Exception) or r is None]
        assert not errors, f"{len(errors)} connections failed, e.g. {errors[0]!r}"
        ok = [r for r in results if r[0] == 200]
        busy = [r for r in results if r[0] == 503]
        assert len(ok) + len(busy) == n and len(ok) >= 64
        for _, _, body, prompt in ok:
            assert body["choices"][0]["text"] == ref["short"][prompt]
        for _, head, body, _ in busy:
            assert "retry-after: 1" in head.lower() and body["error"]["type"] == "server_busy"
        assert metric(srv, 'mlxspec_rejected_requests_total{reason="queue_full"}') == len(busy)
    finally:
        stop(srv)


def test_connection_cap_answers_503_never_resets(engine):
    srv = start(engine, max_connections=4)
    idle = [socket.create_connection(srv.server_address[:2], timeout=10) for _ in range(4)]
    try:
        wait_for(lambda: srv.open_connections() == 4, 5, "4 connections open")
        status, payload, resp = post(srv.url, "/v1/completions", {"prompt": "x", "max_tokens": 2},
                                     timeout=10)
        assert status == 503 and resp.getheader("Retry-After") == "1"
        assert json.loads(payload)["error"]["code"] == "too_many_connections"
        for s in idle:
            s.close()
        wait_for(lambda: srv.open_connections() == 0, 5, "connections closed")
        status, _, _ = post(srv.url, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 200
    finally:
        stop(srv)


# ----------------------------------------------------------------------------- slow clients


def test_slowloris_does_not_delay_others_and_is_dropped(engine, ref):
    """Clients that send their headers a byte at a time, or never finish their body, hold
    nothing: a normal request is answered at once, and they are closed after --read-timeout."""
    srv = start(engine, read_timeout=1.0)
    stop_event = threading.Event()
    closed_at: list[float] = []
    t0 = time.monotonic()

    def slowloris_poll():
        """A slowloris that checks for the close while it dribbles."""
        sock = socket.create_connection(srv.server_address[:2], timeout=10)
        sock.setblocking(False)
        try:
            for b in b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-a: " + b"a" * 200:
                if stop_event.is_set():
                    return
                sock.send(bytes([b]))
                time.sleep(0.1)
                try:
                    if sock.recv(1) == b"":
                        break
                except BlockingIOError:
                    continue
        except OSError:
            pass
        closed_at.append(time.monotonic() - t0)
        sock.close()

    threads = [threading.Thread(target=slowloris_poll, daemon=True) for _ in range(16)]
    try:
        for t in threads:
            t.start()
        # A body that never arrives: 408 after the read timeout.
        sock = socket.create_connection(srv.server_address[:2], timeout=10)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\":")
        time.sleep(0.2)
        start_t = time.monotonic()
        status, payload, _ = post(srv.url, "/v1/completions",
                                  {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0},
                                  timeout=10)
        assert status == 200 and json.loads(payload)["choices"][0]["text"] == ref["short"][PROMPTS[0]]
        # answered while 16 slow clients hold connections (each would hold one for ~25 s)
        assert time.monotonic() - start_t < 3.0
        data = sock.recv(4096)
        assert data.startswith(b"HTTP/1.1 408"), data[:100]
        sock.close()
        for t in threads:
            t.join(timeout=10)
        assert len(closed_at) == 16 and max(closed_at) < 5.0, closed_at
        assert metric(srv, 'mlxspec_timeouts_total{kind="read"}') >= 17
        wait_for(lambda: srv.open_connections() == 0, 5, "slow connections closed")
    finally:
        stop_event.set()
        stop(srv)


def test_client_that_stops_reading_is_dropped_and_its_job_cancelled(engine, ref):
    srv = start(engine, write_timeout=0.5, send_buffer_bytes=4096)
    try:
        orig = srv.worker._emit

        def slow_step(job, produced):  # a few ms a step: the stream outlasts the buffers' slack
            time.sleep(0.002)
            orig(job, produced)

        srv.worker._emit = slow_step
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        sock.settimeout(10)
        sock.connect(srv.server_address[:2])
        body = json.dumps({"prompt": ref["long"], "max_tokens": 400, "temperature": 0,
                           "stream": True}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        # ...and reads nothing.
        wait_for(lambda: metric(srv, 'mlxspec_timeouts_total{kind="write"}') >= 1, 30,
                 "the stalled client timed out")
        wait_for(srv.worker.idle, 10, "its job cancelled")
        assert metric(srv, "mlxspec_client_disconnects_total") >= 1
        sock.close()
        srv.worker._emit = orig
        status, payload, _ = post(srv.url, "/v1/completions",
                                  {"prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0})
        assert json.loads(payload)["choices"][0]["text"] == ref["short"][PROMPTS[1]]
    finally:
        stop(srv)


# ----------------------------------------------------------------------------- timeouts


@pytest.mark.parametrize("spec", [2, 0], ids=["engine", "batched"])
@pytest.mark.parametrize("stream", [False, True])
def test_request_timeout_ends_with_partial_answer(engine, ref, spec, stream):
    srv = start(engine, request_timeout=0.6, spec_max_concurrency=spec)
    worker = srv.worker
    orig = worker._emit

    def slow(*a):
        time.sleep(0.01)
        orig(*a)

    worker._emit = slow
    try:
        t = time.monotonic()
        status, payload, _ = post(srv.url, "/v1/completions",
                                  {"prompt": ref["long"], "max_tokens": 300, "temperature": 0,
                                   "stream": stream}, timeout=30)
        assert status == 200 and time.monotonic() - t < 5
        if stream:
            events = sse_events(payload)
            assert events[-1] == "[DONE]"
            text = "".join(e["choices"][0]["text"] for e in events[:-1])
            finish = events[-2]["choices"][0]["finish_reason"]
        else:
            body = json.loads(payload)
            text, finish = body["choices"][0]["text"], body["choices"][0]["finish_reason"]
        assert finish == "timeout"
        assert 0 < len(text) < len(ref["long_text"]) and ref["long_text"].startswith(text)
        assert metric(srv, 'mlxspec_timeouts_total{kind="request"}') == 1
        # llama.cpp's /completion says the same with stop_type "limit"
        status, payload, _ = post(srv.url, "/completion",
                                  {"prompt": ref["long"], "n_predict": 300})
        body = json.loads(payload)
        assert body["stop_type"] == "limit" and ref["long_text"].startswith(body["content"])
    finally:
        worker._emit = orig
        stop(srv)


# ----------------------------------------------------------------------------- shutdown


def test_drain_lets_short_requests_finish_and_ends_long_streams_cleanly(engine, ref):
    srv = start(engine)
    orig = srv.worker._emit

    def slow(job, produced):
        time.sleep(0.01)
        orig(job, produced)

    srv.worker._emit = slow
    out: dict = {}

    def long_stream():
        out["long"] = post(srv.url, "/v1/completions",
                           {"prompt": ref["long"], "max_tokens": 300, "temperature": 0,
                            "stream": True}, timeout=30)

    threads = [threading.Thread(target=long_stream, daemon=True)]
    threads[0].start()
    wait_for(lambda: srv.worker.active() == 1, 10, "the stream running")
    time.sleep(0.2)
    health = socket.create_connection(srv.server_address[:2], timeout=10)  # kept open
    wait_for(lambda: srv.open_connections() == 2, 5, "both connections accepted")
    finished = srv.drain(grace=0.3)
    threads[0].join(timeout=15)
    assert not finished and not threads[0].is_alive()
    status, payload, _ = out["long"]
    events = sse_events(payload)
    assert status == 200 and events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "shutdown"
    text = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert text and ref["long_text"].startswith(text)
    health.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert health.recv(4096).startswith(b"HTTP/1.1 503")  # for load balancers
    health.close()
    with pytest.raises(OSError):  # no longer accepting
        socket.create_connection(srv.server_address[:2], timeout=2)
    srv.server_close()


def test_drain_waits_for_a_running_request(engine, ref):
    srv = start(engine)
    out: dict = {}

    def one():
        out["r"] = post(srv.url, "/v1/completions",
                        {"prompt": PROMPTS[2], "max_tokens": 8, "temperature": 0}, timeout=30)

    t = threading.Thread(target=one, daemon=True)
    orig = srv.worker._emit

    def slow(job, produced):
        time.sleep(0.02)
        orig(job, produced)

    srv.worker._emit = slow
    t.start()
    wait_for(lambda: srv.worker.active() == 1, 10, "running")
    assert srv.drain(grace=20)
    t.join(timeout=10)
    status, payload, _ = out["r"]
    assert status == 200 and json.loads(payload)["choices"][0]["text"] == ref["short"][PROMPTS[2]]
    srv.server_close()


@pytest.mark.slow
def test_sigterm_mid_stream_drains_and_exits_0(model_dirs):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlxspec.cli.main", "serve", "-m",
                             str(model_dirs["llama"]), "--port", str(port), "--mode", "none",
                             "--shutdown-grace", "0.5"],
                            stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:
            if "listening on" in line:
                break
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        body = {"prompt": "def", "max_tokens": 100000, "temperature": 1.0, "seed": 1,
                "stream": True, "speculative": {"mode": "none"}}
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        first = resp.readline()
        assert first.startswith(b"data: ")
        proc.send_signal(signal.SIGTERM)
        payload = first + resp.read()
        events = sse_events(payload)
        assert events[-1] == "[DONE]"
        # A clean end: cut by the drain, or (on a slow machine, within the grace) the random
        # model's own end-of-sequence token.
        assert events[-2]["choices"][0]["finish_reason"] in ("shutdown", "length", "stop")
        assert proc.wait(timeout=30) == 0
        assert "shutting down" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


# ----------------------------------------------------------------------------- stop strings


def test_stop_matcher_earliest_match_across_pieces():
    assert find_stop("xabc", ["bc", "ab"]) == (1, "ab")
    assert find_stop("abc", ["c", "b"]) == (1, "b")
    assert find_stop("aab", ["ab", "a"]) == (0, "a")
    assert find_stop("abc", ["zz"]) is None
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice("ab\n") for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice("ab\n") for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(0, 3))]
        hit = find_stop(text, stops)
        want = text if hit is None else text[:hit[0]]
        # any split into pieces gives the same answer
        m, out, cuts = StopMatcher(stops), "", sorted(rng.sample(range(len(text) + 1), min(
            len(text) + 1, rng.randint(0, 6))))
        word = None
        for a, b in zip([0, *cuts], [*cuts, len(text)]):
            piece, word = m.feed(text[a:b])
            out += piece
            if word:
                break
        if not word:
            out += m.flush()
        assert out == want and word == (hit[1] if hit else None), (text, stops)


def test_stop_strings_agree_on_every_path(engine, ref):
    """Two stop strings listed latest-first: `generate`, an engine slot and the plain batch
    all cut at the earliest match in the text."""
    full = ref["long_text"]
    # The random model's text depends on the test tokenizer (trained on engine.py): take the
    # first offset from 20 whose 3 characters first occur there, and a later, different piece.
    a = next(i for i in range(20, len(full) - 70)
             if full[i:i + 3] not in full[:i] + full[i + 1:i + 3])
    b = next(j for j in range(a + 40, len(full) - 3) if full[j:j + 3] != full[a:a + 3])
    early, late = full[a:a + 3], full[b:b + 3]
    assert early not in full[:a] + full[a + 1:a + 3] and early != late
    stops = [late, early]
    want = ref["engine"].generate(ref["long"], max_tokens=300, temperature=0.0, stop=stops)
    cut = min(full.find(early), full.find(late))
    assert want.text == full[:cut] and want.finish_reason == "stop"
    for spec in (2, 0):
        srv = start(engine, spec_max_concurrency=spec)
        try:
            for stream in (False, True):
                status, payload, _ = post(srv.url, "/v1/completions",
                                          {"prompt": ref["long"], "max_tokens": 300,
                                           "temperature": 0, "stop": stops, "stream": stream})
                if stream:
                    events = sse_events(payload)
                    text = "".join(e["choices"][0]["text"] for e in events[:-1])
                    finish = events[-2]["choices"][0]["finish_reason"]
                else:
                    choice = json.loads(payload)["choices"][0]
                    text, finish = choice["text"], choice["finish_reason"]
                assert (text, finish) == (want.text, "stop"), (spec, stream)
            status, payload, _ = post(srv.url, "/completion",
                                      {"prompt": ref["long"], "n_predict": 300, "stop": stops})
            body = json.loads(payload)
            # llama.cpp's own report, on the engine slot (spec 2) and the plain batch alike
            assert body["content"] == want.text and body["stop_type"] == "word"
            assert body["stopping_word"] == full[cut:cut + 3]
        finally:
            stop(srv)


# ----------------------------------------------------------------------------- fuzzing


def fuzz_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(14 if depth < 6 else 10)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, -1, 1, 2, 7, -(2**63), 2**63, 10**30, -(10**30), 2**31 - 1])
    if kind == 3:
        return rng.choice([0.0, -0.5, 0.5, 1e308, -1e308, 1e-320, math.nan, math.inf, -math.inf])
    if kind == 4:
        return rng.choice(["", "x", "def f(", "\u0000", "\ud800", "🙂" * 50, "\u202e\u200b",
                           "a" * 5000, "<|fim_prefix|>", "<|endoftext|>", "\n" * 100, "%s%n"])
    if kind == 5:
        return "".join(chr(rng.randrange(0x110000)) for _ in range(rng.randrange(20)))
    if kind in (6, 7, 8, 9):
        return rng.choice(["ngram", "none", "draft", "bogus", "content", "user", "assistant"])
    if kind in (10, 11):
        return [fuzz_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = rng.sample(FIELDS, rng.randrange(1, 5))
    return {k: fuzz_value(rng, depth + 1) for k in keys}


FIELDS = ["prompt", "suffix", "messages", "max_tokens", "max_completion_tokens", "n_predict",
          "temperature", "top_p", "top_k", "min_p", "stop", "seed", "random_seed", "stream",
          "stream_options", "prediction", "speculative", "input_prefix", "input_suffix",
          "input_extra", "response_fields", "t_max_predict_ms", "n_indent", "n_cmpl", "n",
          "model", "role", "content", "type", "text", "mode", "num_draft", "include_usage",
          "tokens", "with_pieces", "add_special", "filename", "logprobs", "tools"]
PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/fim/completions", "/infill",
         "/completion", "/tokenize", "/detokenize", "/apply-template"]


def fuzz_body(rng: random.Random) -> tuple[str, bytes, dict]:
    """A path, raw body bytes and extra headers."""
    path = rng.choice(PATHS)
    r = rng.random()
    if r < 0.55:  # a plausible request with wrong or odd values
        body = {k: fuzz_value(rng) for k in rng.sample(FIELDS, rng.randrange(1, 8))}
        if rng.random() < 0.5:
            body["prompt"] = rng.choice(["def f(", [1, 2, 3], "", [[1]], [-5], [10**9]])
        if rng.random() < 0.5:
            body["messages"] = rng.choice([[{"role": "user", "content": "hi"}],
                                           [{"role": "user", "content": [{"type": "text",
                                                                          "text": "x"}]}],
                                           [{"role": 5}], [], "hi", [{}]])
        body.setdefault("max_tokens", rng.choice([1, 2, 3]))
        body["n_predict"] = body.get("n_predict") if rng.random() < 0.3 else 2
        return path, json.dumps(body, allow_nan=True).encode(), {}
    if r < 0.7:  # any JSON value
        return path, json.dumps(fuzz_value(rng), allow_nan=True).encode(), {}
    if r < 0.8:  # deep nesting
        d = rng.choice([50, 1000, 100000])
        return path, (b"[" * d + b"]" * d) if rng.random() < 0.5 else (
            b'{"a":' * d + b"1" + b"}" * d), {}
    if r < 0.9:  # truncated or broken JSON, bad bytes
        good = json.dumps({"prompt": "def f(", "max_tokens": 2}).encode()
        return path, rng.choice([good[:rng.randrange(len(good))], b"\xff\xfe\x00",
                                 b"{'prompt': 1}", b"", b"null", b'"x"', b"1e999999",
                                 good + b"garbage"]), {}
    # wrong content types (the body is read as JSON whatever the type claims)
    good = json.dumps({"prompt": "def f(", "max_tokens": 2}).encode()
    return path, rng.choice([good, b"prompt=x&max_tokens=2"]), {
        "Content-Type": rng.choice(["text/plain", "application/x-www-form-urlencoded",
                                    "multipart/form-data; boundary=x", "application/json; charset=latin-1"])}


def test_fuzzed_bodies_never_get_a_5xx(model_dirs):
    # A short context keeps the huge max_tokens values (clamped to what it leaves) quick.
    engine = mlxspec.load(str(model_dirs["qwen2"]), mode="ngram", num_draft=4, max_context=48)
    srv = start(engine, default_max_tokens=2, max_body_bytes=1 << 20)
    rng = random.Random(int(os.environ.get("MLXSPEC_FUZZ_SEED", "13")))
    n = int(os.environ.get("MLXSPEC_FUZZ_N", "500"))
    statuses: dict[int, int] = {}
    try:
        host, port = srv.server_address[:2]
        for i in range(n):
            path, raw, headers = fuzz_body(rng)
            conn = http.client.HTTPConnection(host, port, timeout=30)
            conn.request("POST", path, raw, {"Content-Type": "application/json", **headers})
            resp = conn.getresponse()
            payload = resp.read()
            conn.close()
            statuses[resp.status] = statuses.get(resp.status, 0) + 1
            assert resp.status < 500, (i, path, raw[:300], payload[:300])
            if resp.status >= 400:
                err = json.loads(payload)["error"]
                assert isinstance(err["message"], str) and "type" in err and "code" in err
        assert statuses.get(200, 0) > 20 and sum(statuses.values()) == n, statuses
        for field in ("temperature", "top_p", "min_p", "t_max_predict_ms"):
            for value in (math.nan, math.inf):
                status, payload, _ = post(srv.url, "/v1/completions",
                                          {"prompt": "x", field: value},
                                          raw=json.dumps({"prompt": "x", field: value}).encode())
                assert status == 400 and json.loads(payload)["error"]["param"] == field
        status, _, _ = post(srv.url, "/v1/completions", {"prompt": "def f(", "max_tokens": 2})
        assert status == 200
    finally:
        stop(srv)
