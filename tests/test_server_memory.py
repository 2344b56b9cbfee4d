"""The server admits requests by a memory budget: under a limit that holds one request at a
time, a second waits (shown by /metrics and /slots) and is answered after the first, both
as decoded alone; a request that cannot fit even alone is answered 400 with the numbers."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest
from conftest import make_engine
from server_helpers import post, sse_events, start, stop
from test_memory import limit_for_room

from mlxspec import memory

PROMPTS = ["def first(a, b):\n    return ", "class Second:\n    def __init__(self):\n  "]
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def one_at_a_time(llama_pair):
    """(server whose memory holds one request of PROMPTS at a time, its answers alone)."""
    engine = make_engine(llama_pair[0])
    alone = [engine.generate(p, max_tokens=MAX_TOKENS, temperature=0).text for p in PROMPTS]
    m = memory.serving_memory(engine, 1 << 40, "is the --memory-limit", 512)
    tokens = max(len(engine.encode(p)) for p in PROMPTS) + MAX_TOKENS
    # one fits, with less than another step of KV beside it (two need another whole row)
    limit = limit_for_room(m, m.alone(tokens) + m.kv(tokens) // 2)
    srv = start(engine, memory_limit=limit)
    yield srv, alone
    stop(srv)


def get(srv, path: str) -> str:
    with urllib.request.urlopen(srv.url + path, timeout=30) as r:
        return r.read().decode()


def gauge(srv, name: str) -> float:
    line = next(ln for ln in get(srv, "/metrics").splitlines() if ln.startswith(name + " "))
    return float(line.split()[1])


def test_a_second_request_waits_for_memory_and_is_answered_after_the_first(one_at_a_time):
    srv, alone = one_at_a_time
    answers: dict[int, str] = {}

    def ask(i: int) -> None:
        status, payload, _ = post(srv.url, "/v1/completions", {
            "prompt": PROMPTS[i], "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True})
        assert status == 200, payload
        answers[i] = "".join(e["choices"][0]["text"] for e in sse_events(payload)
                             if e != "[DONE]")

    first, second = (threading.Thread(target=ask, args=(i,)) for i in (0, 1))
    first.start()
    deadline = time.time() + 30
    while not any(j.opened for j in srv.worker.jobs) and first.is_alive():
        assert time.time() < deadline
        time.sleep(0.005)
    second.start()
    most_open, waiting = 0, []
    while first.is_alive() or second.is_alive():
        most_open = max(most_open, sum(1 for j in list(srv.worker.jobs) if j.opened))
        if not waiting and gauge(srv, "mlxspec_requests_waiting_for_memory") == 1:
            waiting = [s for s in json.loads(get(srv, "/slots"))
                       if s.get("waiting_for") == "memory"]
        time.sleep(0.002)
    assert most_open == 1  # one at a time: the second opened once the first had closed
    assert len(waiting) == 1 and waiting[0]["memory"]["needed_bytes"] > 0
    assert [answers[0], answers[1]] == alone  # each as decoded alone
    assert gauge(srv, "mlxspec_requests_waiting_for_memory") == 0
    # the first's prompt cache made room for the second (least recently used out)
    assert len(srv.worker.cache.entries) <= 1
    assert gauge(srv, "mlxspec_memory_limit_bytes") == srv.memory.limit


def test_a_request_that_cannot_fit_alone_is_refused_with_the_numbers(one_at_a_time):
    srv, _ = one_at_a_time
    status, payload, _ = post(srv.url, "/v1/completions",
                              {"prompt": PROMPTS[0], "max_tokens": 3000})
    error = json.loads(payload)["error"]
    assert status == 400 and error["code"] == "exceeds_memory", error
    numbers = error["memory"]
    longest = numbers["longest_max_tokens"]
    assert numbers["prompt_tokens"] == len(PROMPTS[0]) and numbers["max_tokens"] == 3000
    assert numbers["needed_bytes"] > numbers["available_bytes"] > 0
    assert f"max_tokens {longest} would fit" in error["message"]
    assert MAX_TOKENS <= longest < 3000
    # the figure is exact: one more is refused, it is answered
    status, _, _ = post(srv.url, "/v1/completions", {"prompt": PROMPTS[0],
                                                     "max_tokens": longest + 1})
    assert status == 400
    status, payload, _ = post(srv.url, "/v1/completions", {"prompt": PROMPTS[0],
                                                           "max_tokens": longest})
    assert status == 200, payload
