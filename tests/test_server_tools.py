"""Tool calls on `/v1/chat/completions`: the model's call syntax parsed out of its answer
(mlx-lm's `json_tools` parser, chosen from the chat template: conftest's `tools_model_dir`),
streamed as `delta.tool_calls` (a JSON call's arguments in pieces that join to the answer's
`arguments`), `tool_choice` "required" / a named function held by a grammar from the first
token and "auto" from the call's opening token (so even a random model calls a listed function
with arguments valid against its schema), exact in every speculative mode, and bad tool input
answered 400 naming the field."""

from __future__ import annotations

import json

import jsonschema
import pytest
from mlx_lm.tool_parsers import json_tools
from server_helpers import call, start, stop, stream

import mlxspec
from mlxspec.server.tools import CallArgs, CallDone, CallOpen, ToolCallSplitter, ToolSyntax

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
    """(shown text, calls as {"name", "arguments" parsed}) of `text` fed in pieces of `size`."""
    splitter, parts = ToolCallSplitter(SYNTAX, None), []
    for i in range(0, len(text), size):
        parts += splitter.feed(text[i:i + size])
    parts += splitter.flush()
    calls = [p.call["function"] for p in parts if isinstance(p, CallDone)]
    return ("".join(p for p in parts if isinstance(p, str)),
            [{"name": c["name"], "arguments": json.loads(c["arguments"])} for c in calls])


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 11, 1000])
def test_splitter_finds_calls_in_pieces_of_any_size(size):
    text = ('Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
            '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>\n')
    shown, calls = split_all(text, size)
    assert shown == "Sure.\n"  # the whitespace between and after calls is not content
    assert calls == [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]


def test_splitter_keeps_text_and_drops_what_is_no_call():
    assert split_all("a < b and <tool_ca", 2) == ("a < b and <tool_ca", [])
    # a call cut before its arguments start, or malformed, is dropped, its markup never shown
    assert split_all('x<tool_call>\n{"name": "f", "argu', 3) == ("x", [])
    assert split_all("<tool_call>not json</tool_call> after", 4) == (" after", [])
    # text after a call is shown, the newline before it too
    assert split_all('<tool_call>{"name": "f", "arguments": {}}</tool_call>\ndone', 3) == (
        "\ndone", [{"name": "f", "arguments": {}}])


# (answer, [(name, arguments, streamed)]): calls whose arguments stream in pieces, and those
# that come whole (arguments before the name, a list of calls, arguments not an object)
PIECES = [
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
     [("f", '{"a": 1}', True)]),
    ('ok <tool_call>{ "name" :"f\\"q" ,\n "arguments":\t{"s": "}]</tool_c\\"{[", '
     '"n": [1, {"d": [2]}], "e": {}} }</tool_call>\n<tool_call>\n{"name": "g", "arguments": '
     '{}}\n</tool_call>',
     [('f"q', '{"s": "}]</tool_c\\"{[", "n": [1, {"d": [2]}], "e": {}}', True),
      ("g", "{}", True)]),
    ('<tool_call>{"name": "f", "arguments": {"x": "é\\u00e9"}, "id": 3}</tool_call>',
     [("f", '{"x": "é\\u00e9"}', True)]),
    # the outer object left open: the arguments were whole, the call stands
    ('<tool_call>{"name": "f", "arguments": {"a": [1]}</tool_call>', [("f", '{"a": [1]}', True)]),
    ('<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>', [("f", '{"a": 1}', False)]),
    ('<tool_call>[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"b": 2}}]'
     '</tool_call>', [("f", "{}", False), ("g", '{"b": 2}', False)]),
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
     [("f", '{"a": 1}', False)]),
    # cut by max_tokens inside the arguments: the call keeps the pieces it was sent
    ('<tool_call>\n{"name": "f", "arguments": {"a": "x</tool', [("f", '{"a": "x</tool', True)]),
]


def fed(text: str, size: int, tools: list | None = None, parallel: bool = True) -> list:
    """The splitter's parts of `text` fed in pieces of `size`, its end included."""
    splitter, parts = ToolCallSplitter(SYNTAX, tools, parallel), []
    for i in range(0, len(text), size):
        parts += splitter.feed(text[i:i + size])
    return parts + splitter.flush()


