"""The Anthropic Messages API (`/v1/messages`, `/v1/messages/count_tokens`): text and tool_use
answers, whole and streamed (the events Claude Code needs, in order), the request's conversion
(system prompts, tool results, Claude Code's billing block), stop reasons, usage with the
prompt cache's tokens, errors in Anthropic's shape, the official SDK, and replays of requests
Claude Code sent (tests/fixtures/anthropic/, their long texts trimmed)."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest
from server_helpers import post, start, stop
from test_server_tools import ADD, SYNTAX, TOOLS

import mlxspec
from mlxspec.server import anthropic as anthropic_answer
from mlxspec.server.answers import Usage
from mlxspec.server.anthropic import Answer, chat_body, error_response
from mlxspec.server.metrics import Metrics
from mlxspec.server.protocol import ApiError, GenRequest
from mlxspec.server.worker import Delta, Done, Failed

KEY = "sekrit"
FIXTURES = Path(__file__).parent / "fixtures" / "anthropic"
# TOOLS in Anthropic's shape
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]
SCHEMAS = {t["name"]: t["input_schema"] for t in ANTHROPIC_TOOLS}
ASK = [{"role": "user", "content": "def f(x):"}]


@pytest.fixture(scope="module")
def srv(tools_model_dir):
    # a longer context than the model's 1024 positions: Claude Code's (trimmed) requests fit
    engine = mlxspec.load(str(tools_model_dir), mode="auto", num_draft=4, max_context=8192)
    server = start(engine, api_key=KEY)
    yield server
    stop(server)


def messages(srv, body: dict, path: str = "/v1/messages?beta=true") -> tuple[int, dict]:
    status, payload, _ = post(srv.url, path, body, headers={"x-api-key": KEY})
    return status, json.loads(payload)


def events(srv, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of a streamed answer, checked to agree."""
    status, payload, resp = post(srv.url, "/v1/messages?beta=true", {**body, "stream": True},
                                 headers={"x-api-key": KEY})
    assert status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    out = []
    for chunk in payload.decode().strip().split("\n\n"):
        name, data = chunk.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        out.append((event["type"], event))
    return out


def text_of(message: dict) -> str:
    return "".join(b["text"] for b in message["content"] if b["type"] == "text")


def streamed(evs: list[tuple[str, dict]]) -> dict:
    """The message a stream builds: blocks by index, deltas concatenated, checked in order."""
    names = [n for n, _ in evs]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta",
                                                                      "message_stop"]
    start_ = evs[0][1]["message"]
    assert start_["content"] == [] and start_["id"].startswith("msg_")
    blocks, open_ = [], None
    for name, e in evs[2:-2]:
        if name == "content_block_start":
            assert open_ is None and e["index"] == len(blocks)
            blocks.append(copy.deepcopy(e["content_block"]))
            open_, json_text = e["index"], ""
        elif name == "content_block_delta":
            assert e["index"] == open_
            if e["delta"]["type"] == "text_delta":
                blocks[open_]["text"] += e["delta"]["text"]
            else:
                assert e["delta"]["type"] == "input_json_delta"
                json_text += e["delta"]["partial_json"]
        else:
            assert name == "content_block_stop" and e["index"] == open_
            if blocks[open_]["type"] == "tool_use":
                assert blocks[open_]["input"] == {}
                blocks[open_]["input"] = json.loads(json_text)
            open_ = None
    assert open_ is None
    delta = evs[-2][1]
    return {**start_, "content": blocks, **delta["delta"], "usage": delta["usage"]}


