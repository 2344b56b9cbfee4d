"""OpenAI's Responses API (`POST /v1/responses`), served as a chat completion.

A request's items become chat messages (`chat_body`): `instructions` and the leading
`system`/`developer` messages one system message, `function_call` items an assistant
message's `tool_calls` (consecutive assistant items merged into one message),
`function_call_output` items `role: "tool"` messages; `reasoning` items are dropped. The
conversion is a function of the items alone, so a conversation's next turn renders a prompt
that the earlier one is a prefix of, and the prompt cache serves it.

Function tools are offered as they are; a `namespace` tool's functions as `namespace.name`
(llama.cpp's flattening; the calls go back as `name` with `namespace`), the first of a name
met twice kept; other tools (`web_search`, `file_search`, `mcp`, ...) are skipped, as a local
model cannot run them. Images and files are refused (a text-only model).

Responses are kept for `previous_response_id` (their input and output items; not their
`instructions`, as OpenAI's), the last `STORED` of them, unless `store` is false.
"""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict

from starlette.responses import Response

from . import relay
from .answers import Usage, api_error
from .protocol import ApiError, bad
from .tools import CallArgs, CallOpen, ToolCallSplitter, function_of
from .worker import Delta, Done, Failed

STORED = 64  # responses kept for previous_response_id
UNLIMITED = 1 << 30  # max_tokens when max_output_tokens is absent
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text")
# mlxspec's and llama.cpp's own sampling fields, passed on as the chat endpoint takes them
EXTRAS = ("seed", "top_k", "min_p", "speculative")
# the chat body's fields an error may name, as this API names them
RENAMED = {"messages": "input", "max_tokens": "max_output_tokens",
           "response_format": "text.format"}
# why an answer ended early, as `incomplete_details.reason`
INCOMPLETE = {"length": "max_output_tokens", "timeout": "timeout", "shutdown": "shutdown"}


class ResponseStore:
    """The conversations (input and output items) of the last `size` stored responses."""

    def __init__(self, size: int):
        self.size = size
        self.items: OrderedDict[str, list[dict]] = OrderedDict()
        self.lock = threading.Lock()  # read on the parsing threads, written on the event loop

    def put(self, response_id: str, items: list[dict]) -> None:
        with self.lock:
            self.items[response_id] = items
            while len(self.items) > self.size:
                self.items.popitem(last=False)

    def get(self, response_id: str) -> list[dict] | None:
        with self.lock:
            items = self.items.get(response_id)
            if items is not None:
                self.items.move_to_end(response_id)
            return items


STORE = ResponseStore(STORED)


# ----------------------------------------------------------------------------- the request


def chat_body(body: dict) -> dict:
    """A Responses request as a chat completions body (400 naming the field it is wrong in)."""
    earlier = earlier_items(body)
    items = input_items(body)
    tools = chat_tools(body.get("tools"))[0]
    messages = chat_messages(earlier + items, first=len(earlier))
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad("'instructions' must be a string", "instructions")
        messages.insert(0, {"role": "system", "content": instructions})
    out = {"messages": one_system_prompt(messages)}
    limit = body.get("max_output_tokens")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                              or limit < 1):
        raise bad(f"'max_output_tokens' must be an integer >= 1, got {limit!r}",
                  "max_output_tokens")
    # None: as long as the context allows (the server lowers it to what the context leaves).
    # Agents send none (Codex CLI), and a cut answer is an error to them.
    out["max_tokens"] = limit if limit is not None else UNLIMITED
    for key in ("model", "temperature", "top_p", "stream", "parallel_tool_calls", *EXTRAS):
        if body.get(key) is not None:
            out[key] = body[key]
    if tools:
        out["tools"] = tools
    if body.get("tool_choice") is not None:
        out["tool_choice"] = chat_tool_choice(body["tool_choice"])
    fmt = response_format(body.get("text"))
    # `text.format` shapes a message; an answer held to calls has none (the Agents SDK sends
    # both: an agent's output type, the tool choice of its first turn)
    if fmt is not None and out.get("tool_choice") in (None, "none", "auto"):
        out["response_format"] = fmt
    return out


def earlier_items(body: dict) -> list[dict]:
    """The conversation of `previous_response_id` (none without one)."""
    previous = body.get("previous_response_id")
    if previous is None:
        return []
    items = STORE.get(previous) if isinstance(previous, str) else None
    if items is None:
        raise bad(f"'previous_response_id' {previous!r} names no response stored here (this "
                  f"server keeps the last {STORED} responses sent with 'store' not false, in "
                  "memory until it stops): send the whole conversation in 'input'",
                  "previous_response_id")
    return items


