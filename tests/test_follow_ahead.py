"""An answer cut by an editor's t_max_predict_ms decodes on while the server is idle
(`Worker._looks_ahead`): the follow-up that takes it as accepted is proposed from the store,
and answers what the model alone answers."""

from __future__ import annotations

import json
import time

import pytest
from conftest import ByteTokenizer, make_engine
from server_helpers import post, start, stop

from mlxspec.cost import StepCost
from mlxspec.engine import Engine

N_PREDICT = 48


class SwappedNewline(ByteTokenizer):
    """Bytes, with `newline` and "\\n" swapped: the random model's answer has a newline
    where the test wants one (where t_max_predict_ms may cut)."""

    def __init__(self, newline: int):
        super().__init__()
        self.newline = newline

    def decode(self, ids, **kw):
        swap = {self.newline: 10, 10: self.newline}
        return super().decode([swap.get(int(i), int(i)) for i in ids])


class FrozenCost(StepCost):
    """The prior's step costs, never learnt: `auto` decides from acceptance, not timing."""

    def add(self, *args, **kwargs) -> None:
        pass


def cut_engine(model, mode: str) -> tuple[Engine, list[int], list[int]]:
    """An engine (its costs frozen) whose greedy answer to the prompt has a newline at its
    third token, the prompt, and that answer."""
    prompt = [40 + i % 5 for i in range(12)]
    answer = make_engine(model).generate(prompt, max_tokens=N_PREDICT, mode="none").tokens
    assert len(answer) == N_PREDICT and answer[2] not in answer[:2]
    engine = Engine(model, SwappedNewline(answer[2]), mode=mode, num_draft=8)
    engine.cost = FrozenCost()
    return engine, prompt, answer


def completion(srv, prompt: list[int], n_predict: int, **extra) -> dict:
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    status, payload, _ = post(url, "/completion", {"prompt": prompt, "n_predict": n_predict,
                                                   "cache_prompt": True, **extra})
    assert status == 200, payload
    return json.loads(payload)


def settle(srv, timeout: float = 60.0) -> None:
    """Wait until the worker holds no job (looking ahead ends at the row's n_predict)."""
    end = time.time() + timeout
    while srv.worker.jobs and time.time() < end:
        time.sleep(0.02)
    assert not srv.worker.jobs


@pytest.mark.parametrize("mode", ["suffix", "auto"])
def test_a_follow_up_is_proposed_from_what_was_decoded_ahead(llama_pair, mode):
    engine, prompt, answer = cut_engine(llama_pair[0], mode)
    per_forward = {}
    for ahead in (True, False):
        srv = start(engine.clone(), follow_ahead=ahead)
        try:
            first = completion(srv, prompt, N_PREDICT, t_max_predict_ms=1)
            shown = first["tokens_predicted"]
            assert first["stop_type"] == "limit" and shown < N_PREDICT  # cut by time
            assert first["content"] == engine.tokenizer.decode(answer[:shown])
            settle(srv)
            looked = srv.metrics.ahead_tokens
            assert looked == (N_PREDICT - shown if ahead else 0)
            forwards = sum(srv.metrics.forwards.values())
            follow = completion(srv, prompt + answer[:shown], N_PREDICT - shown)
            forwards = sum(srv.metrics.forwards.values()) - forwards
            # the follow-up answers what the model alone answers
            assert follow["content"] == engine.tokenizer.decode(answer[shown:])
            per_forward[ahead] = follow["tokens_predicted"] / forwards
        finally:
            stop(srv)
    assert per_forward[True] >= 3.0 and per_forward[True] > 1.5 * per_forward[False], per_forward


def test_a_new_request_ends_looking_ahead_and_keeps_what_it_decoded(llama_pair):
    """A request arriving while a row decodes ahead closes it first (its tokens go into the
    store and its cache back to the prompt cache store); the request itself is exact."""
    engine, prompt, answer = cut_engine(llama_pair[0], "suffix")
    other = [200 + i % 7 for i in range(10)]
    want = engine.clone().generate(other, max_tokens=16, mode="none").tokens
    srv = start(engine.clone())
    try:
        completion(srv, prompt, N_PREDICT, t_max_predict_ms=1)
        got = completion(srv, other, 16)  # sent at once: the row decoding ahead yields
        assert got["content"] == engine.tokenizer.decode(want)
        settle(srv)
        assert srv.metrics.ahead_tokens < N_PREDICT
        assert srv.worker.active() == 0 and srv.worker.idle()
    finally:
        stop(srv)
