"""The Anthropic Messages API: `POST /v1/messages` served as a chat completion (`chat_body`),
answered as a Message or its stream of events (`Answer`), errors in Anthropic's shape
(`error_response`); and `POST /v1/messages/count_tokens` (`count_tokens`).

The conversion is deterministic, so a conversation's prompt grows as a prefix turn by turn and
the prompt cache serves each turn from the last:
- `system` (a string or text blocks) and the `role: "system"` messages Claude Code puts inside
  `messages` are folded, in order, into one leading system message: every chat template takes
  that (many refuse a system message after the first), at the price of one cache miss in the
  turn where a new mid-conversation system message appears.
- Claude Code's first system block, `x-anthropic-billing-header: cc_version=...;`, is dropped:
  its text changes from session to session and would end the shared prefix at the first line.
- A message's text blocks are joined by blank lines; `tool_use` blocks become the assistant's
  `tool_calls`, `tool_result` blocks `role: "tool"` messages (before the user's text of that
  turn); `thinking` blocks are dropped. `image` and `document` blocks are refused.
- `cache_control`, `metadata`, `thinking`, `context_management` and `output_config.effort`
  are accepted and mean nothing here; `output_config.format` (a JSON Schema) constrains the
  answer as `response_format` does.
"""

from __future__ import annotations

import asyncio
import json
import uuid

from starlette.responses import Response

from .answers import api_error
from .protocol import ApiError, ChatRequest, bad, parse
from .relay import Answer as BaseAnswer
from .tools import CallArgs, CallOpen, ToolCallSplitter
from .worker import Delta, Done, Failed

BILLING_HEADER = "x-anthropic-billing-header:"
# Blocks a text model cannot read, refused with a clear 400.
UNREADABLE = ("image", "document")
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 408: "timeout_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
               529: "overloaded_error"}
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
PING_SECONDS = 10.0  # a stream's keep-alive while the prompt is prefilled


# ----------------------------------------------------------------------------- the request


def chat_body(body: dict) -> dict:
    """A Messages request as the chat completions body it is served as."""
    if body.get("max_tokens") is None:  # Anthropic's words
        raise bad("max_tokens: Field required", "max_tokens")
    out = _chat(body)
    # Any `model` is served by the one model (Anthropic clients name Claude models, also in
    # side requests such as Claude Code's titles); `speculative`: mlxspec's own, as on chat.
    for key in ("max_tokens", "temperature", "top_p", "top_k", "stream", "speculative"):
        if key in body:
            out[key] = body[key]
    stops = body.get("stop_sequences")
    if stops is not None:
        if not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
            raise bad("stop_sequences: must be a list of strings", "stop_sequences")
        out["stop"] = stops
    fmt = _output_config(body).get("format")
    if fmt is not None:
        if not (isinstance(fmt, dict) and fmt.get("type") == "json_schema"
                and isinstance(fmt.get("schema"), dict)):
            raise bad('output_config.format: must be {"type": "json_schema", "schema": {...}}',
                      "output_config.format")
        out["response_format"] = {"type": "json_schema", "json_schema": {"schema": fmt["schema"]}}
    return out


def count_tokens(parser, body: dict) -> dict:
    """`/v1/messages/count_tokens`: the tokens of the prompt the request would have."""
    prompt, _ = parser.chat_prompts(parse(ChatRequest, _chat(body)))[0]
    return {"input_tokens": len(prompt)}


