"""Tool calls: a request's `tools` and `tool_choice` resolved (`choose_calls`), earlier calls
rendered for the template (`template_calls`), the model's own call syntax found in its answer
(mlx-lm's tool parsers, chosen from the model's chat template as mlx-lm chooses them), and the
grammar that makes a `tool_choice` of "required" or a named function hold from the answer's
first token."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolSyntax:
    """How a model writes a call: between `start` and `end` (empty: to the end of the
    answer), parsed by `parse(text, tools)` into {"name", "arguments"} or a list of them."""

    start: str
    end: str
    parse: Callable
    start_id: int | None = None  # the markers' token ids where each is one token
    end_id: int | None = None


def tool_syntax(tokenizer) -> ToolSyntax | None:
    """The tokenizer's tool-call syntax (mlx-lm's `TokenizerWrapper`), None without one."""
    if not getattr(tokenizer, "has_tool_calling", False):
        return None
    start, end = tokenizer.tool_call_start, tokenizer.tool_call_end or ""

    def one_token(text: str) -> int | None:
        ids = tokenizer.encode(text, add_special_tokens=False) if text else []
        return ids[0] if len(ids) == 1 else None

    return ToolSyntax(start, end, tokenizer.tool_parser, one_token(start), one_token(end))


def _held(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker` (kept back until the
    next piece says whether they do)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolCallSplitter:
    """An answer's text, fed in pieces, split into the text to show and complete calls
    (each {"name", "arguments"}). Whitespace between calls is not shown; a call that does
    not parse is dropped, as mlx-lm's server drops it (its markup is never shown)."""

    def __init__(self, syntax: ToolSyntax, tools: list | None):
        self.syntax, self.tools = syntax, tools
        self.buffer = ""
        self.in_call = False
        self.called = False  # a call was made: whitespace after it waits to see what follows

    def feed(self, text: str) -> tuple[str, list[dict]]:
        start, end = self.syntax.start, self.syntax.end
        self.buffer += text
        shown, calls = [], []
        while True:
            if not self.in_call:
                i = self.buffer.find(start)
                if i < 0:
                    keep = _held(self.buffer, start)
                    if self.called and not self.buffer[:len(self.buffer) - keep].strip():
                        break  # only whitespace since the last call: held
                    shown.append(self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    self.called = False
                    break
                if not (self.called and not self.buffer[:i].strip()):
                    shown.append(self.buffer[:i])
                self.buffer = self.buffer[i + len(start):]
                self.in_call = True
            else:
                i = self.buffer.find(end) if end else -1
                if i < 0:
                    break
                calls += self._parse(self.buffer[:i])
                self.buffer = self.buffer[i + len(end):]
                self.in_call, self.called = False, True
        return "".join(shown), calls

    def flush(self) -> tuple[str, list[dict]]:
        """The end of the answer: what is still held back (a call without its end marker
        is parsed as it stands)."""
        rest, self.buffer = self.buffer, ""
        if self.in_call:
            self.in_call = False
            return "", self._parse(rest)
        return ("" if self.called and not rest.strip() else rest), []

    def _parse(self, body: str) -> list[dict]:
        try:
            got = self.syntax.parse(body, self.tools)
        except Exception:  # not a call (malformed, or cut short by max_tokens)
            return []
        calls = got if isinstance(got, list) else [got]
        return [c for c in calls if isinstance(c, dict) and isinstance(c.get("name"), str)]


def openai_call(call: dict) -> dict:
    """A parsed call as OpenAI's `tool_calls` entry (arguments as a JSON string)."""
    args = call.get("arguments", {})
    return {"id": call.get("id") or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call["name"], "arguments": args if isinstance(args, str)
                         else json.dumps(args, ensure_ascii=False)}}


def function_of(tool) -> dict | None:
    """A `tools` entry's function ({"name", "parameters", ...}), in OpenAI's chat shape
    ({"type": "function", "function": {...}}) or the flat one (Responses)."""
    if not isinstance(tool, dict):
        return None
    fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
    return fn if isinstance(fn.get("name"), str) else None


