"""The server's constrained output, log-probabilities and logit biases, answered as
llama-server and OpenAI answer them: `response_format` (json_object, json_schema), llama.cpp's
`json_schema` and `grammar`; chat `logprobs`/`top_logprobs`, `/v1/completions` `logprobs`,
`/completion` `n_probs` (+ `post_sampling_probs`); `logit_bias` in both forms; a malformed value
of any of them is a 400 that says what is wrong."""

from __future__ import annotations

import json
import math

import jsonschema
import pytest
from server_helpers import call, post, start, stop
from server_helpers import stream as server_stream

import mlxspec

PROMPT = "def add(a, b):\n    return "
CHAT = [{"role": "user", "content": "Give me a color as JSON"}]
SCHEMA = {"type": "object",
          "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                  "maxItems": 2}},
          "required": ["color", "ok", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def srv(model_dirs):
    engine = mlxspec.load(str(model_dirs["qwen2"]), mode="ngram", num_draft=4)
    srv = start(engine, spec_max_concurrency=2, max_batch=4)
    yield srv
    stop(srv)


def stream(srv, path, body):
    return [e for e in server_stream(srv, path, body) if e != "[DONE]"]


# ----------------------------------------------------------------------------- grammars


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA, "strict": True}},
    {"type": "json_object", "schema": SCHEMA},
])
def test_response_format_constrains_a_chat_answer(srv, fmt):
    status, body = call(srv, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 400,
                                                      "response_format": fmt})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


def test_json_object_answers_an_object(srv):
    status, body = call(srv, "/v1/chat/completions", {
        "messages": CHAT, "max_tokens": 16, "response_format": {"type": "json_object"}})
    assert status == 200
    assert body["choices"][0]["message"]["content"].startswith("{")


@pytest.mark.parametrize("mode", ["none", "ngram"])
def test_llama_grammar_and_json_schema(srv, mode):
    spec = {"speculative": {"mode": mode}}
    status, body = call(srv, "/completion", {"prompt": PROMPT, "n_predict": 20, **spec,
                                             "grammar": 'root ::= ("yes" | "no") " " [0-9]'})
    assert status == 200, body
    assert body["content"][:3] in ("yes", "no ") and body["stop_type"] == "eos"
    assert body["generation_settings"]["grammar"].startswith("root ::=")
    status, body = call(srv, "/completion", {"prompt": PROMPT, "n_predict": 400, **spec,
                                             "json_schema": SCHEMA})
    assert status == 200, body
    jsonschema.validate(json.loads(body["content"]), SCHEMA)


def test_a_constrained_answer_streams_the_same_text(srv):
    req = {"prompt": PROMPT, "n_predict": 400, "json_schema": SCHEMA}
    whole = call(srv, "/completion", req)[1]["content"]
    events = stream(srv, "/completion", req)
    assert "".join(e["content"] for e in events) == whole


@pytest.mark.parametrize("path,extra,words", [
    ("/completion", {"grammar": 'root ::= ("a"'}, "grammar"),
    ("/completion", {"grammar": "root ::= x", "json_schema": SCHEMA}, "but not both"),
    ("/v1/chat/completions", {"json_schema": SCHEMA,
                              "response_format": {"type": "json_object"}}, "once"),
    ("/completion", {"json_schema": {"type": "object", "properties": 5}}, "json_schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema",
                                                  "json_schema": {"schema": 5}}}, "object"),
    ("/completion", {"grammar": 5}, "string"),
])
def test_malformed_grammars_are_400(srv, path, extra, words):
    body = {"messages": CHAT} if "chat" in path else {"prompt": PROMPT}
    status, payload = call(srv, path, {**body, "max_tokens": 4, **extra})
    assert status == 400, payload
    assert words in payload["error"]["message"]


# ----------------------------------------------------------------------------- log-probabilities