def _chat(body: dict) -> dict:
    """The prompt's part of the chat body: messages (the system prompt first), tools and
    tool_choice."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise bad("messages: Field required (a list of messages)", "messages")
    system = _texts(body["system"], "system") if body.get("system") is not None else []
    turns: list[dict] = []
    calls: set[str] = set()  # the ids of the tool_use blocks so far
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where}: must be an object with 'role' and 'content'", where)
        role, content = m.get("role"), m.get("content")
        if role == "system":
            system += _texts(content, f"{where}.content")
        elif role == "user":
            turns += _user_turn(content, f"{where}.content", calls)
        elif role == "assistant":
            turns += _assistant_turn(content, f"{where}.content", calls)
        else:
            raise bad(f"{where}.role: must be 'user' or 'assistant', got {role!r}",
                      f"{where}.role")
    lead = [{"role": "system", "content": "\n\n".join(system)}] if system else []
    out: dict = {"messages": lead + turns}
    if body.get("tools") is not None:
        out["tools"] = _tools(body["tools"])
    choice = body.get("tool_choice")
    if choice is not None:
        out["tool_choice"], parallel = _tool_choice(choice)
        if parallel is not None:
            out["parallel_tool_calls"] = parallel
    return out


def _blocks(content, where: str) -> list[dict]:
    """A message's content as blocks (a string is one text block); images refused."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad(f"{where}: must be a string or a list of content blocks", where)
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if not isinstance(kind, str):
            raise bad(f"{where}[{j}]: must be a content block with a 'type'", f"{where}[{j}]")
        if kind in UNREADABLE:
            raise bad(f"{where}[{j}]: {kind} blocks are not supported: this server's model "
                      "reads text only", f"{where}[{j}].type")
        if kind == "text" and not isinstance(block.get("text"), str):
            raise bad(f"{where}[{j}].text: must be a string", f"{where}[{j}].text")
    return content


def _typed(content, where: str, known: tuple[str, ...]):
    """(where, block) of each block of a message's content, of a type such a message holds."""
    for j, block in enumerate(_blocks(content, where)):
        at = f"{where}[{j}]"
        if block["type"] not in known:
            raise bad(f"{at}.type: unknown content block type {block['type']!r} here (this "
                      f"message may hold {', '.join(known)})", f"{at}.type")
        yield at, block


def _texts(content, where: str) -> list[str]:
    """The texts of text-only content (a system prompt, a tool's result), without Claude
    Code's billing block."""
    return [block["text"] for _, block in _typed(content, where, ("text",))
            if not block["text"].startswith(BILLING_HEADER)]


def _user_turn(content, where: str, calls: set[str]) -> list[dict]:
    """A user message: a tool message per `tool_result` block, then the user's text."""
    results, texts = [], []
    for at, block in _typed(content, where, ("text", "tool_result")):
        if block["type"] == "text":
            texts.append(block["text"])
            continue
        call_id = block.get("tool_use_id")
        if call_id not in calls:
            raise bad(f"{at}.tool_use_id: no earlier assistant message has a tool_use block "
                      f"with the id {call_id!r}", f"{at}.tool_use_id")
        result = block.get("content")
        results.append({"role": "tool", "tool_call_id": call_id, "content": "\n\n".join(
            _texts(result, f"{at}.content")) if result is not None else ""})
    return results + ([{"role": "user", "content": "\n\n".join(texts)}] if texts else [])


def _assistant_turn(content, where: str, calls: set[str]) -> list[dict]:
    """An assistant message: its text and its `tool_use` blocks as tool calls (thinking
    blocks dropped)."""
    texts, tool_calls = [], []
    for at, block in _typed(content, where,
                            ("text", "tool_use", "thinking", "redacted_thinking")):
        if block["type"] == "text":
            texts.append(block["text"])
        elif block["type"] == "tool_use":
            call_id, name, args = block.get("id"), block.get("name"), block.get("input")
            if not (isinstance(call_id, str) and isinstance(name, str)
                    and isinstance(args, dict)):
                raise bad(f"{at}: a tool_use block needs a string 'id' and 'name' and an "
                          "object 'input'", at)
            calls.add(call_id)
            tool_calls.append({"id": call_id, "type": "function",
                               "function": {"name": name, "arguments": args}})
    if not (texts or tool_calls):
        return []  # thinking only
    message: dict = {"role": "assistant", "content": "\n\n".join(texts)}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return [message]