@pytest.mark.parametrize("size", [1, 2, 3, 4, 7, 13, 1000])
@pytest.mark.parametrize("text,want", PIECES)
def test_argument_pieces_join_to_the_calls_arguments(text, want, size):
    """A JSON call opens once its name and its arguments' `{` are read (index, id, name), its
    arguments then go out in pieces as they come, and the pieces joined are the answer's
    `arguments`, byte for byte, whatever the size of the text's pieces (with the functions
    listed or not: calls without markers change nothing here)."""
    plain, listed = fed(text, size), fed(text, size, [fn("f", {}), fn("g", {})])
    check_pieces(plain, want, size)
    check_pieces(listed, want, size)
    assert shown(plain) == shown(listed)


def shown(parts: list) -> str:
    return "".join(p for p in parts if isinstance(p, str))


def check_pieces(parts: list, want: list, size: int) -> None:
    """The calls of `parts` are `want` ([(name, arguments, streamed)]), in index order, each
    streamed one opened first and its pieces joined its arguments, the others whole."""
    done = [p for p in parts if isinstance(p, CallDone)]
    assert [(d.call["function"]["name"], d.call["function"]["arguments"], d.streamed)
            for d in done] == want
    assert [d.index for d in done] == list(range(len(done)))
    for d in done:
        mine = [p for p in parts if getattr(p, "index", None) == d.index]
        if d.streamed:
            assert isinstance(mine[0], CallOpen) and mine[0].id == d.call["id"]
            assert "".join(p.text for p in mine if isinstance(p, CallArgs)) == \
                d.call["function"]["arguments"]
        else:
            assert mine == [d]
    if size == 1 and want and want[0][2]:  # a piece at a time, as they come
        assert sum(isinstance(p, CallArgs) for p in parts) > 1


ADD = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
EDIT = ('{\n  "name": "edit_file",\n  "arguments": {\n    "path": "a.md",\n    "edits": [{"line": '
        '1, "text": "}```\\"{"}]\n  }\n}')
EDIT_ARGS = '{\n    "path": "a.md",\n    "edits": [{"line": 1, "text": "}```\\"{"}]\n  }'
# (answer, text shown, [(name, arguments)]): calls written without the markers, as a fenced
# block (with or without `json`) or a bare object where the answer starts, naming a listed
# function; and JSON that is no such call, shown as written
LOOSE = [
    (f"```json\n{ADD}\n```", "", [("add", '{"a": 1, "b": 2}')]),
    (f"I will edit it.\n```\n{EDIT}\n```\nDone.", "I will edit it.\n\nDone.",
     [("edit_file", EDIT_ARGS)]),
    (f"```JSON \n\n  {ADD}\n\n```\n", "", [("add", '{"a": 1, "b": 2}')]),
    (f" \n{ADD}", " \n", [("add", '{"a": 1, "b": 2}')]),
    (f"{ADD} and so on", " and so on", [("add", '{"a": 1, "b": 2}')]),
    (f"Two:\n```json\n{ADD}\n```\n\n```json\n{EDIT}\n```\n", "Two:\n",
     [("add", '{"a": 1, "b": 2}'), ("edit_file", EDIT_ARGS)]),
    (f"{ADD}\n{ADD}", "", [("add", '{"a": 1, "b": 2}')] * 2),
    (f'<tool_call>\n{ADD}\n</tool_call>\n```json\n{{"name": "noop", "arguments": {{}}}}\n```',
     "", [("add", '{"a": 1, "b": 2}'), ("noop", "{}")]),
    # a key after the arguments; the object left open, its fence closing it; no closing fence
    ('```json\n{"name": "noop", "arguments": {}, "id": "}```"}\n```', "", [("noop", "{}")]),
    ('```json\n{"name": "noop", "arguments": {}\n```\nok', "\nok", [("noop", "{}")]),
    ('```json\n{"name": "noop", "arguments": {"a": [1]}}\n', "", [("noop", '{"a": [1]}')]),
    # cut by max_tokens inside the arguments: the call keeps the pieces it was sent
    ('```json\n{"name": "add", "arguments": {"a": 1, "b', "", [("add", '{"a": 1, "b')]),
    # no call: shown byte for byte
    *[(text, text, []) for text in (
        'An example:\n```json\n{"name": "John", "age": 30}\n```\n',
        '```json\n{"name": "nope", "arguments": {}}\n```',
        '```json\n{"arguments": {}, "name": "add"}\n```',
        '```json\n[{"name": "add", "arguments": {}}]\n```',
        '```json\n{"name": "add", "parameters": {}}\n```',
        '```json\n{"name": "add", "arguments": "{}"}\n```',
        '```python\nprint(1)\n```\n``` \nx\n```',
        'Call x ```json\n{"name": "add", "arguments": {}}\n```',
        f'Call {ADD}',
        '```json {"name": "add", "arguments": {}}```',
        '``',
        '```json\n{"name": "ad',
    )],
]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 11, 1000])
@pytest.mark.parametrize("text,text_shown,want", LOOSE)
def test_calls_without_markers_are_calls(text, text_shown, want, size):
    """A call written as a fenced block or a bare object is a call as a `<tool_call>` one is
    (opened, its arguments in pieces that join to them), its markup never shown; JSON that is
    no call of a listed function is shown as written; the same whatever the pieces."""
    parts = fed(text, size, TOOLS)
    assert shown(parts) == text_shown
    check_pieces(parts, [(*w, True) for w in want], size)
    assert shown(fed(text, size)) == text or "<tool_call>" in text  # listing none: text


