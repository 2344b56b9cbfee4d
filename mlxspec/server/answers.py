"""What clients get back: JSON answers and errors, a request's usage, and the OpenAI and
llama.cpp answer bodies and stream chunks (completions, chat, `/completion`, `/infill`)."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, fields
from typing import Any

from starlette.responses import Response

from ..stats import Stats
from .protocol import LOWEST, SYSTEM_FINGERPRINT, ApiError, GenRequest


def dumps(body) -> str:
    """JSON as llama.cpp writes it: compact (llama.vim checks replies against
    `"content"\\s*:"`, no space after the colon) and UTF-8."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"))


def error_message(status: int, body: dict, headers: dict | None = None, close: bool = False):
    """The ASGI messages of a JSON answer (an error, or a refusal before any route runs)."""
    data = dumps(body).encode()
    raw = [(b"content-type", b"application/json; charset=utf-8"),
           (b"content-length", str(len(data)).encode())]
    raw += [(k.encode(), str(v).encode()) for k, v in (headers or {}).items()]
    if close:
        raw.append((b"connection", b"close"))
    return ({"type": "http.response.start", "status": status, "headers": raw},
            {"type": "http.response.body", "body": data})


def json_response(body, status: int = 200, headers: dict | None = None) -> Response:
    return Response(dumps(body), status, headers, media_type="application/json; charset=utf-8")


def api_error(err: ApiError, close: bool = False, body: dict | None = None) -> Response:
    """An error as JSON: OpenAI's shape, or `body` (another family's); 503s keep their
    Retry-After; after one that leaves the body unread (408, 411, 413) the connection is
    closed."""
    headers = {"Retry-After": str(err.retry_after)} if err.retry_after is not None else {}
    if close or err.status in (408, 411, 413):
        headers["Connection"] = "close"
    return json_response(err.body() if body is None else body, err.status, headers)


@dataclass
class Usage(Stats):
    """A request's statistics as the server reports them: the generation's `Stats` and how
    the worker served it."""

    batched: bool = False  # served by the batch of plain decoding (mlx-lm's BatchGenerator)
    batched_speculative: bool = False  # verified in the batched speculative step
    context_tokens: int = 0  # tokens in the request's KV cache at the end (llama.cpp's tokens_cached)

    @classmethod
    def from_stats(cls, s: Stats) -> Usage:
        return cls(**{f.name: copy.copy(getattr(s, f.name)) for f in fields(Stats)})

    @property
    def completion_tokens(self) -> int:
        return self.generated_tokens

    @completion_tokens.setter
    def completion_tokens(self, n: int) -> None:
        self.generated_tokens = n

    def openai(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "completion_tokens_details": {
                "reasoning_tokens": 0,
                "accepted_prediction_tokens": self.prediction_counts[0],
                "rejected_prediction_tokens": self.prediction_counts[1],
            },
            "speculative": self.speculative(),
        }

    def speculative(self) -> dict:
        return {
            "mode": self.mode,
            "sampling_rule": self.sampling_rule,
            "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "target_forwards": self.target_forwards,
            "batched": self.batched,
            "batched_speculative": self.batched_speculative,
        }

    def timings(self) -> dict:
        """llama.cpp's `timings` object."""
        prompt_n = self.prompt_tokens - self.cached_tokens
        pms, gms = 1000 * self.prefill_seconds, 1000 * self.decode_seconds
        n = self.completion_tokens
        return {
            "cache_n": self.cached_tokens,
            "prompt_n": prompt_n,
            "prompt_ms": pms,
            "prompt_per_token_ms": pms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": 1000 * prompt_n / pms if pms > 0 else 0.0,
            "predicted_n": n,
            "predicted_ms": gms,
            "predicted_per_token_ms": gms / n if n else 0.0,
            "predicted_per_second": 1000 * n / gms if gms > 0 else 0.0,
            "draft_n": self.drafted,
            "draft_n_accepted": self.accepted,
        }


def total_usage(usages: list[Usage], prompt_tokens: int | None = None) -> Usage:
    """Several answers' usage as one (OpenAI's `usage` of an answer with several choices):
    counts summed; `prompt_tokens` once per prompt when given."""
    out = copy.deepcopy(usages[0])
    for u in usages[1:]:
        out.add(u)
        out.batched = out.batched or u.batched
        out.batched_speculative = out.batched_speculative or u.batched_speculative
    if prompt_tokens is not None:
        out.prompt_tokens = prompt_tokens
    return out