def _tools(tools) -> list[dict]:
    """`tools` ({name, description, input_schema}) in the chat shape; Anthropic's server
    tools (web search, code execution: a `type` other than "custom") are refused."""
    if not isinstance(tools, list):
        raise bad("tools: must be a list of tools", "tools")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad(f"{where}: must be an object", where)
        kind = tool.get("type", "custom")
        if kind != "custom":
            raise bad(f"{where}.type: {kind!r} is a server tool, which Anthropic runs; this "
                      "server runs none (a tool here has a name and an input_schema)",
                      f"{where}.type")
        name, schema = tool.get("name"), tool.get("input_schema")
        if not (isinstance(name, str) and name):
            raise bad(f"{where}.name: Field required (a string)", f"{where}.name")
        if not (isinstance(schema, dict) and schema.get("type") == "object"
                and isinstance(schema.get("properties", {}), dict)
                and isinstance(schema.get("required", []), list)):
            raise bad(f"{where}.input_schema: must be a JSON Schema of type 'object' (its "
                      "'properties' an object, its 'required' a list)", f"{where}.input_schema")
        function = {"name": name, "parameters": schema}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice) -> tuple:
    """(chat tool_choice, parallel_tool_calls or None) of Anthropic's `tool_choice`. A forced
    call is one call unless `disable_parallel_tool_use` is false (the chat endpoint's
    default: a small model asked for calls keeps calling)."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in (*TOOL_CHOICES, "tool"):
        raise bad('tool_choice: must be {"type": "auto"}, {"type": "any"}, {"type": "none"} '
                  'or {"type": "tool", "name": ...}', "tool_choice")
    disable = choice.get("disable_parallel_tool_use")
    parallel = None if disable is None else not disable
    if kind != "tool":
        return TOOL_CHOICES[kind], parallel
    if not isinstance(choice.get("name"), str):
        raise bad('tool_choice.name: Field required for {"type": "tool"}', "tool_choice.name")
    return {"type": "function", "function": {"name": choice["name"]}}, parallel


def _output_config(body: dict) -> dict:
    config = body.get("output_config")
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise bad("output_config: must be an object", "output_config")
    return config


# ----------------------------------------------------------------------------- errors


def error_body(err: ApiError) -> dict:
    """`{"type": "error", "error": {"type", "message"}}`; a prompt over the context in
    Anthropic's words (Claude Code compacts its conversation when it reads them)."""
    message = err.message
    if err.type == "exceed_context_size_error":
        message = (f"prompt is too long: {err.extra['n_prompt_tokens']} tokens > "
                   f"{err.extra['n_ctx']} maximum")
    kind = ERROR_TYPES.get(err.status, "invalid_request_error" if err.status < 500
                           else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(err: ApiError) -> Response:
    """An error in Anthropic's shape (an overloaded worker's with its Retry-After); the
    connection closed after one that leaves the body unread."""
    return api_error(err, body=error_body(err))


# ----------------------------------------------------------------------------- the answer


def usage_json(usage) -> dict:
    """Anthropic's `usage` (input tokens: those prefilled, beside those read from the prompt
    cache), with mlxspec's speculation figures."""
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens,
            "output_tokens": usage.completion_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": usage.cached_tokens,
            "speculative": usage.speculative()}


