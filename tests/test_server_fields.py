"""llama-server's behaviour where it does not depend on the model's words, checked as its own
test suite (tools/server/tests/unit in ggml-org/llama.cpp) checks it: several prompts and
answers per request, the fields of answers and chunks, GET /slots, the errors and their
words, and the end-of-generation tokens."""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest
from server_helpers import call, start, stop, stream

import mlxspec
from mlxspec.gguf.tokenizer import eog_token_ids

PROMPT = "def add(a, b):\n    return "
CHAT = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]
CANDIDATES = [PROMPT, "class A:\n    def f(self):\n        ", "import os\nimport sys\n", "x = [",
              "for i in range(10):\n    ", "# a comment\n"]


@pytest.fixture(scope="module")
def setup(model_dirs):
    """A server on the tiny qwen2 model, and (computed first: one MLX thread at a time) a
    prompt whose greedy answer runs 120 tokens, for the tests that look at a running one."""
    ref = mlxspec.load(str(model_dirs["qwen2"]), mode="none")
    long_prompt = next((p for p in CANDIDATES
                        if ref.generate(p, max_tokens=120).finish_reason == "length"), None)
    engine = mlxspec.load(str(model_dirs["qwen2"]), mode="ngram", num_draft=4)
    srv = start(engine, spec_max_concurrency=2, max_batch=4)
    yield srv, long_prompt
    stop(srv)


@pytest.fixture(scope="module")
def srv(setup):
    return setup[0]


def get(srv, path):
    conn = http.client.HTTPConnection(*srv.server_address[:2], timeout=30)
    conn.request("GET", path)
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


def tokens(srv, text, add_special=True):
    return call(srv, "/tokenize", {"content": text, "add_special": add_special})[1]["tokens"]


# ----------------------------------------------------------------------------- several answers


def test_several_prompts_on_completion(srv):
    """test_completion_with_tokens_input: [ids, ids], [ids, text], one mixed sequence."""
    ids = tokens(srv, PROMPT)
    status, one = call(srv, "/completion", {"prompt": ids, "n_predict": 8})
    assert status == 200 and isinstance(one["content"], str)
    status, two = call(srv, "/completion", {"prompt": [ids, ids], "n_predict": 8})
    assert status == 200 and isinstance(two, list) and len(two) == 2
    assert [b["index"] for b in two] == [0, 1]
    assert two[0]["content"] == two[1]["content"] == one["content"]
    status, mixed = call(srv, "/completion", {"prompt": [ids, PROMPT], "n_predict": 8})
    assert status == 200 and len(mixed) == 2 and mixed[0]["content"] == mixed[1]["content"]
    status, seq = call(srv, "/completion", {"prompt": [1, 2, 3, PROMPT, 4, 5, PROMPT],
                                            "n_predict": 4})
    assert status == 200 and isinstance(seq["content"], str)
    # each answer in the order asked: the second prompt's answer is the one it gets alone
    other = "x = ["
    status, both = call(srv, "/completion", {"prompt": [PROMPT, other], "n_predict": 8})
    alone = call(srv, "/completion", {"prompt": other, "n_predict": 8})[1]
    assert both[1]["content"] == alone["content"] and both[0]["content"] == one["content"]


def test_several_prompts_and_n_on_openai_endpoints(srv):
    status, body = call(srv, "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 6})
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1]
    alone = [call(srv, "/v1/completions", {"prompt": p, "max_tokens": 6})[1] for p in "ab"]
    assert [c["text"] for c in body["choices"]] == [a["choices"][0]["text"] for a in alone]
    assert body["usage"]["completion_tokens"] == sum(
        a["usage"]["completion_tokens"] for a in alone)
    status, body = call(srv, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 8, "n": 2})
    assert status == 200 and len(body["choices"]) == 2
    assert all(c["message"]["role"] == "assistant" for c in body["choices"])
    # sampled: each answer a job of its own, seeds seed, seed + 1
    before = srv.worker.tasks
    status, body = call(srv, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 8, "n": 3,
                                                      "temperature": 1.0, "seed": 11})
    assert status == 200 and srv.worker.tasks - before == 3
    alone = call(srv, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 8,
                                               "temperature": 1.0, "seed": 12})[1]
    assert body["choices"][1]["message"]["content"] == alone["choices"][0]["message"]["content"]


