"""OpenAI's Responses API (`POST /v1/responses`): items converted to a chat (deterministic, so
a conversation's turns share their prompt's prefix), output items and the stream's events,
tool calls (conftest's `tools_model_dir`: `json_tools` calls, `tool_choice` held by a
grammar), `previous_response_id`, errors naming the field; and the clients: the `openai`
SDK, the Agents SDK, and replays of what Codex CLI sent (tests/fixtures/responses/, texts
trimmed to the small model's context)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Literal

import jsonschema
import pytest
from server_helpers import call, post, start, stop
from test_server_tools import ADD, SCHEMAS, SYNTAX, TOOLS

import mlxspec
from mlxspec.server.answers import Usage
from mlxspec.server.metrics import Metrics
from mlxspec.server.protocol import ApiError, GenRequest
from mlxspec.server.responses import Answer, chat_body, chat_tools
from mlxspec.server.worker import Delta, Done, Failed

FIXTURES = Path(__file__).parent / "fixtures" / "responses"
# the chat tools in the Responses shape (flat)
FLAT = [{"type": "function", **t["function"]} for t in TOOLS]
ASK = "def f(x):"


@pytest.fixture(scope="module")
def srv(tools_model_dir):
    engine = mlxspec.load(str(tools_model_dir), mode="auto", num_draft=4)
    server = start(engine, model_aliases=("local-model",))  # Codex's model name
    yield server
    stop(server)


def respond(srv, body: dict) -> tuple[int, dict]:
    return call(srv, "/v1/responses", body)


def events(srv, body: dict) -> list[tuple[str, dict]]:
    """(event line, data) of each event of a streamed response that answers 200."""
    status, payload, resp = post(srv.url, "/v1/responses", {**body, "stream": True})
    assert status == 200, payload
    assert resp.getheader("content-type").startswith("text/event-stream")
    out = []
    for block in payload.decode().split("\n\n"):
        if block.strip():
            event, data = block.split("\n")
            assert event.startswith("event: ") and data.startswith("data: ")
            out.append((event[7:], json.loads(data[6:])))
    return out


def without_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


def check_call(item: dict, name: str | None = None) -> None:
    assert item["type"] == "function_call" and item["status"] == "completed"
    assert item["id"].startswith("fc_") and item["call_id"].startswith("call_")
    assert item["name"] in SCHEMAS and (name is None or item["name"] == name)
    jsonschema.validate(json.loads(item["arguments"]), SCHEMAS[item["name"]])


# ----------------------------------------------------------------------------- conversion


def test_items_become_one_system_prompt_and_the_turns():
    body = chat_body({"model": "m", "instructions": "Be terse.", "max_output_tokens": 9,
                      "temperature": 0.5, "top_p": 0.9, "stream": True, "input": [
                          {"type": "message", "role": "developer",
                           "content": [{"type": "input_text", "text": "Dev."}]},
                          {"role": "system", "content": "Sys."},
                          {"role": "user", "content": "Hi"},
                          {"type": "message", "role": "assistant", "content": [
                              {"type": "output_text", "text": "Hello", "annotations": []}]},
                          {"role": "developer", "content": "Later."},
                          {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                                       {"type": "input_text", "text": "b"}]}]})
    assert body == {"model": "m", "max_tokens": 9, "temperature": 0.5, "top_p": 0.9,
                    "stream": True, "messages": [
                        {"role": "system", "content": "Be terse.\n\nDev.\n\nSys."},
                        {"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Hello"},
                        {"role": "system", "content": "Later."},
                        {"role": "user", "content": "ab"}]}
    assert chat_body({"input": "Hi"})["messages"] == [{"role": "user", "content": "Hi"}]


def test_calls_and_their_outputs_become_tool_calls_and_tool_messages():
    items = [{"role": "user", "content": "Add"},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": None},
             {"type": "message", "role": "assistant", "content": "Sure."},
             {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "add",
              "arguments": "{\"a\": 1, \"b\": 2}", "status": "completed"},
             {"type": "function_call", "call_id": "c2", "name": "spawn", "namespace": "agents",
              "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "3"},
             {"type": "function_call_output", "call_id": "c2",
              "output": [{"type": "input_text", "text": "ok"}]}]
    messages = chat_body({"input": items})["messages"]
    assert messages == [
        {"role": "user", "content": "Add"},
        {"role": "assistant", "content": "Sure.", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "add", "arguments": "{\"a\": 1, \"b\": 2}"}},
            {"id": "c2", "type": "function", "function": {"name": "agents.spawn",
                                                          "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
        {"role": "tool", "tool_call_id": "c2", "content": "ok"}]
    assert chat_body({"input": items})["messages"] == messages  # the same text every time


def test_function_tools_are_offered_namespaces_flattened_others_skipped():
    tools, names = chat_tools([
        {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True},
        {"type": "web_search", "external_web_access": False},
        {"type": "namespace", "name": "ns", "description": "d", "tools": [
            {"type": "function", "name": "g", "description": "G"}, {"type": "custom"}]},
        {"type": "function", "name": "f", "description": "a second f"},
        {"type": "file_search"}])
    assert tools == [
        {"type": "function", "function": {"parameters": {"type": "object"}, "strict": True,
                                          "name": "f"}},
        {"type": "function", "function": {"description": "G", "name": "ns.g"}}]
    assert names == {"f": (None, "f"), "ns.g": ("ns", "g")}
    request = {"input": "x", "tools": [{"type": "web_search"}],
               "text": {"format": {"type": "json_schema", "name": "s",
                                   "schema": {"type": "object"}}}}
    body = chat_body(request)
    assert "tools" not in body
    assert body["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "s", "schema": {"type": "object"}}}
    # a forced call: the answer has no text to format
    body = chat_body({**request, "tool_choice": {"type": "function", "name": "g",
                                                 "namespace": "ns"}})
    assert body["tool_choice"] == {"type": "function", "function": {"name": "ns.g"}}
    assert "response_format" not in body


# ----------------------------------------------------------------------------- answers


def test_a_string_input_is_answered(srv):
    status, body = respond(srv, {"model": "mlxspec", "input": ASK, "max_output_tokens": 12,
                                 "temperature": 0})
    assert status == 200, body
    assert body["id"].startswith("resp_") and body["object"] == "response"
    assert body["status"] in ("completed", "incomplete")
    (item,) = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant"
    assert item["id"].startswith("msg_") and item["status"] == "completed"
    assert item["content"][0]["type"] == "output_text"
    assert item["content"][0]["annotations"] == [] and item["content"][0]["text"]
    usage = body["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["input_tokens_details"]["cached_tokens"] >= 0
    assert usage["speculative"]["mode"] and "acceptance_rate" in usage["speculative"]


def test_max_output_tokens_cuts_the_answer_incomplete(srv):
    status, body = respond(srv, {"input": ASK, "max_output_tokens": 3, "temperature": 0})
    assert status == 200
    assert body["status"] == "incomplete" and body["max_output_tokens"] == 3
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["usage"]["output_tokens"] == 3


def test_instructions_and_messages_reach_the_prompt(srv):
    request = {"instructions": "Be terse.", "input": [
        {"type": "message", "role": "developer", "content": [
            {"type": "input_text", "text": "Dev rules."}]},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
        {"role": "user", "content": "Again"}]}
    status, body = call(srv, "/apply-template", chat_body(request))
    assert status == 200
    assert body["prompt"] == ("<|im_start|>system\nBe terse.\n\nDev rules.<|im_end|>\n"
                              "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello"
                              "<|im_end|>\n<|im_start|>user\nAgain<|im_end|>\n"
                              "<|im_start|>assistant\n")
    status, answer = respond(srv, {**request, "max_output_tokens": 4})
    assert status == 200 and answer["instructions"] == "Be terse."


@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_call_is_a_function_call_item(srv, choice):
    tool_choice = {"type": "function", "name": "move"} if choice == "named" else "required"
    status, body = respond(srv, {"input": ASK, "tools": FLAT, "tool_choice": tool_choice,
                                 "max_output_tokens": 200, "temperature": 0})
    assert status == 200, body
    (item,) = body["output"]
    check_call(item, "move" if choice == "named" else None)
    assert body["status"] == "completed" and body["tool_choice"] == tool_choice


def test_the_stream_is_the_full_event_sequence(srv):
    """Text and forced calls: streamed, the events of each item in order, a call's argument
    deltas joined its `arguments`; the items those of the answer given whole."""
    for request in ({"input": ASK, "max_output_tokens": 16, "temperature": 0},
                    {"input": ASK, "tools": FLAT, "tool_choice": "required",
                     "max_output_tokens": 200, "temperature": 0},
                    {"input": ASK, "tools": FLAT, "max_output_tokens": 200, "temperature": 0.8,
                     "seed": 3, "tool_choice": {"type": "function", "name": "edit_file"}}):
        got = events(srv, request)
        whole = respond(srv, request)[1]
        kinds = [k for k, _ in got]
        assert all(data["type"] == k for k, data in got)
        assert [d["sequence_number"] for _, d in got] == list(range(len(got)))
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-1] == f"response.{whole['status']}"
        response = got[-1][1]["response"]
        assert {d["response"]["id"] for _, d in (got[0], got[1], got[-1])} == {response["id"]}
        assert got[0][1]["response"]["output"] == []
        done = [d["item"] for k, d in got if k == "response.output_item.done"]
        added = [d["item"] for k, d in got if k == "response.output_item.added"]
        assert response["output"] == done and [i["id"] for i in added] == [i["id"] for i in done]
        assert without_ids(done) == without_ids(whole["output"])
        for index, item in enumerate(done):
            mine = [(k, d) for k, d in got[2:-1] if d.get("output_index") == index]
            assert all(d.get("item_id", item["id"]) == item["id"] for _, d in mine)
            if item["type"] == "message":
                assert [k for k, _ in mine[:2]] == ["response.output_item.added",
                                                    "response.content_part.added"]
                assert [k for k, _ in mine[-3:]] == [
                    "response.output_text.done", "response.content_part.done",
                    "response.output_item.done"]
                text = "".join(d["delta"] for k, d in mine if k == "response.output_text.delta")
                assert text == item["content"][0]["text"] == mine[-3][1]["text"]
            else:
                check_call(item)
                kinds = [k for k, _ in mine]
                assert kinds[0] == "response.output_item.added" and kinds[-2:] == [
                    "response.function_call_arguments.done", "response.output_item.done"]
                assert set(kinds[1:-2]) == {"response.function_call_arguments.delta"}
                assert mine[0][1]["item"]["arguments"] == ""
                assert "".join(d["delta"] for _, d in mine[1:-2]) == \
                    mine[-2][1]["arguments"] == item["arguments"]
        assert response["usage"]["output_tokens"] == whole["usage"]["output_tokens"]


def test_a_function_call_output_round_trip_renders(srv):
    status, first = respond(srv, {"input": ASK, "tools": FLAT, "max_output_tokens": 200,
                                  "tool_choice": {"type": "function", "name": "add"},
                                  "temperature": 0})
    assert status == 200
    (fc,) = first["output"]
    request = {"input": [{"role": "user", "content": ASK}, fc,
                         {"type": "function_call_output", "call_id": fc["call_id"],
                          "output": "the sum is 42"}],
               "tools": FLAT, "max_output_tokens": 6}
    status, body = call(srv, "/apply-template", chat_body(request))
    args = json.loads(fc["arguments"])
    assert status == 200
    assert (f'<tool_call>\n{{"name": "add", "arguments": {json.dumps(args)}}}\n</tool_call>'
            "<|im_end|>\n<|im_start|>tool\nthe sum is 42<|im_end|>") in body["prompt"]
    status, answer = respond(srv, request)
    assert status == 200, answer


def test_previous_response_id_continues_a_stored_conversation(srv):
    status, first = respond(srv, {"input": ASK, "instructions": "Be terse.",
                                  "max_output_tokens": 8, "temperature": 0})
    assert status == 200 and first["store"] is True
    follow = {"previous_response_id": first["id"], "instructions": "Be terse.",
              "input": [{"role": "user", "content": "And then?"}], "max_output_tokens": 4}
    status, second = respond(srv, follow)
    assert status == 200, second
    assert second["previous_response_id"] == first["id"]
    # the whole conversation was the prompt, its first turn served by the prompt cache
    assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"] + 8
    assert second["usage"]["input_tokens_details"]["cached_tokens"] >= \
        first["usage"]["input_tokens"] - 2
    text = first["output"][0]["content"][0]["text"]
    whole = chat_body({"instructions": "Be terse.", "input": [
        {"role": "user", "content": ASK}, first["output"][0],
        {"role": "user", "content": "And then?"}]})
    assert chat_body(follow)["messages"] == whole["messages"]
    assert whole["messages"][2] == {"role": "assistant", "content": text}
    status, third = respond(srv, {**follow, "previous_response_id": second["id"]})
    assert status == 200  # a chain
    status, unstored = respond(srv, {"input": ASK, "store": False, "max_output_tokens": 2})
    assert status == 200 and unstored["store"] is False
    for missing in (unstored["id"], "resp_nope"):
        status, body = respond(srv, {**follow, "previous_response_id": missing})
        assert status == 400 and body["error"]["param"] == "previous_response_id", body
        assert "names no response stored here" in body["error"]["message"]


def test_a_namespaced_call_comes_back_with_its_namespace(srv):
    tools = [{"type": "web_search"},
             {"type": "namespace", "name": "agents", "description": "sub-agents",
              "tools": [FLAT[0], FLAT[2]]}]
    status, body = respond(srv, {"input": ASK, "tools": tools, "max_output_tokens": 200,
                                 "tool_choice": {"type": "function", "name": "set_mode",
                                                 "namespace": "agents"}, "temperature": 0})
    assert status == 200, body
    (item,) = body["output"]
    assert item["name"] == "set_mode" and item["namespace"] == "agents"
    jsonschema.validate(json.loads(item["arguments"]), SCHEMAS["set_mode"])
    status, body = respond(srv, {"input": [{"role": "user", "content": ASK}, item,
                                           {"type": "function_call_output",
                                            "call_id": item["call_id"], "output": "ok"}],
                                 "tools": tools, "max_output_tokens": 4})
    assert status == 200, body


def test_text_format_json_schema_holds(srv):
    schema = {"type": "object", "properties": {"mode": {"enum": ["fast", "exact"]}},
              "required": ["mode"], "additionalProperties": False}
    status, body = respond(srv, {"input": ASK, "max_output_tokens": 60, "temperature": 0,
                                 "text": {"format": {"type": "json_schema", "name": "m",
                                                     "schema": schema}}})
    assert status == 200, body
    jsonschema.validate(json.loads(body["output"][0]["content"][0]["text"]), schema)


def test_a_forced_call_is_the_same_in_every_mode(srv):
    outputs = {}
    for mode in ("none", "ngram", "suffix", "auto"):
        status, body = respond(srv, {"input": ASK, "tools": FLAT, "tool_choice": "required",
                                     "max_output_tokens": 120, "temperature": 0,
                                     "speculative": {"mode": mode}})
        assert status == 200, (mode, body)
        assert body["usage"]["speculative"]["mode"]
        outputs[mode] = without_ids(body["output"])
    assert all(out == outputs["none"] for out in outputs.values()), outputs


class Events:
    """A request's job group as the answer reads it: the given events, then nothing."""

    def __init__(self, stream: bool, events: list, tools: list | None = None):
        self.req = GenRequest("chat", [1], 8, stream=stream, model="m")
        self.req.tools = tools
        self.events = asyncio.Queue()
        for ev in events:
            self.events.put_nowait((0, ev))

    def cancel(self) -> None:
        pass