def input_items(body: dict) -> list[dict]:
    """`input` as a list of items (a string is one user message)."""
    given = body.get("input")
    if isinstance(given, str):
        return [{"type": "message", "role": "user", "content": given}]
    if not isinstance(given, list):
        raise bad("'input' is required: a string or a list of items" if given is None else
                  f"'input' must be a string or a list of items, got {type(given).__name__}",
                  "input")
    return given


def chat_tools(tools) -> tuple[list[dict], dict[str, tuple[str | None, str]]]:
    """`tools` in chat's shape (see the module's docstring), and each chat name's
    (namespace, name)."""
    if tools is None:
        return [], {}
    if not isinstance(tools, list):
        raise bad("'tools' must be a list", "tools")
    out, names = [], {}

    def add(tool, where: str, namespace: str | None = None) -> None:
        fn = function_of(tool)
        if fn is None:
            raise bad(f"'{where}.name' must be a string", f"{where}.name")
        if not isinstance(fn.get("parameters", {}), dict):
            raise bad(f"'{where}.parameters' must be a JSON Schema (an object)",
                      f"{where}.parameters")
        name = f"{namespace}.{fn['name']}" if namespace else fn["name"]
        if name not in names:
            names[name] = (namespace, fn["name"])
            out.append({"type": "function", "function": {**{
                k: v for k, v in fn.items() if k not in ("type", "name") and v is not None},
                "name": name}})

    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            add(tool, f"tools[{i}]")
        elif kind == "namespace":
            if not isinstance(tool.get("name"), str) or not isinstance(tool.get("tools"), list):
                raise bad(f"'tools[{i}]' must be a namespace {{\"name\": ..., \"tools\": "
                          "[functions]}", f"tools[{i}]")
            for j, fn in enumerate(tool["tools"]):
                if isinstance(fn, dict) and fn.get("type", "function") == "function":
                    add(fn, f"tools[{i}].tools[{j}]", tool["name"])
        elif not isinstance(kind, str):
            raise bad(f"'tools[{i}]' must be an object with a 'type'", f"tools[{i}].type")
    return out, names


def chat_messages(items: list, first: int = 0) -> list[dict]:
    """Items as chat messages; `items[first:]` are the request's `input` (errors name them)."""
    messages: list[dict] = []
    call_ids: set = set()
    for i, item in enumerate(items):
        where = f"input[{i - first}]"
        if not isinstance(item, dict):
            raise bad(f"'{where}' must be an object", where)
        kind = item.get("type", "message")  # the Agents SDK's messages have no type
        if kind == "message":
            role = ROLES.get(item.get("role"))
            if role is None:
                raise bad(f"'{where}.role' must be one of {', '.join(ROLES)}, got "
                          f"{item.get('role')!r}", f"{where}.role")
            text = item_text(item.get("content"), f"{where}.content")
            if role == "assistant":
                assistant_message(messages)["content"] += text
            else:
                messages.append({"role": role, "content": text})
        elif kind == "function_call":
            call = chat_call(item, where)
            call_ids.add(call["id"])
            assistant_message(messages).setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            if item.get("call_id") not in call_ids:
                raise bad(f"'{where}' is the output of call {item.get('call_id')!r}, which no "
                          "earlier function_call item made", f"{where}.call_id")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": item_text(item.get("output"), f"{where}.output")})
        elif kind != "reasoning":  # a reasoning item: the model's thoughts, not resent
            raise bad(f"'{where}.type' {kind!r} is not supported here: input items are "
                      "messages, function_call and function_call_output (reasoning items "
                      "are ignored)", f"{where}.type")
    return messages


def assistant_message(messages: list[dict]) -> dict:
    """The assistant message an assistant item joins: the last message if it is one."""
    if not messages or messages[-1]["role"] != "assistant":
        messages.append({"role": "assistant", "content": ""})
    return messages[-1]


def chat_call(item: dict, where: str) -> dict:
    """A `function_call` item as a chat `tool_calls` entry."""
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise bad(f"'{where}.{key}' must be a string", f"{where}.{key}")
    namespace = item.get("namespace")
    name = f"{namespace}.{item['name']}" if namespace else item["name"]
    return {"id": item["call_id"], "type": "function",
            "function": {"name": name, "arguments": item["arguments"]}}