def test_n_streamed(srv):
    events = stream(srv, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 8, "n": 2,
                                                  "temperature": 1.0, "seed": 3,
                                                  "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1}
    finished = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1]
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] > 0
    events = stream(srv, "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 4})
    texts = {0: "", 1: ""}
    for e in events[:-1]:
        for c in e["choices"]:
            texts[c["index"]] += c["text"]
    body = call(srv, "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 4})[1]
    assert [texts[0], texts[1]] == [c["text"] for c in body["choices"]]


# ----------------------------------------------------------------------------- fields


def test_tokens_prompt_and_response_fields(srv):
    status, body = call(srv, "/completion", {"prompt": PROMPT, "n_predict": 8})
    assert body["tokens"] == [] and type(body["has_new_line"]) is bool
    assert body["prompt"] == PROMPT  # the prompt's text (no BOS on this tokenizer)
    status, body = call(srv, "/completion", {"prompt": PROMPT, "n_predict": 8,
                                             "return_tokens": True})
    assert len(body["tokens"]) == body["tokens_predicted"] > 0
    assert all(type(t) is int for t in body["tokens"])
    events = stream(srv, "/completion", {"prompt": PROMPT, "n_predict": 8})
    content = ""
    for e in events:
        assert type(e["stop"]) is bool
        if not e["stop"]:
            assert len(e["tokens"]) > 0 and all(type(t) is int for t in e["tokens"])
            content += e["content"]
        else:
            assert e["stop_type"] in ("limit", "eos") and "generation_settings" in e
    assert content == call(srv, "/completion", {"prompt": PROMPT, "n_predict": 8})[1]["content"]
    # an empty response_fields is every field (llama.cpp)
    status, body = call(srv, "/completion", {"prompt": PROMPT, "n_predict": 8,
                                             "response_fields": []})
    assert "generation_settings" in body and "content" in body
    fields = ["content", "generation_settings/n_predict", "prompt"]
    status, body = call(srv, "/completion", {"prompt": PROMPT, "n_predict": 8,
                                             "response_fields": fields})
    assert sorted(body) == sorted(fields) and body["generation_settings/n_predict"] == 8


def test_fingerprint_timings_and_completions_without_v1(srv):
    status, body = call(srv, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4})
    assert body["system_fingerprint"].startswith("b") and "cmpl" in body["id"]
    assert body["timings"]["predicted_n"] == body["usage"]["completion_tokens"]
    status, body = call(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
    assert body["system_fingerprint"].startswith("b") and "timings" in body
    # llama-server answers POST /completions natively
    status, body = call(srv, "/completions", {"prompt": PROMPT, "n_predict": 4})
    assert status == 200 and "content" in body and "choices" not in body
    # the chat stream: the first chunk is the role (content null), the timings ride on the
    # last chunk: the usage one when asked for, else the finish chunk
    events = stream(srv, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 6,
                                                  "stream_options": {"include_usage": True},
                                                  "timings_per_token": True})
    first = events[0]["choices"][0]["delta"]
    assert first["role"] == "assistant" and first["content"] is None
    assert "timings" not in events[0]
    usage = events[-2]
    assert usage["choices"] == [] and usage["timings"]["predicted_n"] <= 6
    assert "prompt_per_second" in usage["timings"]
    content = [e for e in events[1:-2] if e["choices"][0]["delta"].get("content")]
    assert content and all("timings" in e for e in content)  # timings_per_token
    events = stream(srv, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 6})
    assert "timings" in events[-2] and events[-2]["choices"][0]["finish_reason"]
    assert all("timings" not in e for e in events[1:-2])
    events = stream(srv, "/v1/completions", {"prompt": "Once", "max_tokens": 6})
    for e in events[:-1]:  # test_ctx_shift_disabled_stream: every chunk has a choice
        assert e["choices"][0]["finish_reason"] in (None, "length", "stop")