def test_a_text_answer(srv):
    status, body = messages(srv, {"model": "mlxspec", "max_tokens": 12, "messages": ASK})
    assert status == 200, body
    assert body["type"] == "message" and body["role"] == "assistant"
    assert body["id"].startswith("msg_") and body["content"][0]["type"] == "text"
    assert body["stop_reason"] in ("end_turn", "max_tokens") and body["stop_sequence"] is None
    usage = body["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] > 0
    assert 0 < usage["output_tokens"] <= 12 and usage["speculative"]["mode"]
    assert "timings" not in body


def test_the_stream_is_the_answer_event_by_event(srv):
    req = {"max_tokens": 24, "messages": ASK, "temperature": 0}
    whole = messages(srv, req)[1]
    evs = events(srv, req)
    got = streamed(evs)
    assert [b["type"] for b in got["content"]] == ["text"]
    assert text_of(got) == text_of(whole) and got["stop_reason"] == whole["stop_reason"]
    assert got["usage"]["output_tokens"] == whole["usage"]["output_tokens"]
    assert evs[0][1]["message"]["usage"]["input_tokens"] > 0


def test_system_prompts_are_folded_first_and_the_billing_block_dropped(srv):
    body = {"max_tokens": 4, "system": [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.123;"},
        {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "Use Python."}],
        "messages": [ASK[0], {"role": "system", "content": "Agents: none."},
                     {"role": "assistant", "content": "ok"},
                     {"role": "user", "content": [{"type": "text", "text": "a"},
                                                  {"type": "text", "text": "b"}]}]}
    status, got = messages(srv, chat_body(body), "/apply-template")
    assert status == 200
    assert got["prompt"] == ("<|im_start|>system\nBe brief.\n\nUse Python.\n\nAgents: none."
                             "<|im_end|>\n<|im_start|>user\ndef f(x):<|im_end|>\n"
                             "<|im_start|>assistant\nok<|im_end|>\n<|im_start|>user\na\n\nb"
                             "<|im_end|>\n<|im_start|>assistant\n")
    for system in ("Be brief.", body["system"]):
        status, answer = messages(srv, {**body, "system": system})
        assert status == 200, answer


def test_a_stop_sequence_ends_the_answer(srv):
    req = {"max_tokens": 40, "messages": ASK, "temperature": 0}
    text = text_of(messages(srv, req)[1])
    assert len(text) > 6, text
    stop_at = text[4:6]
    for body in (messages(srv, {**req, "stop_sequences": [stop_at]})[1],
                 streamed(events(srv, {**req, "stop_sequences": [stop_at]}))):
        assert body["stop_reason"] == "stop_sequence" and body["stop_sequence"] == stop_at
        assert text_of(body) == text[:text.index(stop_at)]


def test_max_tokens_ends_the_answer(srv):
    body = messages(srv, {"max_tokens": 2, "messages": ASK, "temperature": 0})[1]
    assert body["stop_reason"] == "max_tokens" and body["usage"]["output_tokens"] == 2


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "edit_file"},
                                    {"type": "any", "disable_parallel_tool_use": True}])
def test_a_forced_tool_call_is_a_valid_tool_use_block(srv, choice):
    req = {"max_tokens": 200, "messages": ASK, "tools": ANTHROPIC_TOOLS, "tool_choice": choice,
           "temperature": 0}
    whole = messages(srv, req)[1]
    got = streamed(events(srv, req))
    for body in (whole, got):
        assert body["stop_reason"] == "tool_use"
        uses = [b for b in body["content"] if b["type"] == "tool_use"]
        assert len(uses) == 1 and uses[0]["id"].startswith("toolu_")
        assert choice["type"] == "any" or uses[0]["name"] == choice["name"]
        jsonschema.validate(uses[0]["input"], SCHEMAS[uses[0]["name"]])
    assert [(b["name"], b["input"]) for b in got["content"]] == \
        [(b["name"], b["input"]) for b in whole["content"]]


def test_a_forced_call_is_the_same_in_every_mode(srv):
    inputs = {}
    for mode in ("none", "ngram", "suffix", "auto"):
        status, body = messages(srv, {
            "max_tokens": 120, "messages": ASK, "tools": ANTHROPIC_TOOLS, "temperature": 0,
            "tool_choice": {"type": "any"}, "speculative": {"mode": mode}})
        assert status == 200, (mode, body)
        inputs[mode] = [(b["name"], b["input"]) for b in body["content"]]
    assert all(got == inputs["none"] for got in inputs.values()), inputs


def test_a_tool_result_round_trip(srv):
    turn = ASK + [
        {"role": "assistant", "content": [
            {"type": "text", "text": "Adding."},
            {"type": "tool_use", "id": "toolu_7", "name": "add", "input": {"a": 1, "b": 2}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_7", "content": [
                {"type": "text", "text": "3"}], "is_error": False},
            {"type": "text", "text": "and now?"}]}]
    body = {"max_tokens": 4, "messages": turn, "tools": ANTHROPIC_TOOLS}
    status, got = messages(srv, chat_body(body), "/apply-template")
    assert status == 200
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}'
            '\n</tool_call><|im_end|>\n<|im_start|>tool\n3<|im_end|>\n<|im_start|>user\n'
            'and now?<|im_end|>\n') in got["prompt"]
    assert messages(srv, body)[0] == 200


