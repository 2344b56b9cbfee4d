"""Tool calls: a request's `tools` and `tool_choice` resolved (`choose_calls`), earlier calls
rendered for the template (`template_calls`), the model's own call syntax found in its answer
(mlx-lm's tool parsers, chosen from the model's chat template as mlx-lm chooses them; the JSON
form's calls also as a fenced block or a bare object) and split from its text as it streams, a
JSON call's arguments in pieces (`ToolCallSplitter`), and the grammars that hold calls: from
the answer's first token for a `tool_choice` of "required" or a named function, from the
call's opening token on for "auto" (`call_grammar`)."""

from __future__ import annotations

import json
import re
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

    @property
    def json_form(self) -> bool:
        """Calls are JSON between the markers (`{"name": ..., "arguments": {...}}`)."""
        return getattr(self.parse, "__module__", "").endswith("json_tools")


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


@dataclass
class CallOpen:
    """A call whose arguments follow in pieces (`CallArgs`): its index in the answer's calls,
    its id and the function's name."""

    index: int
    id: str
    name: str


@dataclass
class CallArgs:
    """The next piece of an open call's arguments (its text as the model wrote it)."""

    index: int
    text: str


@dataclass
class CallDone:
    """A call ended: `call` in OpenAI's shape (`openai_call`). `streamed`: it was opened
    (`CallOpen`) and its `arguments` are exactly its `CallArgs` pieces joined; otherwise it
    comes whole here."""

    index: int
    call: dict
    streamed: bool = False


_WS = " \t\n\r"
# The head of a call whose arguments can stream: `{"name": STRING, "arguments": {`
_HEAD = ("{", '"name"', ":", None, ",", '"arguments"', ":", "{")


def _call_head(body: str, names: set | None = None) -> tuple[str, str | None, int]:
    """Whether a JSON call's body starts `{"name": "f", "arguments": {` (JSON whitespace
    anywhere between; with `names`, `f` one of them): ("open", name, where the arguments' `{`
    is), ("more", None, 0) while the text so far could still, ("no", None, 0) once it
    cannot (with `names`, from the name's first character that no listed name has)."""
    i, n, name = 0, len(body), None
    for step in _HEAD:
        while i < n and body[i] in _WS:
            i += 1
        if i == n:
            return "more", None, 0
        if step is None:  # the name: a JSON string
            if body[i] != '"':
                return "no", None, 0
            j, escaped = i + 1, False
            while j < n and (escaped or body[j] != '"'):
                escaped = not escaped and body[j] == "\\"
                j += 1
            if j == n:  # no listed name begins so: known already
                so_far = body[i + 1:j]
                if names is not None and "\\" not in so_far and not any(
                        f.startswith(so_far) for f in names):
                    return "no", None, 0
                return "more", None, 0
            try:
                name = json.loads(body[i:j + 1])
            except json.JSONDecodeError:
                return "no", None, 0
            if names is not None and name not in names:
                return "no", None, 0
            i = j + 1
        elif step == "{" and name is not None:
            return ("open", name, i) if body[i] == "{" else ("no", None, 0)
        else:
            got = body[i:i + len(step)]
            if not step.startswith(got):
                return "no", None, 0
            if len(got) < len(step):
                return "more", None, 0
            i += len(step)
    return "no", None, 0  # not reached


_FENCE = "```"
# The rest of a fence's first line: nothing or `json` (any case), then the newline; and what
# may still become that line
_FENCE_LINE = re.compile(r"[ \t]*(?:json)?[ \t\r]*", re.I)
_FENCE_LINE_SO_FAR = re.compile(r"[ \t]*(?:j(?:s(?:o(?:n[ \t\r]*)?)?)?|[ \t\r]*)", re.I)