def test_without_parallel_calls_only_the_first_call_is_read_without_markers():
    text = f"```json\n{ADD}\n```\n```json\n{ADD}\n```"
    for size in (1, 4, 1000):
        parts = fed(text, size, TOOLS, parallel=False)
        assert [p.call["function"]["name"] for p in parts if isinstance(p, CallDone)] == ["add"]
        assert shown(parts) == f"\n```json\n{ADD}\n```"


def test_only_what_may_be_a_call_is_held_back():
    """Text from a fence or a brace that may begin a call waits until its head is read: shown
    at once where it is not a call (a function not listed, another fence), opened where it
    is."""
    splitter = ToolCallSplitter(SYNTAX, TOOLS)
    assert splitter.feed("Sure:\n`") == ["Sure:\n"]
    assert splitter.feed('``json\n{"name": "') == []
    assert splitter.feed('Jo') == ['```json\n{"name": "Jo']  # no listed name starts so
    assert splitter.feed('hn", "age": 3}') == ['hn", "age": 3}']
    assert splitter.feed("\n```") == ["\n"]  # a fence may open there
    assert splitter.feed("python") == ["```python"]
    splitter = ToolCallSplitter(SYNTAX, TOOLS)
    assert splitter.feed('```json\n{"name": "a') == []  # "add" may follow
    assert splitter.feed('dd", "arguments"') == []
    opened, piece = splitter.feed(': {"a"')
    assert isinstance(opened, CallOpen) and opened.name == "add" and piece.text == '{"a"'
    assert splitter.feed(": 1}}\n``") == [CallArgs(0, ": 1}")]
    done, = splitter.feed("`\n")
    assert done.call["function"]["arguments"] == '{"a": 1}' and splitter.flush() == []


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


def streamed_calls(events: list) -> list[dict]:
    """The calls of a streamed chat answer, each {"id", "name", "arguments"} from its
    `delta.tool_calls` entries: the first with its index, id, type and name (arguments "" when
    pieces follow), the next ones with only argument pieces."""
    calls: list[dict] = []
    for e in events:
        for entry in (e["choices"][0]["delta"].get("tool_calls") or []) if e["choices"] else []:
            if entry["index"] == len(calls):
                assert entry["type"] == "function" and entry["id"].startswith("call_")
                calls.append({"id": entry["id"], **entry["function"]})
            else:
                assert entry["index"] == len(calls) - 1, entry  # the open call's pieces
                assert set(entry) == {"index", "function"} and list(entry["function"]) == [
                    "arguments"] and entry["function"]["arguments"], entry
                calls[-1]["arguments"] += entry["function"]["arguments"]
    return calls


@pytest.fixture(scope="module")
def opening(tools_model_dir) -> str:
    """The id of the `<tool_call>` token (one token: "auto"'s grammar opens a call on it)."""
    from mlx_lm.utils import load_tokenizer

    ids = load_tokenizer(tools_model_dir).encode("<tool_call>", add_special_tokens=False)
    assert len(ids) == 1
    return str(ids[0])