def test_count_tokens_is_the_prompt_of_the_request(srv):
    body = {"model": "mlxspec", "system": "Count me.", "messages": ASK + [
        {"role": "assistant", "content": "x"}, {"role": "user", "content": "count tokens"}],
        "tools": ANTHROPIC_TOOLS}
    status, counted = messages(srv, body, "/v1/messages/count_tokens?beta=true")
    assert status == 200 and list(counted) == ["input_tokens"], counted
    usage = messages(srv, {**body, "max_tokens": 2})[1]["usage"]
    assert counted["input_tokens"] == usage["input_tokens"] + usage["cache_read_input_tokens"]


def test_a_later_turn_reads_the_earlier_one_from_the_prompt_cache(srv):
    first = {"max_tokens": 8, "temperature": 0, "system": "Cache test.",
             "messages": [{"role": "user", "content": "one two three four five six"}]}
    answer = messages(srv, first)[1]
    prompt = answer["usage"]["input_tokens"] + answer["usage"]["cache_read_input_tokens"]
    second = {**first, "messages": first["messages"] + [
        {"role": "assistant", "content": answer["content"]},
        {"role": "user", "content": "seven"}]}
    usage = messages(srv, second)[1]["usage"]
    assert usage["cache_read_input_tokens"] >= prompt - 1 > 0


def test_the_api_key_is_required(srv):
    status, payload, _ = post(srv.url, "/v1/messages", {"max_tokens": 2, "messages": ASK})
    assert status == 401
    status, payload, _ = post(srv.url, "/v1/messages", {"max_tokens": 2, "messages": ASK},
                              headers={"x-api-key": "wrong"})
    assert status == 401


BAD = [
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]},
     "messages[0].content[0].type"),
    ({"tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    ({"tools": [{"name": "f", "input_schema": "not a schema"}]}, "tools[0].input_schema"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object", "properties": 5}}]},
     "tools[0].input_schema"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"messages": ASK + [{"role": "assistant", "content": "x"}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "3"}]}]},
     "messages[2].content[0].tool_use_id"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"stop_sequences": "END"}, "stop_sequences"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format"),
]


@pytest.mark.parametrize("change,field", BAD)
def test_bad_input_is_400_in_anthropics_shape_naming_the_field(srv, change, field):
    body = {k: v for k, v in {"max_tokens": 4, "messages": ASK, "tools": ANTHROPIC_TOOLS,
                              **change}.items() if v is not None}
    status, got = messages(srv, body)
    assert status == 400, got
    assert got["type"] == "error" and got["error"]["type"] == "invalid_request_error"
    assert field in got["error"]["message"], got


def test_a_prompt_over_the_context_is_refused_in_anthropics_words(srv):
    status, got = messages(srv, {"max_tokens": 4, "messages": [
        {"role": "user", "content": "hello world " * 5000}]})
    assert status == 400
    assert got["error"]["message"].startswith("prompt is too long: ")
    assert got["error"]["message"].endswith(" tokens > 8192 maximum")


def test_errors_keep_their_status_and_retry_after():
    busy = error_response(ApiError(503, "the queue is full", retry_after=2))
    assert busy.status_code == 503 and busy.headers["retry-after"] == "2"
    assert json.loads(busy.body) == {"type": "error", "error": {
        "type": "overloaded_error", "message": "the queue is full"}}
    for status, kind in ((401, "authentication_error"), (404, "not_found_error"),
                         (413, "request_too_large"), (500, "api_error")):
        assert json.loads(error_response(ApiError(status, "x")).body)["error"]["type"] == kind