def test_return_progress(srv, monkeypatch):
    """test_return_progress: prompt_progress chunks while the prompt is processed; the first
    has cache == processed, the counts grow, the last has processed == total."""
    long_msg = [{"role": "user", "content": "This is a test" * 10}]
    monkeypatch.setattr(srv.worker, "prefill_chunk", 16)  # prefilled 16 tokens a step
    for _ in range(2):  # the second time, from the prompt cache
        events = stream(srv, "/v1/chat/completions", {"messages": long_msg, "max_tokens": 4,
                                                      "return_progress": True})
        progress = [e["prompt_progress"] for e in events[:-1] if "prompt_progress" in e]
        assert len(progress) >= 2
        assert progress[0]["cache"] == progress[0]["processed"]
        assert all(p["total"] == progress[0]["total"] and p["cache"] == progress[0]["cache"]
                   for p in progress)
        assert all(a["processed"] < b["processed"] for a, b in zip(progress, progress[1:]))
        assert progress[-1]["processed"] == progress[-1]["total"] > 0
    assert progress[0]["cache"] > 0
    events = stream(srv, "/completion", {"prompt": PROMPT * 8, "n_predict": 2,
                                         "return_progress": True, "cache_prompt": False})
    assert any("prompt_progress" in e and e["stop"] is False for e in events)


def test_slots(setup, model_dirs):
    srv, long_prompt = setup
    assert long_prompt is not None, "the fixture must find a prompt with a long answer"
    status, slots = get(srv, "/slots")
    assert status == 200 and len(slots) == srv.total_slots
    assert all(s["n_ctx"] == srv.config.max_context and "params" not in s for s in slots)
    props = get(srv, "/props")[1]
    assert props["endpoint_slots"] is True
    # mlxspec's own: the backend the status page shows
    assert props["backend"] in ("cpu", "metal", "cuda") and props["blas"]
    seen = []

    def watch():
        end = time.time() + 30
        while time.time() < end and not seen:
            busy = [s for s in get(srv, "/slots")[1] if s["is_processing"]]
            if busy:
                seen.extend(busy)
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    call(srv, "/completion", {"prompt": long_prompt, "n_predict": 120})
    watcher.join()
    assert seen, "a running request shows in /slots"
    slot = seen[0]
    assert slot["params"]["n_predict"] == 120 and slot["n_prompt_tokens"] > 0
    assert "prompt" not in slot and "generated" not in slot  # no text unless asked
    assert slot["next_token"][0]["n_remain"] <= 120
    engine = mlxspec.load(str(model_dirs["qwen2"]), mode="none")
    other = start(engine, slots=False)
    try:
        status, body = get(other, "/slots")
        assert status == 501 and "error" in body
    finally:
        stop(other)


# ----------------------------------------------------------------------------- errors


def test_context_size_exceeded(srv):
    big = CHAT * 100
    for path, body in [("/v1/chat/completions", {"messages": big}),
                       ("/v1/chat/completions", {"messages": big, "stream": True}),
                       ("/completion", {"prompt": PROMPT * 200, "n_predict": 64}),
                       ("/v1/completions", {"prompt": PROMPT * 200})]:
        status, payload = call(srv, path, body)
        assert status == 400, path
        err = payload["error"]
        assert err["type"] == "exceed_context_size_error"
        assert "exceeds the available context size" in err["message"]
        assert err["n_prompt_tokens"] > 0 and err["n_ctx"] == srv.config.max_context