# Requests whose answers make calls: forced (greedy, seeded, named, several), and "auto"
# with the opening token pushed up (calls amid text, one cut by max_tokens in its arguments)
CALLING = {
    "required": {"tool_choice": "required", "temperature": 0},
    "seeded": {"tool_choice": "required", "temperature": 1.0, "seed": 2},
    "named": {"tool_choice": {"type": "function", "function": {"name": "edit_file"}},
              "temperature": 0.8, "seed": 3},
    "parallel": {"tool_choice": "required", "parallel_tool_calls": True, "temperature": 1.0,
                 "seed": 5},
    "auto": {"temperature": 1.0, "seed": 1, "bias": 5},
    "auto-cut": {"temperature": 1.0, "seed": 0, "bias": 8},
}


@pytest.mark.parametrize("case", list(CALLING))
def test_streamed_argument_pieces_join_to_the_answers_arguments(srv, opening, case):
    """The same request streamed and whole: the streamed calls (index, id and name first,
    then argument pieces) have the answer's names and, pieces joined, its `arguments` byte
    for byte; the text and finish_reason are the answer's."""
    extra = dict(CALLING[case])
    bias = extra.pop("bias", None)
    req = {"messages": ASK, "tools": TOOLS, "max_tokens": 150, **extra}
    if bias:
        req["logit_bias"] = {opening: bias}
    status, body = call(srv, "/v1/chat/completions", req)
    assert status == 200, body
    whole = body["choices"][0]
    events = stream(srv, "/v1/chat/completions", req)
    assert events[-1] == "[DONE]"
    got = streamed_calls(events[:-1])
    want = whole["message"]["tool_calls"]
    assert want and [(c["name"], c["arguments"]) for c in got] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in want]
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == (whole["message"]["content"] or "")
    assert "<tool_call>" not in "".join(d.get("content") or "" for d in deltas)
    assert events[-2]["choices"][0]["finish_reason"] == whole["finish_reason"]
    # every call is valid but one cut short by max_tokens, the last
    complete = want[:-1] if whole["finish_reason"] == "length" else want
    if complete:
        check_calls(complete)
    if case == "auto-cut":  # the cut call keeps the pieces sent: not JSON
        with pytest.raises(json.JSONDecodeError):
            json.loads(want[-1]["function"]["arguments"])


# Answers the model is made to write (a grammar of one string: "auto" then adds none of its
# own, and the calls are read as written)
WRITTEN = {
    "fenced": (f"Let me add them.\n```json\n{ADD}\n```\n", "Let me add them.\n",
               [("add", '{"a": 1, "b": 2}')]),
    "two": (f"```\n{EDIT}\n```\n\n```json\n{ADD}\n```", None,
            [("edit_file", EDIT_ARGS), ("add", '{"a": 1, "b": 2}')]),
    "bare": (ADD, None, [("add", '{"a": 1, "b": 2}')]),
    "example": ('For example:\n```json\n{"name": "John", "tags": ["a"]}\n```',
                'For example:\n```json\n{"name": "John", "tags": ["a"]}\n```', []),
}


@pytest.mark.parametrize("case", list(WRITTEN))
def test_calls_written_without_markers_are_tool_calls(srv, case):
    """A fenced or bare call the model writes is a `tool_calls` entry (`finish_reason`
    "tool_calls"), streamed as an opened call and its argument pieces that join to the
    answer's `arguments`; a JSON block that is no call stays content, byte for byte."""
    text, content, want = WRITTEN[case]
    req = {"messages": ASK, "tools": TOOLS, "max_tokens": 200, "temperature": 0,
           "grammar": "start: " + json.dumps(text)}
    status, body = call(srv, "/v1/chat/completions", req)
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["message"]["content"] == content
    calls = choice["message"].get("tool_calls") or []
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == want
    assert choice["finish_reason"] == ("tool_calls" if want else "stop")
    events = stream(srv, "/v1/chat/completions", req)
    assert [(c["name"], c["arguments"]) for c in streamed_calls(events[:-1])] == want
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == (content or "")
    assert events[-2]["choices"][0]["finish_reason"] == choice["finish_reason"]
    if case == "two":  # one call only when parallel calls are refused
        status, body = call(srv, "/v1/chat/completions", {**req, "parallel_tool_calls": False})
        message = body["choices"][0]["message"]
        assert [c["function"]["name"] for c in message["tool_calls"]] == ["edit_file"]
        assert message["content"] == f"\n\n```json\n{ADD}\n```"


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