def test_the_official_sdk_reads_the_answers(srv):
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0, timeout=60)
    args = {"model": "mlxspec", "max_tokens": 16, "messages": ASK}  # the server's T=0
    made = client.messages.create(**args)
    assert made.type == "message" and made.content[0].type == "text"
    with client.messages.stream(**args) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == made.content[0].text == final.content[0].text
    assert final.stop_reason == made.stop_reason
    assert final.usage.output_tokens == made.usage.output_tokens
    with client.messages.stream(**args | {"max_tokens": 200}, tools=ANTHROPIC_TOOLS,
                                tool_choice={"type": "tool", "name": "search"}) as s:
        final = s.get_final_message()
    use = final.content[-1]
    assert final.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "search"
    jsonschema.validate(use.input, SCHEMAS["search"])
    counted = client.messages.count_tokens(model="mlxspec", messages=ASK, system="Count.")
    assert counted.input_tokens > 0
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client.messages.create(model="mlxspec", max_tokens=None, messages=ASK)


def claude_code(name: str) -> dict:
    body = json.loads((FIXTURES / name).read_text())
    return {**body, "max_tokens": 16}  # the random model could go on for 32000 tokens


def test_claude_code_s_billing_block_does_not_change_the_prompt():
    body = claude_code("claude_code_turn2.json")
    other = copy.deepcopy(body)
    other["system"][0]["text"] = "x-anthropic-billing-header: cc_version=2.1.197.e6a; x;"
    assert chat_body(other) == chat_body(body)
    assert chat_body(body)["messages"][0]["content"].startswith("You are a Claude agent")


@pytest.mark.parametrize("name,turn", [("claude_code_title.json", None),
                                       ("claude_code_turn2.json", 2),
                                       ("claude_code_turn2.json", None)])