# (index, text, finish_reason[, logprobs object[, tool calls]])
Choice = tuple


def _lp(v: float) -> float:
    return v if v > LOWEST else LOWEST  # JSON has no -inf: llama.cpp's lowest float


def token_entries(entries: list, token_bytes, post: bool = False) -> list[dict]:
    """Per token {id, token, bytes, logprob, top_logprobs: [{id, token, bytes, logprob}]}:
    OpenAI's chat `logprobs.content` and llama.cpp's `completion_probabilities` (with
    `post`, llama.cpp's post_sampling_probs: prob and top_probs)."""
    key, top_key = ("prob", "top_probs") if post else ("logprob", "top_logprobs")
    out = []
    for e in entries:
        if e is None:
            continue
        b = token_bytes(e.token)
        out.append({"id": e.token, "token": b.decode("utf-8", errors="ignore"),
                    "bytes": list(b), key: e.logprob if post else _lp(e.logprob),
                    top_key: [{"id": t, "token": token_bytes(t).decode("utf-8", errors="ignore"),
                               "bytes": list(token_bytes(t)), key: v if post else _lp(v)}
                              for t, v in e.top]})
    return out


def chat_logprobs(entries: list, token_bytes) -> dict:
    """OpenAI's chat `choices[].logprobs`."""
    return {"content": token_entries(entries, token_bytes), "refusal": None}


def completion_logprobs(entries: list, token_bytes, offset: int = 0) -> dict:
    """OpenAI's legacy `/v1/completions` `choices[].logprobs`: tokens, token_logprobs,
    top_logprobs (the top alternatives and the chosen token), text_offset (characters from
    the start of the answer, or `offset`)."""
    tokens, values, tops, offsets = [], [], [], []
    for e in entries:
        if e is None:
            continue
        text = token_bytes(e.token).decode("utf-8", errors="ignore")
        tokens.append(text)
        values.append(_lp(e.logprob))
        top = {token_bytes(t).decode("utf-8", errors="ignore"): _lp(v) for t, v in e.top}
        top.setdefault(text, _lp(e.logprob))
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}


def _oai(req: GenRequest, prefix: str, obj: str) -> dict:
    return {"id": f"{prefix}-{req.id}", "object": obj, "created": req.created,
            "model": req.model, "system_fingerprint": SYSTEM_FINGERPRINT}


def completion_body(req: GenRequest, choices: list[Choice], usage: Usage | None) -> dict:
    """`/v1/completions`' answer: one choice per prompt and `n`, llama-server's `timings`."""
    body = {**_oai(req, "cmpl", "text_completion"),
            "choices": [{"text": c[1], "index": c[0], "logprobs": c[3] if len(c) > 3 else None,
                         "finish_reason": c[2]} for c in choices]}
    if usage is not None:
        body["usage"] = usage.openai()
        body["timings"] = usage.timings()
    return body


def chat_message(text: str, calls: list[dict]) -> dict:
    """An answer's message: its text, and its tool calls when it made any (then a message
    without text has `content` null, as OpenAI's)."""
    if not calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": text or None, "tool_calls": calls}


def chat_body(req: GenRequest, choices: list[Choice], usage: Usage | None) -> dict:
    """`/v1/chat/completions`' answer (and `/v1/fim/completions`')."""
    body = {**_oai(req, "chatcmpl", "chat.completion"),
            "choices": [{"index": c[0], "message": chat_message(c[1], c[4] if len(c) > 4 else []),
                         "logprobs": c[3] if len(c) > 3 else None, "finish_reason": c[2]}
                        for c in choices]}
    if usage is not None:
        body["usage"] = usage.openai()
        body["timings"] = usage.timings()
    return body


def chat_chunk(req: GenRequest, delta: dict | None, finish: str | None,
               usage: Usage | None = None, index: int = 0, timings: dict | None = None,
               logprobs: dict | None = None) -> dict:
    """A chat stream's chunk: a delta of choice `index`, or (delta None) no choice, with the
    usage of the whole answer when given; `logprobs`: its tokens' (`chat_logprobs`)."""
    choice = None if delta is None else {"index": index, "delta": delta}
    return _chunk(_oai(req, "chatcmpl", "chat.completion.chunk"), choice, finish, usage,
                  timings, logprobs)