def test_chat_logprobs(srv):
    status, body = call(srv, "/v1/chat/completions", {
        "messages": CHAT, "max_tokens": 10, "logprobs": True, "top_logprobs": 3})
    assert status == 200, body
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"]
    # (a token may be part of a character: its bytes join into the text, its string is cut)
    assert b"".join(bytes(c["bytes"]) for c in content).decode("utf-8", "replace") == (
        body["choices"][0]["message"]["content"])
    for c in content:
        assert set(c) >= {"id", "token", "logprob", "bytes", "top_logprobs"}
        assert c["logprob"] <= 0 and bytes(c["bytes"]).decode("utf-8", "ignore") == c["token"]
        top = [t["logprob"] for t in c["top_logprobs"]]
        assert len(top) == 3 and top == sorted(top, reverse=True)
        assert c["top_logprobs"][0]["id"] == c["id"]  # greedy: the top one
    # logprobs without top_logprobs: the chosen token's only
    body = call(srv, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4,
                                              "logprobs": True})[1]
    assert all(c["top_logprobs"] == [] for c in body["choices"][0]["logprobs"]["content"])
    # not asked: null
    body = call(srv, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4})[1]
    assert body["choices"][0]["logprobs"] is None


def test_chat_logprobs_streamed_and_with_n(srv):
    req = {"messages": CHAT, "max_tokens": 10, "logprobs": True, "top_logprobs": 2}
    whole = call(srv, "/v1/chat/completions", req)[1]["choices"][0]["logprobs"]["content"]
    events = stream(srv, "/v1/chat/completions", req)
    got = [c for e in events for ch in e["choices"] if ch.get("logprobs")
           for c in ch["logprobs"]["content"]]
    assert [c["id"] for c in got] == [c["id"] for c in whole]
    assert all(abs(a["logprob"] - b["logprob"]) < 1e-4 for a, b in zip(got, whole))
    status, body = call(srv, "/v1/chat/completions", {**req, "n": 2, "temperature": 1.0,
                                                      "seed": 4})
    assert status == 200
    for ch in body["choices"]:
        assert len(ch["logprobs"]["content"]) >= 1


def test_completions_logprobs(srv):
    status, body = call(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8,
                                                 "logprobs": 2})
    assert status == 200, body
    choice = body["choices"][0]
    lp = choice["logprobs"]
    n = body["usage"]["completion_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
    # (a token that is part of a character has only its whole characters as its string)
    assert all(t in choice["text"] for t in lp["tokens"])
    assert lp["text_offset"][0] == 0
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(n)]
    for tok, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top[tok] == pytest.approx(v) and len(top) <= 3


@pytest.mark.parametrize("settings", [{}, {"temperature": 1.0, "seed": 3}])
def test_n_probs_are_nones_in_every_mode(srv, settings):
    """llama.cpp's n_probs from the verify forward: the same as mode none's, to 1e-4."""
    answers = {}
    for mode in ("none", "ngram", "auto"):
        status, body = call(srv, "/completion", {
            "prompt": PROMPT * 3, "n_predict": 24, "n_probs": 4,
            "speculative": {"mode": mode}, **settings})
        assert status == 200, body
        answers[mode] = body
    ref = answers["none"]["completion_probabilities"]
    assert len(ref) == answers["none"]["tokens_predicted"]
    for mode, body in answers.items():
        assert body["content"] == answers["none"]["content"], mode
        for a, b in zip(body["completion_probabilities"], ref):
            assert a["id"] == b["id"] and abs(a["logprob"] - b["logprob"]) < 1e-4
            assert [t["id"] for t in a["top_logprobs"]] == [t["id"] for t in b["top_logprobs"]]
            assert all(abs(x["logprob"] - y["logprob"]) < 1e-4
                       for x, y in zip(a["top_logprobs"], b["top_logprobs"]))


