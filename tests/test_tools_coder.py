"""Tool calls on the real Qwen2.5-Coder-0.5B-Instruct through `mlxspec serve` (`.ci/run`
fetches it): over eight tools (nested objects, arrays, enums), a required or named
`tool_choice` always yields a call of a listed function whose arguments validate against its
schema, and a tool-calling answer is token-identical in every mode, greedy and seeded."""

from __future__ import annotations

import json

import jsonschema
import pytest
from server_helpers import post, start, stop

pytestmark = pytest.mark.slow
MODEL = "qwen2.5-coder-0.5b"

TEXT = {"type": "string", "maxLength": 40}
PERSON = {"type": "object", "properties": {"name": TEXT, "email": TEXT},
          "required": ["name"], "additionalProperties": False}
SCHEMAS = {
    "read_file": {"type": "object", "properties": {
        "path": TEXT, "start_line": {"type": "integer", "minimum": 1},
        "end_line": {"type": "integer", "minimum": 1}}, "required": ["path"]},
    "write_file": {"type": "object", "properties": {
        "path": TEXT, "content": {"type": "string", "maxLength": 120}},
        "required": ["path", "content"], "additionalProperties": False},
    "replace_in_file": {"type": "object", "properties": {
        "path": TEXT, "edits": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
            "type": "object", "properties": {"old": TEXT, "new": TEXT},
            "required": ["old", "new"], "additionalProperties": False}}},
        "required": ["path", "edits"]},
    "run_command": {"type": "object", "properties": {
        "command": {"type": "string", "maxLength": 60},
        "timeout_seconds": {"type": "integer", "minimum": 1, "maximum": 600}},
        "required": ["command"]},
    "search_code": {"type": "object", "properties": {
        "query": TEXT, "file_types": {"type": "array", "maxItems": 3,
                                      "items": {"enum": ["py", "js", "md", "toml"]}},
        "case_sensitive": {"type": "boolean"}}, "required": ["query", "file_types"]},
    "create_issue": {"type": "object", "properties": {
        "title": TEXT, "priority": {"enum": ["low", "medium", "high"]},
        "labels": {"type": "array", "maxItems": 3, "items": {"enum": ["bug", "docs", "perf"]}},
        "assignee": PERSON}, "required": ["title", "priority", "assignee"]},
    "get_weather": {"type": "object", "properties": {
        "city": TEXT, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False},
    "schedule_meeting": {"type": "object", "properties": {
        "title": TEXT, "attendees": {"type": "array", "minItems": 1, "maxItems": 3,
                                     "items": PERSON},
        "start": {"type": "object", "properties": {
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "hour": {"type": "integer", "minimum": 0, "maximum": 23}},
            "required": ["date", "hour"], "additionalProperties": False},
        "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 240}},
        "required": ["title", "attendees", "start"]},
}
ASKS = {
    "read_file": "Show me lines 10 to 30 of src/app.py.",
    "write_file": "Create notes.txt saying that the build is green.",
    "replace_in_file": "In setup.py, rename the variable VERSION to __version__.",
    "run_command": "Run the test suite with pytest, give it two minutes at most.",
    "search_code": "Find where parse_config is defined in the Python and TOML files.",
    "create_issue": "File a high-priority bug about the crash on start-up, for Ana.",
    "get_weather": "What's the weather in Lisbon, in celsius?",
    "schedule_meeting": "Book a 30 minute design review with Bo on 2027-01-12 at 10.",
}
TOOLS = [{"type": "function", "function": {"name": n, "description": ASKS[n].split(",")[0],
                                            "parameters": s}} for n, s in SCHEMAS.items()]
SYSTEM = {"role": "system", "content": "You are a coding agent. Use the tools to act."}


def serve(coder_small, draft=None):
    from mlxspec.engine import Engine

    engine = Engine(coder_small.model, coder_small.tokenizer, mode="auto", name=MODEL)
    engine.draft_model = draft
    return start(engine)


@pytest.fixture(scope="module")
def srv(coder_small):
    server = serve(coder_small)
    yield server
    stop(server)


@pytest.fixture(scope="module")
def srv_draft(coder_small, coder_small_4bit):
    """With a real draft that disagrees now and then (its catch-up on a prompt is a 4-bit
    prefill on this CPU: the requests here list two tools, not eight)."""
    server = serve(coder_small, coder_small_4bit)
    yield server
    stop(server)


def call(srv, path: str, body: dict) -> tuple[int, dict]:
    """(status, JSON answer): a real model's prompt of eight tools takes a while here."""
    status, payload, _ = post(srv.url, path, body, timeout=600)
    return status, json.loads(payload)


def ask(name: str) -> list[dict]:
    return [SYSTEM, {"role": "user", "content": ASKS[name]}]


def checked_calls(body: dict, name: str | None = None) -> list[dict]:
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    calls = choice["message"]["tool_calls"]
    assert calls
    for c in calls:
        got = c["function"]["name"]
        assert got in SCHEMAS and (name is None or got == name), c
        jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMAS[got])
    return calls


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_a_named_function_is_called_with_valid_arguments(srv, name):
    status, body = call(srv, "/v1/chat/completions", {
        "messages": ask(name), "tools": TOOLS, "max_tokens": 160, "temperature": 0,
        "tool_choice": {"type": "function", "function": {"name": name}}})
    assert status == 200, body
    checked_calls(body, name)


def test_required_calls_a_listed_function_validly_at_any_seed(srv):
    for i, name in enumerate(SCHEMAS):
        status, body = call(srv, "/v1/chat/completions", {
            "messages": ask(name), "tools": TOOLS, "tool_choice": "required",
            "max_tokens": 160, "temperature": 1.0, "seed": i})
        assert status == 200, body
        checked_calls(body)


def test_a_tool_call_is_the_same_in_every_mode(srv_draft):
    """A forced call (seeded) and a free (`auto`) turn: every mode gives `none`'s tokens
    (lookahead: in the random models' tests; each request here costs seconds)."""
    tools = [t for t in TOOLS if t["function"]["name"] in ("replace_in_file", "write_file")]
    for choice, name, extra, modes in (
            ("required", "replace_in_file", {"temperature": 0.8, "seed": 7},
             ("none", "ngram", "draft", "suffix", "auto")),
            # (the draft's catch-up on a prompt is a 4-bit prefill here: seconds a request;
            # greedy forced calls in every mode: test_constrained_coder.py's schemas)
            ("auto", "write_file", {"temperature": 0}, ("none", "ngram"))):
        answers = {}
        for mode in modes:
            status, body = call(srv_draft, "/v1/chat/completions", {
                "messages": ask(name), "tools": tools, "tool_choice": choice,
                "max_tokens": 96, "speculative": {"mode": mode}, **extra})
            assert status == 200, (mode, body)
            message = body["choices"][0]["message"]
            answers[mode] = (message["content"],
                             [c["function"] for c in message.get("tool_calls") or []])
        want = answers.pop("none")
        for mode, got in answers.items():
            assert got == want, (choice, extra, mode)