def answered(stream: bool, events: list, tools: list | None = None,
             body: dict | None = None) -> tuple[int, dict, bytes]:
    """(status, headers, body) of an `Answer` to these worker events (with `tools`: the
    answer's calls read in the `json_tools` syntax)."""
    sent = []
    parser = SimpleNamespace(tool_syntax=SYNTAX)

    async def run():
        async def receive():
            await asyncio.Event().wait()  # the client stays

        async def send(message):
            sent.append(message)

        await Answer(Events(stream, events, tools), body or {"input": "x"}, parser, Metrics(),
                     5)({}, receive, send)

    asyncio.run(run())
    return (sent[0]["status"], dict(sent[0]["headers"]),
            b"".join(m.get("body", b"") for m in sent[1:]))


def test_a_failure_is_an_error_body_before_the_stream_and_an_event_after():
    busy = ApiError(503, "the queue is full", retry_after=2)
    for stream in (False, True):
        status, headers, body = answered(stream, [Failed(busy)])
        assert status == 503 and headers[b"Retry-After"] == b"2"
        assert json.loads(body)["error"]["message"] == "the queue is full"
    status, _, body = answered(True, [Delta("Hel", 1), Failed(ApiError(500, "lost"))])
    assert status == 200
    got = [json.loads(line[6:]) for line in body.decode().splitlines()
           if line.startswith("data: ")]
    assert [e["type"] for e in got] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta", "response.failed"]
    failed = got[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["message"] == "lost"


TEXT_AND_CALLS = ('Hi <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
                  '\nso <tool_call>{"arguments": {}, "name": "noop"}</tool_call>')


def streamed_in_pieces(text: str, size: int) -> tuple[list, list]:
    """`text` fed to the relay in pieces of `size` characters: the worker's events and the
    stream's events."""
    evs = [Delta(text[i:i + size], 1) for i in range(0, len(text), size)]
    evs.append(Done("stop", Usage()))
    status, _, body = answered(True, evs, FLAT, {"input": "x", "tools": FLAT})
    assert status == 200
    return evs, [json.loads(line[6:]) for line in body.decode().splitlines()
                 if line.startswith("data: ")]


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_call_arguments_stream_as_deltas_in_the_answers_order(size):
    """Text and calls in the order written, each call a function_call item: a JSON call's
    arguments as `function_call_arguments.delta` pieces as they come (one piece for a call
    that comes whole), joined the `arguments` of the item, and of the answer given whole."""
    evs, got = streamed_in_pieces(TEXT_AND_CALLS, size)
    output = got[-1]["response"]["output"]
    assert [(i["type"], i.get("name")) for i in output] == [
        ("message", None), ("function_call", "add"), ("message", None),
        ("function_call", "noop")]
    assert [i["content"][0]["text"] for i in output if i["type"] == "message"] == ["Hi ", "\nso "]
    for index, item in enumerate(output):
        if item["type"] != "function_call":
            continue
        pieces = [e["delta"] for e in got if e["type"] == "response.function_call_arguments.delta"
                  and e["output_index"] == index]
        assert "".join(pieces) == item["arguments"]
        if item["name"] == "noop" or size == 1000:  # whole, or all at once
            assert len(pieces) == 1
        else:
            assert len(pieces) > 1
    assert [i["arguments"] for i in output if i["type"] == "function_call"] == [
        '{"a": 1, "b": 2}', "{}"]
    _, _, whole = answered(False, evs, FLAT, {"input": "x", "tools": FLAT})
    assert without_ids(json.loads(whole)["output"]) == without_ids(output)


FENCED = f"I'll add them.\n```json\n{ADD}\n```\nDone."


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_a_fenced_call_is_a_function_call_item(size):
    """A call the model writes as a fenced JSON block is a function_call item between the
    text's messages, its arguments streamed as deltas; the fence is in no message."""
    evs, got = streamed_in_pieces(FENCED, size)
    output = got[-1]["response"]["output"]
    assert [(i["type"], i.get("name")) for i in output] == [
        ("message", None), ("function_call", "add"), ("message", None)]
    assert [i["content"][0]["text"] for i in output if i["type"] == "message"] == [
        "I'll add them.\n", "\nDone."]
    pieces = [e["delta"] for e in got if e["type"] == "response.function_call_arguments.delta"]
    assert "".join(pieces) == output[1]["arguments"] == '{"a": 1, "b": 2}'
    _, _, whole = answered(False, evs, FLAT, {"input": "x", "tools": FLAT})
    assert without_ids(json.loads(whole)["output"]) == without_ids(output)


def test_a_bare_call_object_through_the_server_is_a_function_call(srv):
    """The model made to answer a bare JSON object naming a listed function (`text.format`
    holds it to that object): a function_call item, the same streamed."""
    schema = {"type": "object", "properties": {
        "name": {"const": "add"}, "arguments": {
            "type": "object", "properties": {"a": {"const": 1}, "b": {"const": 2}},
            "required": ["a", "b"], "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False}
    body = {"input": ASK, "tools": FLAT, "max_output_tokens": 400, "temperature": 0,
            "text": {"format": {"type": "json_schema", "name": "call", "schema": schema}}}
    status, out = respond(srv, body)
    assert status == 200, out
    (item,) = out["output"]
    assert item["type"] == "function_call" and item["name"] == "add"
    assert json.loads(item["arguments"]) == {"a": 1, "b": 2}
    done = [e for kind, e in events(srv, body) if kind == "response.completed"]
    assert without_ids(done[0]["response"]["output"]) == without_ids(out["output"])


@pytest.mark.parametrize("extra,param,words", [
    ({"input": 5}, "input", "must be a string or a list"),
    ({"input": None}, "input", "is required"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", "not supported"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "must be one of"),
    ({"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]},
     "input[0].content[0]", "reads text only"),
    ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "1"}]},
     "input[0].call_id", "no earlier function_call"),
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "add"}]},
     "input[0].arguments", "must be a string"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "function_call", "call_id": "c1",
                                                   "name": "add", "arguments": "{oops"}]},
     "input", "not valid JSON"),
    ({"input": []}, "input", "non-empty"),
    ({"tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "not in 'tools'"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "hosted tools"),
    ({"tool_choice": "sometimes"}, "tool_choice", "must be"),
    ({"tools": [{"type": "function", "name": "x", "parameters": 5}]}, "tools[0].parameters",
     "JSON Schema"),
    ({"tools": [{"type": "function", "name": "x", "parameters": {
        "type": "object", "properties": 5}}], "tool_choice": "required"}, "tools",
     "JSON Schema"),
    ({"tools": [{"type": "function", "description": "no name"}]}, "tools[0].name",
     "must be a string"),
    ({"tools": [{"type": "web_search"}], "tool_choice": "required"}, "tool_choice",
     "lists none"),
    ({"max_output_tokens": 0}, "max_output_tokens", ">= 1"),
    ({"temperature": "hot"}, "temperature", "number"),
    ({"instructions": ["x"]}, "instructions", "string"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema",
     "needs a 'schema'"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type", "must be"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "bogus"}}}},
     "text.format", ""),
])
def test_bad_input_is_400_naming_the_field(srv, extra, param, words):
    status, body = respond(srv, {"input": ASK, "tools": FLAT, "max_output_tokens": 4, **extra})
    assert status == 400, body
    error = body["error"]
    assert error["param"] == param and words in error["message"], body
    assert error["type"] == "invalid_request_error"


