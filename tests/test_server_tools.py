"""Tool calls on `/v1/chat/completions`: the model's call syntax parsed out of its answer
(mlx-lm's `json_tools` parser, chosen from the chat template: conftest's `tools_model_dir`),
streamed as `delta.tool_calls`,
`tool_choice` "required" / a named function held by a grammar (so even a random model calls a
listed function with arguments valid against its schema), exact in every speculative mode,
and bad tool input answered 400 naming the field."""

from __future__ import annotations

import json

import jsonschema
import pytest
from mlx_lm.tool_parsers import json_tools
from server_helpers import call, start, stop, stream

import mlxspec
from mlxspec.server.tools import ToolCallSplitter, ToolSyntax

SYNTAX = ToolSyntax("<tool_call>", "</tool_call>", json_tools.parse_tool_call)

def fn(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"the {name} tool",
                                             "parameters": {**parameters,
                                                            "additionalProperties": False}}}


# Eight tools: nested objects, arrays, enums, numbers, optional fields (strings and numbers
# bounded, no other keys: a random model would not end them).
TOOLS = [
    fn("get_weather", {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                       "required": ["city"]}),
    fn("add", {"type": "object", "properties": {"a": {"type": "integer", "maximum": 99},
                                                "b": {"type": "integer", "minimum": -9,
                                                      "maximum": 9}},
               "required": ["a", "b"]}),
    fn("set_mode", {"type": "object", "properties": {
        "mode": {"enum": ["fast", "exact", "off"]}}, "required": ["mode"]}),
    fn("edit_file", {"type": "object", "properties": {
        "path": {"type": "string", "maxLength": 10},
        "edits": {"type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {"line": {"type": "integer", "minimum": 0,
                                                      "maximum": 999},
                                             "text": {"type": "string", "maxLength": 8}},
            "required": ["line", "text"]}}},
        "required": ["path", "edits"]}),
    fn("move", {"type": "object", "properties": {
        "to": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0,
                                                      "maximum": 9},
                                                "y": {"type": "integer", "minimum": 0,
                                                      "maximum": 9}},
               "required": ["x", "y"]}}, "required": ["to"]}),
    fn("tag", {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
        "required": ["tags"]}),
    fn("noop", {"type": "object", "properties": {}}),
    fn("search", {"type": "object", "properties": {
        "query": {"type": "string", "maxLength": 12},
        "limit": {"type": "integer", "minimum": 1, "maximum": 50},
        "exact": {"type": "boolean"}}, "required": ["query"]}),
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "def f(x):"}]


def split_all(text: str, size: int) -> tuple[str, list[dict]]:
    splitter, shown, calls = ToolCallSplitter(SYNTAX, None), "", []
    for i in range(0, len(text), size):
        t, c = splitter.feed(text[i:i + size])
        shown, calls = shown + t, calls + c
    t, c = splitter.flush()
    return shown + t, calls + c


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 11, 1000])
def test_splitter_finds_calls_in_pieces_of_any_size(size):
    text = ('Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
            '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>\n')
    shown, calls = split_all(text, size)
    assert shown == "Sure.\n"  # the whitespace between and after calls is not content
    assert calls == [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]


def test_splitter_keeps_text_and_drops_what_is_no_call():
    assert split_all("a < b and <tool_ca", 2) == ("a < b and <tool_ca", [])
    # a call cut short (max_tokens) or malformed is dropped, its markup never shown
    assert split_all('x<tool_call>\n{"name": "f", "argu', 3) == ("x", [])
    assert split_all("<tool_call>not json</tool_call> after", 4) == (" after", [])
    # text after a call is shown, the newline before it too
    assert split_all('<tool_call>{"name": "f", "arguments": {}}</tool_call>\ndone', 3) == (
        "\ndone", [{"name": "f", "arguments": {}}])


@pytest.fixture(scope="module")
def srv(tools_model_dir):
    engine = mlxspec.load(str(tools_model_dir), mode="auto", num_draft=4)
    assert engine.tokenizer.has_tool_calling  # json_tools, inferred from the template
    server = start(engine)
    yield server
    stop(server)


def check_calls(calls: list[dict], name: str | None = None) -> None:
    assert calls
    for c in calls:
        assert c["type"] == "function" and c["id"].startswith("call_")
        got = c["function"]["name"]
        assert got in SCHEMAS and (name is None or got == name)
        jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMAS[got])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_tool_choice_always_calls_a_listed_function_validly(srv, seed):
    status, body = call(srv, "/v1/chat/completions", {
        "messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200,
        "temperature": 1.0, "seed": seed})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None and len(choice["message"]["tool_calls"]) == 1
    check_calls(choice["message"]["tool_calls"])


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_a_named_function_is_the_one_called(srv, name):
    status, body = call(srv, "/v1/chat/completions", {
        "messages": ASK, "tools": TOOLS, "max_tokens": 200, "temperature": 0.8, "seed": 3,
        "tool_choice": {"type": "function", "function": {"name": name}}})
    assert status == 200, body
    check_calls(body["choices"][0]["message"]["tool_calls"], name)