def tool_input(arguments) -> dict:
    """A call's arguments (a JSON string, or parsed) as a `tool_use` block's `input` ({} where
    they are no JSON object: a call cut short)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = None
    return arguments if isinstance(arguments, dict) else {}


class Answer(BaseAnswer):
    """A Message (`content`: text and `tool_use` blocks), or its events: `message_start`,
    `ping`, each block's `content_block_start` / `_delta`s / `_stop`, `message_delta` (the
    stop reason and usage), `message_stop`."""

    def __init__(self, group, body: dict, parser, metrics, write_timeout: float):
        super().__init__(group, metrics, write_timeout)
        req = group.req
        self.splitter = (ToolCallSplitter(parser.tool_syntax, req.tools, req.tool_parallel)
                         if req.tools else None)
        self.blocks: list[dict] = []
        self.text_open = False  # the last block is text, its content_block_stop not sent
        self.streaming = False  # the stream has started (an error is then an event)

    def message(self, content: list[dict], stop_reason: str | None,
                stop_sequence: str | None, usage: dict) -> dict:
        req = self.group.req
        return {"id": f"msg_{req.id}", "type": "message", "role": "assistant",
                "model": req.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}

    async def relay(self) -> int:
        req = self.group.req
        if req.stream:  # at once: a long prompt's prefill is no silence a client times out on
            self.streaming = True
            await self._start_sse()
            await self._event("message_start", message=self.message([], None, None, {
                "input_tokens": len(req.prompt), "output_tokens": 0}))
            await self._event("ping")
        while True:
            try:
                _, ev = await asyncio.wait_for(self.next_event(), PING_SECONDS)
            except asyncio.TimeoutError:
                await self._event("ping")
                continue
            if isinstance(ev, Failed):
                return await self._failed(ev.error)
            if isinstance(ev, Delta):
                await self._add(self.splitter.feed(ev.text) if self.splitter else [ev.text])
            elif isinstance(ev, Done):
                await self._add(self.splitter.flush() if self.splitter else [])
                return await self._finish(ev)

    async def _failed(self, err: ApiError) -> int:
        self.group.cancel()
        if not self.streaming:
            retry = {"Retry-After": err.retry_after} if err.retry_after else None
            return await self._json(err.status, error_body(err), retry)
        await self._event("error", error=error_body(err)["error"])
        await self._end()
        return err.status

    async def _event(self, kind: str, **fields) -> None:
        if self.streaming:
            await self._sse({"type": kind, **fields}, event=kind)

    async def _add(self, parts: list) -> None:
        """The answer's next parts, in order: text (appended to an open text block, or
        opening one) and calls, each a tool_use block: opened with its name, its input's
        JSON in `input_json_delta` pieces as the model writes it (a call the splitter does
        not stream: in one piece), `input` the object they spell ({} if they spell none)."""
        for part in parts:
            if isinstance(part, str):
                if not part:
                    continue
                if not self.text_open:
                    await self._open({"type": "text", "text": ""})
                    self.text_open = True
                self.blocks[-1]["text"] += part
                await self._event("content_block_delta", index=len(self.blocks) - 1,
                                  delta={"type": "text_delta", "text": part})
            elif isinstance(part, CallOpen):
                await self._open_tool(part.name)
            elif isinstance(part, CallArgs):
                await self._tool_delta(part.text)
            else:
                fn = part.call["function"]
                if not part.streamed:
                    await self._open_tool(fn["name"])
                    await self._tool_delta(fn["arguments"])
                self.blocks[-1]["input"] = tool_input(fn["arguments"])
                await self._event("content_block_stop", index=len(self.blocks) - 1)

    async def _open_tool(self, name: str) -> None:
        await self._close_text()
        await self._open({"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}",
                          "name": name, "input": {}})

    async def _tool_delta(self, text: str) -> None:
        if text:
            await self._event("content_block_delta", index=len(self.blocks) - 1,
                              delta={"type": "input_json_delta", "partial_json": text})

    async def _open(self, block: dict) -> None:
        self.blocks.append(block)
        await self._event("content_block_start", index=len(self.blocks) - 1,
                          content_block=dict(block))

    async def _close_text(self) -> None:
        if self.text_open:
            self.text_open = False
            await self._event("content_block_stop", index=len(self.blocks) - 1)

    async def _finish(self, done: Done) -> int:
        if not self.blocks:  # an empty answer is one empty text block
            await self._open({"type": "text", "text": ""})
            self.text_open = True
        await self._close_text()
        usage = usage_json(done.usage)
        stop_reason = self._stop_reason(done)
        stop_sequence = done.stopping_word if stop_reason == "stop_sequence" else None
        if not self.streaming:
            return await self._json(200, self.message(self.blocks, stop_reason, stop_sequence,
                                                         usage))
        await self._event("message_delta", delta={"stop_reason": stop_reason,
                                                  "stop_sequence": stop_sequence}, usage=usage)
        await self._event("message_stop")
        await self._end()
        return 200

    def _stop_reason(self, done: Done) -> str:
        req = self.group.req
        if done.finish_reason == "stop":
            if any(b["type"] == "tool_use" for b in self.blocks):
                return "tool_use"
            return "stop_sequence" if done.stopping_word else "end_turn"
        if (done.finish_reason == "length" and req.context_limited
                and done.usage.completion_tokens >= req.max_tokens):
            return "model_context_window_exceeded"
        return "max_tokens"  # a limit: max_tokens, --request-timeout, shutdown