def completion_chunk(req: GenRequest, text: str | None, finish: str | None,
                     usage: Usage | None = None, index: int = 0,
                     timings: dict | None = None, logprobs: dict | None = None) -> dict:
    choice = None if text is None else {"text": text, "index": index}
    return _chunk(_oai(req, "cmpl", "text_completion"), choice, finish, usage, timings,
                  logprobs)


def _chunk(head: dict, choice: dict | None, finish: str | None, usage: Usage | None,
           timings: dict | None, logprobs: dict | None) -> dict:
    """A stream chunk: its one choice (or none), the usage and timings when given."""
    body = {**head, "choices": [] if choice is None else [
        {**choice, "logprobs": logprobs, "finish_reason": finish}]}
    if usage is not None:
        body["usage"] = usage.openai()
    if timings is not None:
        body["timings"] = timings
    return body


def llama_body(req: GenRequest, text: str, finish: str | None, usage: Usage | None,
               stopping_word: str = "", index: int = 0, *, tokens: list[int] | None = None,
               prompt: str | None = None, timings: dict | None = None,
               progress: dict | None = None, id_slot: int = 0,
               whole: str | None = None, probs: list | None = None) -> dict:
    """llama.cpp's `/completion` and `/infill` response (final when `usage` is given).
    `tokens`: the token ids (a streamed chunk's, or the answer's with `return_tokens`);
    `prompt`: the prompt's text (final answers); `timings`: a streamed chunk's
    (`timings_per_token`); `progress`: a `prompt_progress` chunk's; `whole`: the answer's
    whole text where `text` is not (a stream's last chunk); `probs`: `n_probs`'
    `completion_probabilities` (`token_entries`) of a chunk's or a whole answer's tokens."""
    body: dict[str, Any] = {"index": index, "content": text, "tokens": tokens or [],
                            "id_slot": id_slot, "stop": usage is not None, "model": req.model}
    if probs is not None:
        body["completion_probabilities"] = probs
    if usage is None:
        if timings is not None:
            body["timings"] = timings
        if progress is not None:
            body["prompt_progress"] = progress
        return body
    # A generation ended by --request-timeout or by shutdown is cut short, as a limit.
    stop_type = {"stop": "word" if stopping_word else "eos", "length": "limit",
                 "timeout": "limit", "shutdown": "limit"}.get(finish or "", "none")
    # llama.cpp's `truncated`: the prompt was shortened, or generation ran into the end
    # of the context.
    out_of_context = (finish == "length" and req.context_limited
                      and usage.completion_tokens >= req.max_tokens)
    body.update({
        "tokens_predicted": usage.completion_tokens,
        "tokens_evaluated": usage.prompt_tokens,
        # llama.cpp: the tokens in the slot's context once the request is done
        "tokens_cached": usage.context_tokens,
        "truncated": req.truncated or out_of_context,
        "has_new_line": "\n" in (text if whole is None else whole),
        "stop_type": stop_type,
        "stopping_word": stopping_word,
        "generation_settings": {
            "n_ctx": req.n_ctx or 0,
            "n_predict": 0 if req.warmup else req.max_tokens,
            "temperature": req.temperature, "top_k": req.top_k, "top_p": req.top_p,
            "min_p": req.min_p, "seed": req.seed, "stop": req.stop,
            "n_indent": req.n_indent, "n_cmpl": req.n_cmpl, "n_probs": req.logprobs or 0,
            "post_sampling_probs": req.post_probs,
            "logit_bias": [{"bias": _lp(b), "token": t} for t, b in req.logit_bias],
            "grammar": req.grammar[1] if req.grammar and req.grammar[0] == "gbnf" else "",
            "speculative.mode": usage.mode},
        "timings": usage.timings(),
    })
    if prompt is not None:
        body["prompt"] = prompt
    if req.response_fields is not None:
        body = pick_fields(body, req.response_fields)
    return body


def wants_prompt(req: GenRequest) -> bool:
    """Whether a final llama.cpp answer shows the prompt's text (decoding it costs time)."""
    return req.response_fields is None or "prompt" in req.response_fields


def pick_fields(body: dict, fields: list[str]) -> dict:
    """llama.cpp's `response_fields`: keep these (nested `a/b` paths become flat keys)."""
    out = {}
    for f in fields:
        node: Any = body
        for part in f.split("/"):
            if isinstance(node, dict) and part in node:
                node = node[part]
            else:
                node = None
                break
        if node is not None and f:
            out[f] = node
    return out