def test_an_unknown_model_is_404_in_openais_shape(srv):
    status, body = respond(srv, {"model": "gpt-9", "input": ASK})
    assert status == 404 and body["error"]["code"] == "model_not_found"


# ----------------------------------------------------------------------------- clients


def test_the_openai_sdk_reads_responses_and_streams(srv):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
    r = client.responses.create(model="mlxspec", input=ASK, max_output_tokens=10,
                                temperature=0)
    assert r.id.startswith("resp_") and r.output_text and r.usage.output_tokens == 10
    r = client.responses.create(model="mlxspec", input=ASK, tools=FLAT, tool_choice="required",
                                max_output_tokens=200, temperature=0)
    (fc,) = r.output
    assert fc.type == "function_call" and fc.name in SCHEMAS
    jsonschema.validate(json.loads(fc.arguments), SCHEMAS[fc.name])
    with client.responses.stream(model="mlxspec", input=ASK, tools=FLAT, tool_choice="required",
                                 max_output_tokens=200, temperature=0) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    assert [(o.name, o.arguments) for o in final.output] == [(fc.name, fc.arguments)]
    text = ""
    for event in client.responses.create(model="mlxspec", input="Hello", stream=True,
                                         max_output_tokens=40, temperature=0):
        if event.type == "response.output_text.delta":
            text += event.delta
        last = event
    assert last.type in ("response.completed", "response.incomplete")
    assert last.response.output_text == text