class ToolCallSplitter:
    """An answer's text, fed in pieces, split into its parts in order: text to show (str),
    and calls. A call in the JSON form (`{"name": ..., "arguments": {...}}`, `json_tools`)
    opens (`CallOpen`) once its name is read and its arguments' `{` is seen; the arguments
    then go out in pieces as they come (`CallArgs`, up to their closing `}`; only what could
    begin the end marker is held back), and the call ends with its marker (`CallDone`,
    `streamed`). An opened call is never taken back: its arguments are the pieces sent, also
    where the answer stops inside them (max_tokens: not valid JSON, as OpenAI's cut calls).
    Any other call (another syntax, `arguments` before `name`, a list of calls) is parsed
    once its end marker is seen and comes whole; one that does not parse is dropped, as
    mlx-lm's server drops it (its markup is never shown). Whitespace between calls is not
    shown.

    The JSON form's calls are also read without the markers, as models write them in
    markdown: a fenced block (a line starting ```` ```json ```` or ```` ``` ````, at the
    answer's start or after a newline) or a bare object (where only whitespace came since the
    answer's start or the last call) whose body starts `{"name": "f", "arguments": {` with
    `f` one of `tools`. The text from such a fence or brace is held back only until its head
    says whether it is one (the name read: a function not listed, or any other start, and it
    is shown at once, byte for byte); a call then streams as above and ends at its object's
    closing `}` (a fenced one with its closing fence, which is not shown). Without `parallel`
    these forms are read only until the answer's first call."""

    def __init__(self, syntax: ToolSyntax, tools: list | None, parallel: bool = True):
        self.syntax, self.tools, self.parallel = syntax, tools, parallel
        self.buffer = ""
        self.in_call = False
        self.called = False  # a call was made: whitespace after it waits to see what follows
        self.count = 0  # calls given an index so far
        self.stream_args = syntax.json_form and bool(syntax.end)
        # the functions a call without markers may name (the JSON form only)
        self.names = ({f["name"] for f in map(function_of, tools or []) if f}
                      if syntax.json_form else set())
        self.line_start = True  # the buffer starts a line (a fence may open there)
        self.blank = True  # only whitespace shown since the answer's start or the last call
        self.form = "marker"  # the call's form: "marker", "fence" or "bare"
        self._new_call()

    def _new_call(self) -> None:
        self.open: CallOpen | None = None  # the call being streamed
        self.whole = False  # the call is not in the streamable form: it comes whole
        self.args_at = self.scanned = self.sent = 0  # positions in the buffer
        self.depth, self.in_string, self.escaped = 0, False, False
        self.args_done = False
        # a call without markers, its arguments whole: how far the rest of its object is
        # read, and where the object closed (0: not yet)
        self.tail_at = self.closed_at = 0

    def split(self, text: str) -> tuple[str, list[dict]]:
        """A whole answer's text and calls (OpenAI's shape)."""
        parts = self.feed(text) + self.flush()
        return ("".join(p for p in parts if isinstance(p, str)),
                [p.call for p in parts if isinstance(p, CallDone)])

    def feed(self, text: str) -> list:
        start, end = self.syntax.start, self.syntax.end
        self.buffer += text
        out: list = []
        while True:
            if not self.in_call:
                i, form, body_at = self._opening()
                if body_at is None:  # no call: shown up to what may still begin one
                    cut = len(self.buffer) - _held(self.buffer, start) if i is None else i
                    if self.called and not self.buffer[:cut].strip():
                        break  # only whitespace since the last call: held
                    self._show(cut, out)
                    break
                if i and not (self.called and not self.buffer[:i].strip()):
                    out.append(self.buffer[:i])
                self.buffer = self.buffer[body_at:]
                self.in_call, self.form = True, form
                self._new_call()
            elif self.form != "marker":  # a call without markers: it ends with its object
                self._stream(len(self.buffer), out)
                cut = self._object_end(final=False)
                if cut is None:
                    break
                out += self._close("")
                self._ended(cut)
            else:
                i = self.buffer.find(end) if end else -1
                if i < 0:
                    self._stream(len(self.buffer) - _held(self.buffer, end) if end else 0, out)
                    break
                self._stream(i, out)
                out += self._close(self.buffer[:i])
                self._ended(i + len(end))
        return out

    def flush(self) -> list:
        """The end of the answer: what is still held back (a call without its end marker:
        an open one ends with what it has, another is parsed as it stands; text that might
        have begun a call is shown)."""
        if self.in_call:
            out: list = []
            self._stream(len(self.buffer), out)
            out += self._close(self.buffer)
            if self.form != "marker":  # text after its object, before the answer's end
                cut = self._object_end(final=True)
                rest = self.buffer[cut:] if cut is not None else ""
                self._ended(len(self.buffer))
                if rest.strip():
                    out.append(rest)
                return out
            self.buffer, self.in_call = "", False
            return out
        rest, self.buffer = self.buffer, ""
        return [] if (self.called and not rest.strip()) or not rest else [rest]

    def _show(self, cut: int, out: list) -> None:
        """The buffer's first `cut` characters shown as text."""
        if cut > 0:
            shown = self.buffer[:cut]
            out.append(shown)
            self.line_start = shown.endswith("\n")
            self.blank = self.blank and not shown.strip()
            self.buffer = self.buffer[cut:]
        self.called = False

    def _ended(self, cut: int) -> None:
        """A call's text ended at `cut`: the rest of the buffer follows it."""
        self.buffer = self.buffer[cut:]
        self.in_call, self.called, self.form = False, True, "marker"
        self.line_start, self.blank = False, True

    def _opening(self) -> tuple[int | None, str, int | None]:
        """Where the buffer's first call begins (`i`), its form, and where its body starts
        (None: the text from `i` may still turn out to be a call without markers; `i` None
        too: nothing in the buffer begins one)."""
        buf = self.buffer
        m = buf.find(self.syntax.start)
        if self.names and (self.parallel or not self.count):
            # fences at each line's start, a bare object at the first non-whitespace
            starts = [(i, "fence") for i in range(len(buf)) if (
                buf[i - 1] == "\n" if i else self.line_start) and buf[i] == "`"]
            if self.blank:
                first = len(buf) - len(buf.lstrip(_WS))
                if first < len(buf) and buf[first] == "{":
                    starts.append((first, "bare"))
            for i, form in sorted(starts):
                if 0 <= m <= i:
                    break
                state, body_at = self._loose_head(i, form)
                if state == "open":
                    return i, form, body_at
                if state == "more":
                    return i, form, None
        if m >= 0:
            return m, "marker", m + len(self.syntax.start)
        return None, "marker", None

    def _loose_head(self, i: int, form: str) -> tuple[str, int]:
        """Whether the text at `i` (a fence, or a bare object's `{`) is a call's head:
        ("open", where its body starts), ("more", 0) while it could still be, ("no", 0)."""
        body_at = i
        if form == "fence":
            rest = self.buffer[i:]
            if not rest.startswith(_FENCE):
                return ("more" if _FENCE.startswith(rest) else "no"), 0
            eol = rest.find("\n", len(_FENCE))
            line = rest[len(_FENCE):] if eol < 0 else rest[len(_FENCE):eol]
            if eol < 0:
                return ("more" if _FENCE_LINE_SO_FAR.fullmatch(line) else "no"), 0
            if not _FENCE_LINE.fullmatch(line):
                return "no", 0
            body_at = i + eol + 1
        state, _, _ = _call_head(self.buffer[body_at:], self.names)
        return state, body_at

    def _object_end(self, final: bool) -> int | None:
        """A call without markers whose arguments are whole: where its text ends (after its
        object's closing `}`, and a fenced one's closing fence), None while unknown. At the
        answer's end (`final`) it ends where its text does."""
        if not self.args_done:
            return len(self.buffer) if final else None
        buf, i = self.buffer, self.tail_at or self.scanned
        if not self.closed_at:  # the rest of the object after the arguments
            while i < len(buf):
                ch = buf[i]
                if self._in_string(ch):
                    pass
                elif ch == "`" and self.form == "fence":  # the fence closes a broken object
                    if buf.startswith(_FENCE, i):
                        return i + len(_FENCE)
                    if _FENCE.startswith(buf[i:]) and not final:
                        break
                elif ch in "{[":
                    self.depth += 1
                elif ch in "}]":
                    self.depth -= 1
                    if self.depth < 0:
                        self.closed_at = i + 1
                        break
                i += 1
            self.tail_at = i
            if not self.closed_at:
                return len(buf) if final else None
        if self.form == "bare":
            return self.closed_at
        j = self.closed_at
        while j < len(buf) and buf[j] in _WS:
            j += 1
        if buf.startswith(_FENCE, j):
            return j + len(_FENCE)
        if not final and _FENCE.startswith(buf[j:]):
            return None  # whitespace, or what may begin the closing fence
        return self.closed_at

    def _stream(self, upto: int, out: list) -> None:
        """The call's arguments in `buffer[:upto]` not sent yet, as a piece (opening the call
        first once its head is read)."""
        if not (self.stream_args or self.form != "marker") or self.whole or upto <= 0:
            return
        if self.open is None:
            state, name, at = _call_head(self.buffer[:upto])
            if state != "open":
                self.whole = state == "no"
                return
            self.open = CallOpen(self.count, f"call_{uuid.uuid4().hex[:24]}", name)
            self.count += 1
            self.args_at = self.scanned = self.sent = at
            out.append(self.open)
        i = self.scanned
        while i < upto and not self.args_done:
            ch = self.buffer[i]
            i += 1
            if self._in_string(ch):
                continue
            if ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                self.args_done = self.depth == 0
        self.scanned = i
        if i > self.sent:
            out.append(CallArgs(self.open.index, self.buffer[self.sent:i]))
            self.sent = i

    def _in_string(self, ch: str) -> bool:
        """The JSON string state moved past `ch`; whether `ch` is part of a string (its quotes
        included), where brackets and fences do not count."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
            return True
        if ch == '"':
            self.in_string = True
            return True
        return False

    def _close(self, body: str) -> list:
        """The call's end: the open one with the arguments sent, or the body parsed."""
        if self.open is not None:
            call = {"id": self.open.id, "type": "function", "function": {
                "name": self.open.name, "arguments": self.buffer[self.args_at:self.sent]}}
            return [CallDone(self.open.index, call, streamed=True)]
        out = []
        for c in self._parse(body):
            out.append(CallDone(self.count, openai_call(c)))
            self.count += 1
        return out

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
                 parallel: bool, free: bool = False) -> str:
    """A Lark grammar (llguidance) for tool calls in the model's own syntax (the
    JSON-in-markers form, `json_tools`): one (or, with `parallel`, several) of `tools`, or the
    one named, with arguments valid against its JSON Schema. Without `free` the answer is
    calls only; with it ("auto") the text is free, any token but the call's opening one
    (`syntax.start_id`, which must be one token), and a call is held to the grammar from
    that token to its end marker, the text free again after it."""
    chosen = [f for f in map(function_of, tools) if f and (name is None or f["name"] == name)]
    # Written as the model writes JSON (`{"name": "f", "arguments": {...}}`): free
    # whitespace would let a sampled answer wander in it.
    options = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
    if free:  # keywords the grammar cannot hold are ignored, not refused: "auto" answers
        options["lenient"] = True
    schema = {"x-guidance": options,
              "anyOf": [{"type": "object",
                         "properties": {"name": {"const": f["name"]},
                                        "arguments": f.get("parameters") or {"type": "object"}},
                         "required": ["name", "arguments"], "additionalProperties": False}
                        for f in chosen]}

    def marker(text: str, token: int | None) -> str:
        return f"<[{token}]>" if token is not None else json.dumps(text)

    call = f'{marker(syntax.start, syntax.start_id)} "\\n" body "\\n" ' \
           f'{marker(syntax.end, syntax.end_id)}'
    if free:
        start = (f"start: free (call free){'*' if parallel else '?'}\n"
                 f"free: <[^{syntax.start_id}]>*")
    else:
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
    req.tool_parallel = r.parallel_tool_calls is not False
    if choice == "auto":
        _auto_grammar(r, req, syntax, tokenizer)
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


def _auto_grammar(r, req, syntax: ToolSyntax, tokenizer) -> None:
    """`tool_choice` "auto" of the JSON form whose call opens with one token (Qwen2.5's
    `<tool_call>`): the grammar that leaves the text free and holds each call the model opens
    to a listed function with valid arguments (`call_grammar`, `free`). Several calls unless
    `parallel_tool_calls` is false. Without it (another syntax, a `response_format`, tools
    whose schemas do not compile) the answer is free and its calls parsed as written."""
    from ..constrain import check_grammar
    from ..errors import MlxspecError

    if req.grammar is not None or not syntax.json_form or syntax.start_id is None:
        return
    grammar = ("lark", call_grammar(syntax, req.tools, None,
                                    parallel=r.parallel_tool_calls is not False, free=True))
    try:
        check_grammar(tokenizer, *grammar)
    except MlxspecError:
        return
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