def item_text(content, where: str) -> str:
    """A message's content (a string or text parts) or a call's output, as text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"'{where}' must be a string or a list of text parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise bad(f"'{where}[{j}]' is an {kind} part: this server's model reads text "
                      "only (send input_text parts)", f"{where}[{j}]")
        else:
            raise bad(f"'{where}[{j}]' must be a text part (input_text or output_text), got "
                      f"type {kind!r}", f"{where}[{j}]")
    return "".join(texts)


def one_system_prompt(messages: list[dict]) -> list[dict]:
    """The leading system messages (instructions, developer messages) joined into one: chat
    templates that take a system message only first (Qwen's) render them all."""
    n = 0
    while n < len(messages) and messages[n]["role"] == "system":
        n += 1
    if n < 2:
        return messages
    joined = "\n\n".join(m["content"] for m in messages[:n])
    return [{"role": "system", "content": joined}, *messages[n:]]


def chat_tool_choice(choice):
    """`tool_choice`: the words as they are; {"type": "function", "name"} in chat's shape."""
    if isinstance(choice, str):
        return choice  # the chat endpoint checks the words
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(
            choice.get("name"), str):
        namespace = choice.get("namespace")
        name = f"{namespace}.{choice['name']}" if namespace else choice["name"]
        return {"type": "function", "function": {"name": name}}
    raise bad("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": "
              "\"function\", \"name\": ...} (hosted tools are not served here)", "tool_choice")


def response_format(text) -> dict | None:
    """`text.format` as chat's `response_format` (None: plain text)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad("'text' must be an object", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad("'text.format' of type json_schema needs a 'schema' (a JSON Schema "
                      "object)", "text.format.schema")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"),
                                                       "schema": fmt["schema"]}}
    raise bad("'text.format.type' must be \"text\", \"json_object\" or \"json_schema\", got "
              f"{kind!r}", "text.format.type")


def error_response(err: ApiError) -> Response:
    """An error in OpenAI's shape, the field named as this API names it."""
    for chat, ours in RENAMED.items():
        if err.param is not None and (err.param == chat
                                      or err.param.startswith((chat + "[", chat + "."))):
            err.param = ours
    return api_error(err)


# ----------------------------------------------------------------------------- the answer


def response_usage(usage: Usage) -> dict:
    """A Responses `usage`, with mlxspec's speculation figures."""
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "speculative": usage.speculative()}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class Answer(relay.Answer):
    """A response: its output items (messages and function calls, in the order the model
    wrote them) as one JSON body, or streamed as Responses events with sequence numbers."""

    def __init__(self, group: relay.JobGroup, body: dict, parser, metrics,
                 write_timeout: float):
        super().__init__(group, metrics, write_timeout)
        self.body, self.req = body, group.req
        self.id = f"resp_{group.req.id}"
        self.created_at = group.req.created
        tools = group.req.tools
        self.splitter = (ToolCallSplitter(parser.tool_syntax, tools, group.req.tool_parallel)
                         if tools else None)
        self.names = chat_tools(body.get("tools"))[1]
        self.output: list[dict] = []  # the finished items
        self.message: dict | None = None  # the message item being written
        self.call: dict | None = None  # the function_call item whose arguments are streaming
        self.sequence = 0
        self.started = False  # the stream's headers are sent

    async def relay(self) -> int:
        """Read the job's events to its end; answer them (or stream them as they come)."""
        while True:
            _, ev = await self.next_event()
            if isinstance(ev, Failed):
                return await self._fail(ev.error)
            if self.req.stream and not self.started:
                self.started = True
                await self._start_sse()
                for kind in ("response.created", "response.in_progress"):
                    await self._event(kind, response=self._response("in_progress"))
            if isinstance(ev, Delta):
                await self._add(self._split(ev))
            elif isinstance(ev, Done):
                await self._add(self._split(ev))
                await self._close_message()
                return await self._finish(ev)

    def _split(self, ev: Delta | Done) -> list:
        """A delta's text (at the end, what is still held back) as its parts in order: text
        (str) and the calls' (`CallOpen`, `CallArgs`, `CallDone`)."""
        if self.splitter is None:
            return [ev.text] if isinstance(ev, Delta) and ev.text else []
        return self.splitter.feed(ev.text) if isinstance(ev, Delta) else self.splitter.flush()

    async def _event(self, kind: str, **fields) -> None:
        """One event of the stream (nothing when the answer is one body)."""
        if self.req.stream:
            await self._sse({"type": kind, "sequence_number": self.sequence, **fields}, kind)
            self.sequence += 1

    async def _add(self, parts: list) -> None:
        """The model's text and calls, in order: text joins the message being written, each
        call is an item of its own (its arguments streamed as they come where the splitter
        opens it, else whole)."""
        for part in parts:
            if isinstance(part, str):
                await self._add_text(part)
            elif isinstance(part, CallOpen):
                await self._close_message()
                await self._open_call(part.id, part.name)
            elif isinstance(part, CallArgs):
                await self._call_delta(part.text)
            elif part.streamed:
                await self._close_call()
            else:
                await self._close_message()
                fn = part.call["function"]
                await self._open_call(part.call["id"], fn["name"])
                await self._call_delta(fn["arguments"])
                await self._close_call()

    async def _add_text(self, text: str) -> None:
        where = {"output_index": len(self.output)}
        if self.message is None:
            self.message = {"id": new_id("msg"), "type": "message", "status": "in_progress",
                            "role": "assistant", "content": []}
            await self._event("response.output_item.added", **where, item=self.message)
            await self._event("response.content_part.added", item_id=self.message["id"],
                              **where, content_index=0, part=text_part(""))
            self.message["content"].append(text_part(""))
        self.message["content"][0]["text"] += text
        await self._event("response.output_text.delta", item_id=self.message["id"], **where,
                          content_index=0, delta=text, logprobs=[])

    async def _open_call(self, call_id: str, name: str) -> None:
        """A function_call item (`name` as the chat names it: its namespace apart), added
        with no arguments yet."""
        namespace, name = self.names.get(name, (None, name))
        self.call = {"id": new_id("fc"), "type": "function_call", "status": "in_progress",
                     "call_id": call_id, "name": name, "arguments": ""}
        if namespace:
            self.call["namespace"] = namespace
        await self._event("response.output_item.added", output_index=len(self.output),
                          item=dict(self.call))

    async def _call_delta(self, text: str) -> None:
        self.call["arguments"] += text
        await self._event("response.function_call_arguments.delta", item_id=self.call["id"],
                          output_index=len(self.output), delta=text)

    async def _close_call(self) -> None:
        item, self.call = self.call, None
        item["status"] = "completed"
        where = {"item_id": item["id"], "output_index": len(self.output)}
        await self._event("response.function_call_arguments.done", **where, name=item["name"],
                          arguments=item["arguments"])
        await self._event("response.output_item.done", output_index=len(self.output),
                          item=item)
        self.output.append(item)

    async def _close_message(self) -> None:
        if self.message is None:
            return
        item, self.message = self.message, None
        item["status"] = "completed"
        where = {"item_id": item["id"], "output_index": len(self.output), "content_index": 0}
        part = item["content"][0]
        await self._event("response.output_text.done", **where, text=part["text"], logprobs=[])
        await self._event("response.content_part.done", **where, part=part)
        await self._event("response.output_item.done", output_index=len(self.output), item=item)
        self.output.append(item)

    async def _finish(self, done: Done) -> int:
        """The response once the model is done: stored (unless `store` is false), then
        answered, or streamed as its last event."""
        reason = INCOMPLETE.get(done.finish_reason)
        status = "completed" if reason is None else "incomplete"
        response = self._response(status, usage=response_usage(done.usage),
                                  incomplete=reason and {"reason": reason})
        conversation = self._conversation()
        if self.body.get("store") is not False and conversation is not None:
            STORE.put(self.id, conversation + self.output)
        if not self.req.stream:
            return await self._json(200, response)
        await self._event(f"response.{status}", response=response)
        await self._end()
        return 200

    def _conversation(self) -> list[dict] | None:
        """The items this response answers: the earlier response's and the input (None if
        the earlier one is no longer kept)."""
        try:
            return earlier_items(self.body) + input_items(self.body)
        except ApiError:
            return None

    async def _fail(self, err: ApiError) -> int:
        """A failure: an error body before the stream starts, a `response.failed` event
        after."""
        self.group.cancel()
        if not self.started:
            retry = {"Retry-After": err.retry_after} if err.retry_after else None
            return await self._json(err.status, err.body(), retry)
        await self._event("response.failed", response=self._response(
            "failed", error={"code": str(err.code or err.type), "message": err.message}))
        await self._end()
        return err.status

    def _response(self, status: str, usage: dict | None = None, error: dict | None = None,
                  incomplete: dict | None = None) -> dict:
        """The response object: the request's settings echoed, the output so far."""
        body, req = self.body, self.req
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "error": error, "incomplete_details": incomplete,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"), "model": req.model,
            "output": [] if status == "in_progress" else list(self.output),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"),
            "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
            "store": body.get("store") is not False, "temperature": req.temperature,
            "text": body.get("text") or {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "top_p": req.top_p, "truncation": "disabled", "usage": usage,
            "user": body.get("user"), "metadata": body.get("metadata") or {}}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