def test_the_agents_sdk_runs_a_function_tool(srv):
    pytest.importorskip("agents")
    import httpx
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI
    from pydantic import BaseModel

    set_tracing_disabled(True)
    ran, sent = [], []

    class Report(BaseModel):  # a structured answer: the random model's JSON ends
        weather: Literal["sunny", "rainy"]

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """Get the weather for a city."""
        ran.append(city)
        return "sunny and 31 degrees"

    async def run():
        async def keep(request):
            sent.append(json.loads(request.content))

        async with httpx.AsyncClient(event_hooks={"request": [keep]}, timeout=60) as http:
            client = AsyncOpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0,
                                 http_client=http)
            agent = Agent(name="weather", instructions="You are terse.", tools=[get_weather],
                          output_type=Report, model=OpenAIResponsesModel("mlxspec", client),
                          model_settings=ModelSettings(tool_choice="required", temperature=0,
                                                       max_tokens=100))
            return await Runner.run(agent, "What's the weather in Paris?", max_turns=3)

    result = asyncio.run(run())
    assert len(ran) == 1 and isinstance(ran[0], str)
    assert [r.get("tool_choice") for r in sent] == ["required", None]  # then reset
    # the tool's result went back in the second request, and the model answered it
    outputs = [i for i in sent[1]["input"] if i.get("type") == "function_call_output"]
    assert [o["output"] for o in outputs] == ["sunny and 31 degrees"]
    assert "sunny and 31 degrees" in call(srv, "/apply-template",
                                          chat_body(sent[1]))[1]["prompt"]
    assert isinstance(result.final_output, Report) and len(sent) == 2


@pytest.mark.parametrize("turn", ["codex_turn1", "codex_turn2"])
def test_codex_requests_are_answered_with_the_events_it_needs(srv, turn):
    body = json.loads((FIXTURES / f"{turn}.json").read_text())
    assert body["stream"] and body["store"] is False and body["model"] == "local-model"
    assert {t["type"] for t in body["tools"]} == {"function", "namespace", "web_search"}
    got = events(srv, body)
    done = [d["item"] for k, d in got if k == "response.output_item.done"]
    kind, last = got[-1]
    assert kind in ("response.completed", "response.incomplete")
    assert last["response"]["id"].startswith("resp_") and last["response"]["output"] == done
    assert done and all(i["status"] == "completed" for i in done)
    status, _ = respond(srv, {**body, "stream": False, "previous_response_id": None})
    assert status == 200
    # not stored (store: false)
    status, err = respond(srv, {"input": "x", "previous_response_id": last["response"]["id"]})
    assert status == 400 and err["error"]["param"] == "previous_response_id"