@pytest.mark.parametrize("messages", [
    None, "string", [123], [{}], [{"role": 123}], [{"role": "system", "content": 123}],
    [{"role": "system", "content": "test"}, {}], [{"content": "hello"}],
    [{"role": "user", "content": "test"}, {"role": "assistant", "content": "test"},
     {"role": "assistant", "content": "test"}],
    [{"role": "user"}], [{"role": "user", "content": "x"}, {"role": "assistant"}],
])
def test_invalid_chat_request(srv, messages):
    status, payload = call(srv, "/v1/chat/completions", {"messages": messages})
    assert status == 400 and "error" in payload


def test_chat_generation_prompt_fields(srv):
    user = [{"role": "user", "content": "hi"}]
    both = {"messages": user + [{"role": "assistant", "content": "he"}],
            "add_generation_prompt": True, "continue_final_message": True}
    status, payload = call(srv, "/v1/chat/completions", both)
    assert status == 400 and "cannot both be true" in payload["error"]["message"]
    status, payload = call(srv, "/v1/chat/completions",
                           {"messages": user, "continue_final_message": True})
    assert status == 400
    with_gen = call(srv, "/apply-template", {"messages": user})[1]["prompt"]
    without = call(srv, "/apply-template", {"messages": user, "add_generation_prompt": False})
    assert with_gen.startswith(without[1]["prompt"]) and with_gen != without[1]["prompt"]
    assert call(srv, "/v1/chat/completions", {"messages": user, "max_tokens": 2,
                                              "add_generation_prompt": False})[0] == 200


@pytest.mark.parametrize("extra", [
    {}, {"filename": "ok"}, {"filename": 123}, {"filename": 123, "text": "abc"},
    {"filename": 123, "text": 456}, "text",
])
def test_invalid_input_extra(srv, extra):
    status, payload = call(srv, "/infill", {"input_extra": [extra], "input_prefix": "int main() {\n",
                                            "prompt": "    int n = ", "input_suffix": "}\n"})
    assert status == 400 and "error" in payload
    assert call(srv, "/infill", {"input_extra": {"text": "x"}, "input_prefix": "x"})[0] == 400


@pytest.mark.parametrize("fmt,ok", [
    ({"type": "text"}, True), ({"type": "sound"}, False),
    ({"type": "json_object", "schema": 123}, False), ({"type": "json_object"}, True),
    ({"type": "json_object", "schema": {"const": "42"}}, True),
    ({"type": "json_schema", "json_schema": {"schema": {"const": "x"}}}, True),
    ({"type": "json_schema", "json_schema": {"schema": 5}}, False), ("json", False),
])
def test_response_format(srv, fmt, ok):
    status, payload = call(srv, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2,
                                                         "response_format": fmt})
    assert status == (200 if ok else 400), payload
    if isinstance(fmt, dict) and fmt.get("type") == "sound":
        assert "but got: sound" in payload["error"]["message"]


@pytest.mark.parametrize("path,extra", [
    ("/v1/chat/completions", {"grammar": 'root ::= "a"{5,5}'}),
    ("/v1/chat/completions", {"json_schema": {"const": "42"}}),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 10}),
    ("/v1/chat/completions", {"logit_bias": {"5": -100}}),
    ("/v1/completions", {"logprobs": 2}),
    ("/completion", {"n_probs": 10}),
    ("/completion", {"logit_bias": [[5, -100]]}),
    ("/completion", {"grammar": "root ::= [a-z]+"}),
    ("/infill", {"json_schema": {"type": "string"}}),
])
def test_constrained_and_probability_fields_are_answered(srv, path, extra):
    """Constrained decoding, log-probabilities and logit biases are served (what they
    answer: tests/test_server_constrained.py)."""
    body = ({"messages": CHAT} if "chat" in path else
            {"input_prefix": "x"} if path == "/infill" else {"prompt": PROMPT})
    status, payload = call(srv, path, {**body, "max_tokens": 2, **extra})
    assert status == 200, payload