def test_parallel_calls_when_allowed(srv):
    status, body = call(srv, "/v1/chat/completions", {
        "messages": ASK, "tools": TOOLS[:2], "tool_choice": "required", "max_tokens": 300,
        "temperature": 1.0, "seed": 5, "parallel_tool_calls": True})
    assert status == 200
    check_calls(body["choices"][0]["message"]["tool_calls"])


def test_streamed_tool_calls_are_deltas_and_match_the_answer(srv):
    req = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200,
           "temperature": 0}
    whole = call(srv, "/v1/chat/completions", req)[1]["choices"][0]
    events = stream(srv, "/v1/chat/completions", req)
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [c["index"] for c in calls] == list(range(len(calls)))
    assert [c["function"] for c in calls] == [c["function"] for c in whole["message"]["tool_calls"]]
    assert not any(d.get("content") for d in deltas)  # no markup as content
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_calls_are_the_same_in_every_mode(srv):
    """A required call (the grammar cuts every proposal) is token-identical to `none`, greedy
    and seeded."""
    for extra in ({"temperature": 0}, {"temperature": 0.9, "seed": 11}):
        answers = {}
        for mode in ("none", "ngram", "draft", "lookahead", "suffix", "auto"):
            status, body = call(srv, "/v1/chat/completions", {
                "messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 120,
                "speculative": {"mode": mode}, **extra})
            if status == 400 and mode == "draft":  # no draft model loaded
                continue
            assert status == 200, (mode, body)
            answers[mode] = body["choices"][0]["message"]["tool_calls"]
        want = [c["function"] for c in answers.pop("none")]
        for mode, calls in answers.items():
            assert [c["function"] for c in calls] == want, (mode, extra)


def test_tool_choice_none_and_auto_without_a_call(srv):
    for choice in ("none", "auto", None):
        req = {"messages": ASK, "tools": TOOLS, "max_tokens": 8, "temperature": 0}
        if choice:
            req["tool_choice"] = choice
        status, body = call(srv, "/v1/chat/completions", req)
        assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length")
        assert "<tool_call>" not in (body["choices"][0]["message"]["content"] or "")


def test_a_tool_result_after_its_call_is_rendered(srv):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_7", "type": "function",
             "function": {"name": "add", "arguments": "{\"a\": 1, \"b\": 2}"}}]},
        {"role": "tool", "tool_call_id": "call_7", "content": "3"}]
    status, body = call(srv, "/apply-template", {"messages": messages, "tools": TOOLS})
    assert status == 200
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in \
        body["prompt"]
    status, _ = call(srv, "/v1/chat/completions", {"messages": messages, "tools": TOOLS,
                                                   "max_tokens": 4})
    assert status == 200


@pytest.mark.parametrize("extra,param,words", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not in 'tools'"),
    ({"tool_choice": "sometimes"}, "tool_choice", "must be"),
    ({"tools": [fn("x", {"type": "object", "properties": 5})], "tool_choice": "required"},
     "tools", "JSON Schema"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "function"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]},
     "tools[0].function.name", "required"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "lists none"),
    ({"messages": ASK + [{"role": "tool", "tool_call_id": "c1", "content": "3"}]},
     "messages[1].tool_call_id", "earlier assistant"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments", "not valid JSON"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
])
def test_bad_tool_input_is_400_naming_the_field(srv, extra, param, words):
    status, body = call(srv, "/v1/chat/completions",
                        {"messages": ASK, "tools": TOOLS, "max_tokens": 4, **extra})
    assert status == 400, body
    assert body["error"]["param"] == param and words in body["error"]["message"], body


def test_the_openai_sdk_reads_the_calls(srv):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
    r = client.chat.completions.create(model="mlxspec", messages=ASK, tools=TOOLS,
                                       tool_choice="required", max_tokens=200, temperature=0)
    tc = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and tc and tc[0].function.name in SCHEMAS
    jsonschema.validate(json.loads(tc[0].function.arguments), SCHEMAS[tc[0].function.name])
    parts: dict[int, dict] = {}
    for chunk in client.chat.completions.create(
            model="mlxspec", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200,
            temperature=0, stream=True):
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            got = parts.setdefault(d.index, {"name": "", "arguments": ""})
            got["name"] += d.function.name or ""
            got["arguments"] += d.function.arguments or ""
    assert [parts[i] for i in sorted(parts)] == [
        {"name": c.function.name, "arguments": c.function.arguments} for c in tc]