def raw_answer(srv, req: dict) -> str:
    """The text a chat request's prompt gets with no grammar (`/completion`), markup and all."""
    prompt = call(srv, "/apply-template", {"messages": req["messages"],
                                           "tools": req["tools"]})[1]["prompt"]
    status, body = call(srv, "/completion", {
        "prompt": prompt, "n_predict": req["max_tokens"], "temperature": req["temperature"],
        "seed": req.get("seed"),
        "logit_bias": [[int(k), v] for k, v in req.get("logit_bias", {}).items()]})
    assert status == 200, body
    return body["content"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auto_holds_each_call_the_model_opens(srv, opening, seed):
    """"auto" leaves the text free until the model writes `<tool_call>`, then holds the call
    to a listed function with valid arguments: the random model (pushed to open calls) makes
    one (`parallel_tool_calls` false), where without the grammar it writes no call that
    parses."""
    req = {"messages": ASK, "tools": TOOLS, "max_tokens": 120, "temperature": 1.0,
           "seed": seed, "logit_bias": {opening: 4}, "parallel_tool_calls": False}
    status, body = call(srv, "/v1/chat/completions", req)
    assert status == 200, body
    message = body["choices"][0]["message"]
    assert len(message["tool_calls"]) == 1
    check_calls(message["tool_calls"])
    raw = raw_answer(srv, req)
    assert "<tool_call>" in raw
    assert not ToolCallSplitter(SYNTAX, None).split(raw)[1]
    # the text before the call is the model's own, as with no grammar
    assert message["content"].startswith(raw.split("<tool_call>")[0])


def test_auto_leaves_the_text_and_its_end_free(srv):
    """Without a call the answer is the one with no grammar, token for token, and the end of
    the turn stays allowed (pushed up here, it ends the answer at once)."""
    req = {"messages": ASK, "tools": TOOLS, "max_tokens": 40, "temperature": 0}
    status, body = call(srv, "/v1/chat/completions", req)
    assert status == 200 and not body["choices"][0]["message"].get("tool_calls")
    assert body["choices"][0]["message"]["content"] == raw_answer(srv, req), body
    status, body = call(srv, "/v1/chat/completions", {**req, "logit_bias": {"0": 100}})
    assert status == 200
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 0


def test_auto_calls_are_the_same_in_every_mode(srv, opening):
    """"auto" with its grammar (text and calls amid it) is token-identical to `none`, greedy
    and seeded."""
    for extra in ({"temperature": 0}, {"temperature": 0.9, "seed": 11}):
        answers = {}
        for mode in ("none", "ngram", "draft", "lookahead", "suffix", "auto"):
            status, body = call(srv, "/v1/chat/completions", {
                "messages": ASK, "tools": TOOLS, "max_tokens": 100,
                "logit_bias": {opening: 4}, "speculative": {"mode": mode}, **extra})
            if status == 400 and mode == "draft":  # no draft model loaded
                continue
            assert status == 200, (mode, body)
            message = body["choices"][0]["message"]
            answers[mode] = (message["content"], [c["function"] for c in
                                                  message.get("tool_calls") or []])
        want = answers.pop("none")
        assert want[1]  # calls were made
        for mode, got in answers.items():
            assert got == want, (mode, extra)


def test_a_proposal_beyond_the_tokenizer_is_cut_not_an_error(tools_model_dir, opening):
    """A draft may hold ids of the model's padded head (past the tokenizer's 300 here, as a
    random model writes them): the grammar cuts the proposal there and stays usable."""
    from mlx_lm.utils import load_tokenizer

    from mlxspec.constrain import Constraint
    from mlxspec.server.tools import call_grammar

    tokenizer = load_tokenizer(tools_model_dir)
    syntax = ToolSyntax("<tool_call>", "</tool_call>", json_tools.parse_tool_call,
                        int(opening), tokenizer.encode("</tool_call>",
                                                       add_special_tokens=False)[0])
    c = Constraint(tokenizer, "lark", call_grammar(syntax, TOOLS, None, True, free=True), 0)
    assert c.cut([1, 305, 2]) == 1 and c.cut([5, 6, 2]) == 2
    assert not c.matcher.is_error() and c.bitmasks([1]).any()


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