def call_grammar(syntax: ToolSyntax, tools: list[dict], name: str | None,
                 parallel: bool) -> str:
    """A Lark grammar (llguidance) for an answer that is tool calls only: one (or, with
    `parallel`, several) of `tools`, or the one named, with arguments valid against its
    JSON Schema; in the model's own syntax (the JSON-in-markers form, `json_tools`)."""
    chosen = [f for f in map(function_of, tools) if f and (name is None or f["name"] == name)]
    # Written as the model writes JSON (`{"name": "f", "arguments": {...}}`): free
    # whitespace would let a sampled answer wander in it.
    schema = {"x-guidance": {"whitespace_flexible": False, "key_separator": ": ",
                             "item_separator": ", "},
              "anyOf": [{"type": "object",
                         "properties": {"name": {"const": f["name"]},
                                        "arguments": f.get("parameters") or {"type": "object"}},
                         "required": ["name", "arguments"], "additionalProperties": False}
                        for f in chosen]}

    def marker(text: str, token: int | None) -> str:
        return f"<[{token}]>" if token is not None else json.dumps(text)

    call = f'{marker(syntax.start, syntax.start_id)} "\\n" body "\\n" ' \
           f'{marker(syntax.end, syntax.end_id)}'
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    return f"{start}\ncall: {call}\nbody: %json {json.dumps(schema)}\n"


def choose_calls(r, req, syntax: ToolSyntax | None, tokenizer) -> None:
    """A chat request's (`r`) `tools` and `tool_choice` on its `GenRequest` (`req`): which
    calls the answer's text is parsed for (`req.tools`), and for "required" or a named
    function the grammar that makes the answer such a call (`req.grammar`)."""
    from ..constrain import check_grammar
    from ..errors import MlxspecError
    from .protocol import bad

    choice = "auto" if r.tool_choice is None else r.tool_choice
    named = None
    if isinstance(choice, dict):
        fn = choice.get("function")
        named = fn.get("name") if isinstance(fn, dict) else choice.get("name")
        if choice.get("type", "function") != "function" or not isinstance(named, str):
            raise bad("'tool_choice' must be \"none\", \"auto\", \"required\" or "
                      "{\"type\": \"function\", \"function\": {\"name\": ...}}",
                      "tool_choice")
    elif choice not in ("none", "auto", "required"):
        raise bad(f"'tool_choice' must be \"none\", \"auto\", \"required\" or a "
                  f"function, got {choice!r}", "tool_choice")
    if not r.tools:
        if choice not in ("none", "auto"):
            raise bad("'tool_choice' asks for a tool call, and 'tools' lists none",
                      "tool_choice")
        return
    names = [t.function.name for t in r.tools]
    if named is not None and named not in names:
        raise bad(f"'tool_choice' names the function {named!r}, which is not in 'tools' "
                  f"({', '.join(names)})", "tool_choice")
    if choice == "none":
        return
    if syntax is None:
        if choice == "auto":
            return  # the template shows the tools; the answer is text
        raise bad("this model has no tool-call syntax (its chat template does not say how "
                  "it calls tools): 'tool_choice' cannot require a call", "tool_choice")
    req.tools = [t.model_dump(exclude_none=True) for t in r.tools]
    if choice == "auto":
        return
    if req.grammar is not None:
        raise bad("'tool_choice' requiring a call cannot be combined with "
                  "'response_format' or a grammar", "tool_choice")
    if not syntax.parse.__module__.endswith("json_tools"):
        raise bad("'tool_choice' can require a call only of models whose calls are JSON "
                  f"between {syntax.start} and {syntax.end}", "tool_choice")
    # One call unless the request allows several (llama-server's default: a small model
    # asked for calls keeps calling).
    grammar = ("lark", call_grammar(syntax, req.tools, named,
                                    parallel=r.parallel_tool_calls is True))
    try:
        check_grammar(tokenizer, *grammar)
    except MlxspecError as e:
        raise bad(f"a tool's 'parameters' is not a JSON Schema this server can follow: {e}",
                  "tools") from None
    req.grammar = grammar


def template_calls(calls, where: str) -> list[dict]:
    """An assistant message's `tool_calls` as chat templates read them: each
    {"id", "type", "function": {"name", "arguments"}} with the arguments an object (OpenAI
    sends them as a JSON string)."""
    from .protocol import bad

    if not isinstance(calls, list):
        raise bad(f"'{where}' must be a list of calls", where)
    out = []
    for i, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad(f"'{where}[{i}]' must be {{\"type\": \"function\", \"function\": "
                      "{\"name\": ..., \"arguments\": ...}}", f"{where}[{i}]")
        args = fn.get("arguments") or {}
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError as e:
                raise bad(f"'{where}[{i}].function.arguments' is not valid JSON: {e}",
                          f"{where}[{i}].function.arguments") from None
        out.append({**c, "type": "function", "function": {**fn, "arguments": args}})
    return out