def test_n_probs_streamed_and_post_sampling(srv):
    req = {"prompt": PROMPT, "n_predict": 6, "n_probs": 3}
    events = stream(srv, "/completion", req)
    probs = [p for e in events[:-1] for p in e.get("completion_probabilities", [])]
    whole = call(srv, "/completion", req)[1]["completion_probabilities"]
    assert [p["id"] for p in probs] == [p["id"] for p in whole]
    status, body = call(srv, "/completion", {**req, "post_sampling_probs": True,
                                             "temperature": 0.8, "top_k": 2, "seed": 1})
    assert status == 200
    for p in body["completion_probabilities"]:
        assert 0 < p["prob"] <= 1 and "logprob" not in p
        assert len(p["top_probs"]) <= 2  # top_k 2: the others have probability 0
        assert sum(t["prob"] for t in p["top_probs"]) == pytest.approx(1, abs=1e-4)


@pytest.mark.parametrize("path,extra,words", [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 3}, "true or false"),
    ("/v1/chat/completions", {"top_logprobs": 3}, "requires logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/completion", {"n_probs": -1}, "n_probs"),
    ("/completion", {"logprobs": True}, "n_probs"),
    ("/completion", {"n_probs": 2, "post_sampling_probs": "yes"}, "post_sampling_probs"),
])
def test_malformed_probability_fields_are_400(srv, path, extra, words):
    body = {"messages": CHAT} if "chat" in path else {"prompt": PROMPT}
    status, payload = call(srv, path, {**body, "max_tokens": 4, **extra})
    assert status == 400, payload
    assert words in payload["error"]["message"]


# ----------------------------------------------------------------------------- logit bias


def test_logit_bias_in_both_forms(srv):
    plain = call(srv, "/completion", {"prompt": PROMPT, "n_predict": 8, "return_tokens": True})
    first = plain[1]["tokens"][0]
    for bias in ({str(first): -100}, [[first, False]], {str(first): False}):
        body = call(srv, "/completion", {"prompt": PROMPT, "n_predict": 8,
                                         "return_tokens": True, "logit_bias": bias})[1]
        assert first not in body["tokens"], bias
    forced = call(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5,
                                           "logit_bias": {"42": 100}, "logprobs": 0})[1]
    assert forced["choices"][0]["logprobs"]["tokens"] == [
        forced["choices"][0]["logprobs"]["tokens"][0]] * 5
    # a text's tokens (llama.cpp's form)
    status, _ = call(srv, "/completion", {"prompt": PROMPT, "n_predict": 4,
                                          "logit_bias": [["return", -5.0]]})
    assert status == 200


@pytest.mark.parametrize("bias,words", [
    ({"999999": 1}, "outside the vocabulary"), ([[1]], "pair"), ({"5": "x"}, "number or false"),
    ({"5": math.nan}, "not a number"), ("x", "must be an object"),
])
def test_malformed_logit_bias_is_400(srv, bias, words):
    status, payload, _ = post(srv.url, "/v1/completions",
                              {"prompt": PROMPT, "max_tokens": 4, "logit_bias": bias})
    payload = json.loads(payload)
    assert status == 400, payload
    assert words in payload["error"]["message"]


# ----------------------------------------------------------------------------- in a batch


def test_rows_with_per_row_work_answer_the_same_in_a_batch(srv):
    """A constrained row, a row with log-probabilities and a biased one, decoded together
    (ragged rows of one batch, each at its own position) answer as each does alone."""
    import threading

    reqs = [{"prompt": PROMPT, "n_predict": 120, "json_schema": SCHEMA},
            {"prompt": PROMPT * 2, "n_predict": 40, "n_probs": 2},
            {"prompt": "import os\n", "n_predict": 40, "logit_bias": [[5, False]],
             "temperature": 1.0, "seed": 8},
            {"prompt": "x = [", "n_predict": 40}]
    alone = [call(srv, "/completion", r)[1] for r in reqs]
    together: list = [None] * len(reqs)

    def ask(i):
        together[i] = call(srv, "/completion", reqs[i])[1]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for a, b in zip(alone, together):
        assert a["content"] == b["content"]
    for a, b in zip(alone[1]["completion_probabilities"], together[1]["completion_probabilities"]):
        assert a["id"] == b["id"] and abs(a["logprob"] - b["logprob"]) < 1e-4