def test_claude_code_s_requests_are_answered(srv, name, turn):
    """The title request (structured output, no tools), the first turn (25 tools, a system
    message mid-conversation, thinking, context_management) and the turn after a tool's
    result: streamed with the events Claude Code needs, and whole (its fallback)."""
    body = claude_code(name)
    body["model"] = "mlxspec"
    body["messages"] = body["messages"][:turn]
    assert body["stream"] is True
    got = streamed(events(srv, body))
    assert got["content"] and got["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
    del body["stream"]
    status, whole = messages(srv, body)
    assert status == 200 and whole["content"], whole


class Events:
    """A job group's stand-in: the events put on its queue."""

    def __init__(self, req, evs):
        self.req, self.jobs = req, []
        self.events = asyncio.Queue()

    def cancel(self):
        pass


def relayed(evs, stream: bool, late: float = 0.0, tools: list | None = None) -> tuple[int, str]:
    """(status, body) of the answer to these events (given `late` seconds late; with `tools`,
    the answer's calls read in the `json_tools` syntax)."""
    sent = []

    async def send(message):
        sent.append(message.get("body", b""))

    async def run():
        req = GenRequest("chat", [1, 2, 3], 8, stream=stream, model="m")
        req.tools = tools
        answer = Answer(Events(req, []), {}, SimpleNamespace(tool_syntax=SYNTAX), Metrics(),
                        5.0)
        answer.send = send
        for ev in evs:
            asyncio.get_running_loop().call_later(late, answer.group.events.put_nowait, (0, ev))
        return await answer.relay()

    return asyncio.run(run()), b"".join(sent).decode()


FAILURE = Failed(ApiError(500, "the model failed"))
ERROR = {"type": "error", "error": {"type": "api_error", "message": "the model failed"}}


def test_a_failure_is_an_error_answer_or_an_error_event():
    status, body = relayed([FAILURE], stream=False)
    assert status == 500 and json.loads(body) == ERROR
    for evs in ([FAILURE], [Delta("hi", 1), FAILURE]):
        status, body = relayed(evs, stream=True)
        assert status == 500 and body.startswith("event: message_start\n")
        assert body.endswith(f"event: error\ndata: {json.dumps(ERROR, separators=(',', ':'))}"
                             "\n\n")


def test_a_stream_pings_while_the_prompt_is_prefilled(monkeypatch):
    monkeypatch.setattr(anthropic_answer, "PING_SECONDS", 0.01)
    status, body = relayed([Delta("hi", 1), Done("stop", Usage(prompt_tokens=3))],
                           stream=True, late=0.2)
    names = [line.removeprefix("event: ") for line in body.splitlines()
             if line.startswith("event: ")]
    assert status == 200 and names[:2] == ["message_start", "ping"]
    assert names.count("ping") > 3 and names[-1] == "message_stop"


TEXT_AND_CALLS = ('Hi <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
                  '\nso <tool_call>{"arguments": {}, "name": "noop"}</tool_call>')


def streamed_in_pieces(text: str, size: int) -> tuple[list, list, dict]:
    """`text` fed to the relay in pieces of `size` characters: the worker's events, the
    stream's events and the message they spell."""
    evs = [Delta(text[i:i + size], 1) for i in range(0, len(text), size)]
    evs.append(Done("stop", Usage(prompt_tokens=3)))
    status, body = relayed(evs, stream=True, tools=TOOLS)
    assert status == 200
    got = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: ")]
    return evs, got, streamed([(e["type"], e) for e in got])


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_tool_input_streams_as_input_json_deltas_in_the_answers_order(size):
    """Text and tool_use blocks in the order written; a JSON call's input as
    `input_json_delta` pieces as the model writes it (one piece for a call that comes whole),
    joined the JSON of the block's `input`, as in the answer given whole."""
    evs, got, message = streamed_in_pieces(TEXT_AND_CALLS, size)
    assert [(b["type"], b.get("name"), b.get("text"), b.get("input")) for b in
            message["content"]] == [("text", None, "Hi ", None),
                                    ("tool_use", "add", None, {"a": 1, "b": 2}),
                                    ("text", None, "\nso ", None),
                                    ("tool_use", "noop", None, {})]
    assert message["stop_reason"] == "tool_use"
    pieces = [e["delta"]["partial_json"] for e in got if e["type"] == "content_block_delta"
              and e["index"] == 1]
    assert "".join(pieces) == '{"a": 1, "b": 2}' and (len(pieces) > 1) == (size < 1000)
    status, whole = relayed(evs, stream=False, tools=TOOLS)
    assert [{k: v for k, v in b.items() if k != "id"} for b in json.loads(whole)["content"]] \
        == [{k: v for k, v in b.items() if k != "id"} for b in message["content"]]


FENCED = f"I'll add them.\n```\n{ADD}\n```\n"


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_a_fenced_call_is_a_tool_use_block(size):
    """A call the model writes as a fenced JSON block is a tool_use block after the text
    before it (stop reason "tool_use"), its input streamed as `input_json_delta` pieces; the
    fence is in no text block."""
    evs, got, message = streamed_in_pieces(FENCED, size)
    assert [(b["type"], b.get("name"), b.get("text"), b.get("input")) for b in
            message["content"]] == [("text", None, "I'll add them.\n", None),
                                    ("tool_use", "add", None, {"a": 1, "b": 2})]
    assert message["stop_reason"] == "tool_use"
    pieces = [e["delta"]["partial_json"] for e in got if e["type"] == "content_block_delta"
              and e["index"] == 1]
    assert "".join(pieces) == '{"a": 1, "b": 2}'
    status, whole = relayed(evs, stream=False, tools=TOOLS)
    assert [{k: v for k, v in b.items() if k != "id"} for b in json.loads(whole)["content"]] \
        == [{k: v for k, v in b.items() if k != "id"} for b in message["content"]]


def test_a_bare_call_object_through_the_server_is_a_tool_use_block(srv):
    """The model made to answer a bare JSON object naming a listed tool (`output_config`'s
    format holds it to that object): a tool_use block, the same streamed."""
    schema = {"type": "object", "properties": {
        "name": {"const": "set_mode"}, "arguments": {
            "type": "object", "properties": {"mode": {"const": "fast"}},
            "required": ["mode"], "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False}
    body = {"model": "m", "messages": ASK, "tools": ANTHROPIC_TOOLS, "max_tokens": 300,
            "temperature": 0, "output_config": {"format": {"type": "json_schema",
                                                           "schema": schema}}}
    status, message = messages(srv, body)
    assert status == 200, message
    assert [(b["type"], b.get("name"), b.get("input")) for b in message["content"]] == [
        ("tool_use", "set_mode", {"mode": "fast"})]
    assert message["stop_reason"] == "tool_use"
    got = streamed(events(srv, body))
    assert [(b["type"], b.get("name"), b.get("input")) for b in got["content"]] == [
        ("tool_use", "set_mode", {"mode": "fast"})]