def test_neutral_values_are_answered(srv):
    for path, extra in [("/v1/chat/completions", {"logprobs": False, "logit_bias": {}}),
                        ("/completion", {"n_probs": 0, "logit_bias": [], "grammar": ""}),
                        ("/v1/completions", {"logprobs": None, "echo": False, "best_of": 1})]:
        body = {"messages": CHAT} if "chat" in path else {"prompt": PROMPT}
        assert call(srv, path, {**body, "max_tokens": 2, **extra})[0] == 200, path
    assert call(srv, "/v1/chat/completions", {"messages": CHAT, "top_logprobs": 3})[0] == 400
    assert call(srv, "/v1/completions", {"prompt": PROMPT, "echo": True})[0] == 400


# ----------------------------------------------------------------------------- end of generation


def test_eog_tokens_as_llama_cpp_computes_them():
    """llama.cpp's special_eog_ids: eos, the end-of-turn texts, and the FIM pad, repository
    and file-separator tokens (Qwen2.5-Coder's <|fim_pad|>, <|repo_name|>, <|file_sep|>)."""
    vocab = {"<|endoftext|>": 10, "<|im_end|>": 12, "<|fim_prefix|>": 13, "<|fim_pad|>": 16,
             "<|repo_name|>": 17, "<|file_sep|>": 18, "a": 0}
    assert eog_token_ids(vocab, {"eos": 12}) == [12, 10, 16, 17, 18]
    # ids the file names win over the texts
    assert eog_token_ids(vocab, {"eos": 12, "fim_sep": 0})[-1] == 0
    # gpt-oss: <|end|> does not end generation beside <|return|> and <|call|>
    oss = {"<|return|>": 1, "<|call|>": 2, "<|end|>": 3}
    assert eog_token_ids(oss) == [1, 2]
    assert eog_token_ids({"<reponame>": 4, "<|endoftext|>": 0}) == [0, 4]  # StarCoder-style


@pytest.mark.slow
def test_coder_fim_answer_stops_at_file_sep():
    """The real Qwen2.5-Coder 0.5B (GGUF): its end-of-generation set is llama.cpp's (the FIM
    pad, repository and file-separator tokens too); an answer that emits <|file_sep|> ends
    there instead of running on into another file; and llama.cpp's infill test case
    (test_infill.py, test_with_qwen_model) through /infill gives llama.cpp's text. (The
    Instruct model itself did not emit <|file_sep|> on the prompts tried, greedy or sampled:
    the stop is checked on the real vocabulary's ids as the loop receives them.)"""
    from mlxspec.gguf.sources import named_model_gguf
    from mlxspec.stats import Stats
    from mlxspec.stopstrings import Detokenizer

    engine = mlxspec.load(str(named_model_gguf("qwen2.5-coder-0.5b", quiet=True)), mode="none")
    tok = engine.tokenizer
    vocab = tok.get_vocab()
    eog = set(tok.eos_token_ids)
    assert eog == {vocab[t] for t in ("<|im_end|>", "<|endoftext|>", "<|fim_pad|>",
                                      "<|repo_name|>", "<|file_sep|>")}
    answer = list(tok.encode("n_threads();\n", add_special_tokens=False))
    after = list(tok.encode("main.c\nint x;\n", add_special_tokens=False))
    out = Detokenizer(tok, [], Stats(generated_tokens=len(answer) + 1 + len(after))).feed(
        answer + [vocab["<|file_sep|>"]] + after)
    assert (out.text, out.finish_reason, out.tokens) == ("n_threads();\n", "stop", answer)
    srv = start(engine)
    try:
        status, body = call(srv, "/infill", {
            "input_extra": [{"filename": "llama.h",
                             "text": "LLAMA_API int32_t llama_n_threads();\n"}],
            "input_prefix": "#include <cstdio>\n#include \"llama.h\"\n\nint main() {\n",
            "prompt": "    int n_threads = llama_",
            "input_suffix": "}\n", "n_predict": 24})
    finally:
        stop(srv)
    assert status == 200
    assert body["content"].startswith(
        "n_threads();\n    printf(\"Number of threads: %d\\n\", n_threads);\n    return 0;\n")
