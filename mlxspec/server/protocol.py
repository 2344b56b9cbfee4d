"""What clients send and what they get back: request parsing and validation for the OpenAI and
llama.cpp endpoints, fill-in-the-middle prompt assembly, and the response bodies.

Nothing here touches MLX: handlers run it on their own threads before a request reaches the
worker, so bad input is answered without ever queueing behind generation.
"""

from __future__ import annotations

import copy
import math
import time
import uuid
from dataclasses import dataclass, field, fields
from typing import Any

from ..chat_session import render_chat
from ..fim import FimTokens, detect_fim  # noqa: F401  (FimTokens: re-exported)
from ..stats import Stats


class ApiError(Exception):
    """An error answered as JSON with an HTTP status, in OpenAI's error shape."""

    def __init__(self, status: int, message: str, *, type: str | None = None,
                 param: str | None = None, code: str | None = None,
                 extra: dict | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.retry_after = retry_after  # seconds, sent as a Retry-After header
        self.status = status
        self.message = message
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.param = param
        self.code = code
        self.extra = extra or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else self.status,
                          **self.extra}}


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


# ----------------------------------------------------------------------------- FIM prompts


SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"  # llama.cpp's chunk separator without file tokens


def build_fim_prompt(encode, fim: FimTokens, prefix: str, suffix: str, *,
                     extra: list[dict] | None = None, middle: str = "", bos: int | None = None,
                     budget: int | None = None) -> tuple[list[int], bool]:
    """Token ids of a FIM prompt, llama.cpp's `/infill` layout:

        [extra context] [bos] <PRE> prefix+middle <SUF> suffix <MID>

    where the extra context (llama.vim's `input_extra` chunks) is, with repo-level tokens,
    `<repo_name>myproject\\n (<file_sep>filename\\n text)* <file_sep>filename\\n`, and otherwise
    each chunk's text after a `--- snippet ---` separator. `middle` (llama.cpp's `prompt`: the
    current line up to the cursor) is tokenized together with the prefix, so the cursor adds no
    artificial token boundary. Over `budget` tokens, extra chunks go first (oldest first), then
    the prefix loses its start and the suffix its end, 3:1. Returns (ids, truncated).
    """
    pre = encode(prefix + middle)
    suf = encode(suffix)
    chunks: list[list[int]] = []
    head: list[int] = []
    if extra:
        if fim.repo_name is not None and fim.file_sep is not None:
            head = [fim.repo_name] + encode("myproject\n")
        for chunk in extra:
            if fim.file_sep is not None:
                ids = [fim.file_sep] + encode(str(chunk.get("filename") or "tmp") + "\n")
            else:
                ids = encode(SNIPPET_SEPARATOR)
            chunks.append(ids + encode(str(chunk.get("text") or "")))
    tail = [fim.file_sep] + encode("filename\n") if extra and fim.file_sep is not None else []
    fixed = 3 + (bos is not None)
    truncated = False
    if budget is not None:
        def total() -> int:
            return fixed + len(pre) + len(suf) + len(head) + len(tail) + sum(map(len, chunks))

        while chunks and total() > budget:
            chunks.pop(0)
            truncated = True
        if not chunks:
            head, tail = [], []
        over = total() - budget
        if over > 0:
            truncated = True
            room = max(0, budget - fixed)
            take_suf = min(len(suf), room // 4)
            take_pre = min(len(pre), room - take_suf)
            take_suf = min(len(suf), room - take_pre)
            pre = pre[len(pre) - take_pre :]
            suf = suf[:take_suf]
    ids = head + [t for c in chunks for t in c] + tail
    if bos is not None:
        ids.append(bos)
    p, s = [fim.prefix] + pre, [fim.suffix] + suf
    ids += (s + p) if fim.suffix_first else (p + s)
    ids.append(fim.middle)
    return ids, truncated


# ----------------------------------------------------------------------------- requests


@dataclass
class GenRequest:
    """One generation, as the worker runs it."""

    endpoint: str
    prompt: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    prediction: list[int] | None = None
    mode: str | None = None
    num_draft: int | None = None
    use_suffix: bool = True  # "speculative": {"suffix": false}: no proposals from, nor into, the store
    suffix_scope: str | None = None  # whose earlier text it may draw on (set by the handler)
    warmup: bool = False  # n_predict 0: prefill and cache the prompt, generate nothing
    t_max_predict_ms: float | None = None
    truncated: bool = False  # the prompt was shortened to fit the context
    context_limited: bool = False  # max_tokens was lowered to what the context leaves
    n_ctx: int | None = None
    n_indent: int = 0  # llama.cpp: stop at a new line indented less than this
    cache_reuse: int = 0  # llama.cpp's n_cache_reuse: reuse cached chunks shifted (not exact)
    n_cmpl: int = 1  # llama.cpp: completions of the same prompt
    response_fields: list[str] | None = None
    model: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])


def _number(body: dict, name: str, default, kind=float, lo=None, hi=None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(f"'{name}' must be a number, got {type(value).__name__}", name)
    if kind is int:
        if isinstance(value, float) and not value.is_integer():
            raise bad(f"'{name}' must be an integer, got {value}", name)
        value = int(value)
    else:
        value = float(value)
        if not math.isfinite(value):  # NaN passes every comparison below
            raise bad(f"'{name}' must be a finite number, got {value}", name)
    if lo is not None and value < lo:
        raise bad(f"'{name}' must be >= {lo}, got {value}", name)
    if hi is not None and value > hi:
        raise bad(f"'{name}' must be <= {hi}, got {value}", name)
    return value


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return [s for s in stop if s]
    raise bad("'stop' must be a string or a list of strings", "stop")


def _text_parts(content, where: str) -> str:
    """OpenAI content: a string or a list of {"type": "text", "text": ...} parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(
                    part.get("text"), str):
                out.append(part["text"])
            else:
                raise bad(f"{where}: only text parts are supported", where)
        return "".join(out)
    raise bad(f"{where} must be a string or a list of text parts", where)


@dataclass
class ServerConfig:
    """What request parsing needs to know about the model and the server's defaults."""

    model_name: str
    model_aliases: set[str]
    max_context: int | None
    default_max_tokens: int = 512
    default_temperature: float = 0.0
    modes: tuple[str, ...] = ()
    max_num_draft: int = 64
    accept_any_model: bool = False  # --accept-any-model: OpenAI requests may name any model
    max_n_cmpl: int = 16
    cache_reuse: int = 0  # --cache-reuse: a request's default n_cache_reuse
    default_seed: int | None = None  # --seed: the seed of a request that sends none


class RequestParser:
    """Turns request bodies into `GenRequest`s, tokenizing with the engine's tokenizer."""

    def __init__(self, tokenizer, config: ServerConfig, tokenize_lock=None):
        import threading

        self.tokenizer = tokenizer
        self.config = config
        self.lock = tokenize_lock or threading.Lock()
        vocab = tokenizer.get_vocab()
        self.fim = detect_fim(vocab)
        self.vocab_size = len(vocab)
        self.bos = self._bos_id()
        self._pieces: list[str] | None = None

    def _bos_id(self) -> int | None:
        bos = getattr(self.tokenizer, "bos_token_id", None)
        if bos is None:
            return None
        with self.lock:
            ids = self.tokenizer.encode("a", add_special_tokens=True)
        return bos if ids and ids[0] == bos else None

    # -- tokenizing
    def encode(self, text: str) -> list[int]:
        with self.lock:
            return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_prompt(self, text: str) -> list[int]:
        """A raw prompt as the engine encodes one (BOS added unless the text starts with it)."""
        bos = getattr(self.tokenizer, "bos_token", None)
        with self.lock:
            return list(self.tokenizer.encode(
                text, add_special_tokens=bos is None or not text.startswith(bos)))

    # -- shared fields
    def _common(self, body: dict, endpoint: str, prompt: list[int], *, max_tokens_keys,
                allow_warmup: bool, check_model: bool = True) -> GenRequest:
        """Fields every endpoint shares. `check_model`: OpenAI endpoints refuse model names
        not served here (404, unless --accept-any-model); llama.cpp's own endpoints ignore
        `model`, as llama.cpp does."""
        cfg = self.config
        model = body.get("model")
        if check_model and model is not None and not isinstance(model, str):
            raise bad("'model' must be a string", "model")
        if check_model and model and model not in cfg.model_aliases and not cfg.accept_any_model:
            raise ApiError(404, f"model '{model}' is not served here; this server serves "
                                f"'{cfg.model_name}' (see GET /v1/models; --model-alias "
                                f"{model} or --accept-any-model accept this name)",
                           param="model", code="model_not_found")
        max_tokens = None
        for key in max_tokens_keys:
            if body.get(key) is not None:
                max_tokens = _number(body, key, None, int)
                if key == "n_predict" and max_tokens < 0:  # llama.cpp: -1 = unlimited
                    max_tokens = None
                elif max_tokens < (0 if allow_warmup and key == "n_predict" else 1):
                    raise bad(f"'{key}' must be >= 1, got {max_tokens}", key)
                break
        warmup = max_tokens == 0
        ctx = cfg.max_context
        if not prompt:
            raise bad("the prompt is empty", "prompt")
        if ctx and len(prompt) >= ctx:
            raise ApiError(400, f"the prompt has {len(prompt)} tokens but the model's context "
                                f"is {ctx} tokens", param="prompt",
                           code="context_length_exceeded",
                           extra={"n_prompt_tokens": len(prompt), "n_ctx": ctx})
        # A max_tokens larger than what the context leaves is clamped to it, as llama.cpp
        # does (the answer then ends with finish_reason "length" / stop_type "limit").
        limited = False
        if max_tokens is None:
            max_tokens = cfg.default_max_tokens
        if ctx and not warmup and max_tokens > ctx - len(prompt):
            max_tokens, limited = ctx - len(prompt), True
        seed_key = "seed" if body.get("seed") is not None else "random_seed"  # Mistral's name
        seed = body.get(seed_key)
        if seed is not None:
            seed = _number(body, seed_key, None, int)
            if seed < 0:  # llama.cpp: -1 = random
                seed = None
        else:
            seed = cfg.default_seed
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise bad("'stream' must be a boolean", "stream")
        so = body.get("stream_options") or {}
        if not isinstance(so, dict):
            raise bad("'stream_options' must be an object", "stream_options")
        n = body.get("n")
        if check_model and n is not None and n != 1:
            raise bad("only n = 1 is supported", "n")
        n_cmpl = 1
        if not check_model:  # llama.cpp: n_cmpl, with OpenAI's n as a fallback
            key = "n_cmpl" if body.get("n_cmpl") is not None else "n"
            n_cmpl = _number(body, key, 1, int, 1, cfg.max_n_cmpl)
            if n_cmpl > 1 and stream:
                raise bad(f"'{key}' > 1 is not supported with streaming; ask without "
                          "\"stream\" to get the completions as one list", key)
        spec = body.get("speculative") or {}
        if not isinstance(spec, dict):
            raise bad("'speculative' must be an object like {\"mode\": \"ngram\", \"num_draft\": 4}",
                      "speculative")
        mode = spec.get("mode")
        if mode is not None and mode not in cfg.modes:
            raise bad(f"unknown speculative mode {mode!r}; choose one of: {', '.join(cfg.modes)}",
                      "speculative.mode")
        num_draft = None
        if spec.get("num_draft") is not None:
            num_draft = _number(spec, "num_draft", None, int, 1, cfg.max_num_draft)
        use_suffix = spec.get("suffix", True)
        if not isinstance(use_suffix, bool):
            raise bad("'speculative.suffix' must be true or false", "speculative.suffix")
        t_max = body.get("t_max_predict_ms")
        t_max = _number(body, "t_max_predict_ms", None, float) if t_max is not None else None
        fields = body.get("response_fields")
        if fields is not None and not (isinstance(fields, list) and all(
                isinstance(f, str) for f in fields)):
            raise bad("'response_fields' must be a list of strings", "response_fields")
        return GenRequest(
            endpoint=endpoint, prompt=prompt, max_tokens=max_tokens,
            temperature=_number(body, "temperature", cfg.default_temperature, float, 0.0, 100.0),
            top_p=_number(body, "top_p", 1.0, float, 0.0, 1.0) or 1.0,
            top_k=max(0, _number(body, "top_k", 0, int)),
            min_p=_number(body, "min_p", 0.0, float, 0.0, 0.999999),
            seed=seed, stop=_stops(body), stream=stream,
            include_usage=bool(so.get("include_usage", False)), mode=mode,
            num_draft=num_draft, use_suffix=use_suffix, warmup=warmup, t_max_predict_ms=t_max if t_max and t_max > 0 else None,
            response_fields=fields, model=cfg.model_name, context_limited=limited, n_ctx=ctx,
            n_indent=_number(body, "n_indent", 0, int, 0), n_cmpl=n_cmpl,
            cache_reuse=_number(body, "n_cache_reuse", cfg.cache_reuse, int, 0))

    # -- endpoints
    def completion(self, body: dict) -> GenRequest:
        prompt = body.get("prompt")
        if prompt is None:
            raise bad("'prompt' is required", "prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        suffix = body.get("suffix")
        if suffix is not None and not isinstance(suffix, str):
            raise bad("'suffix' must be a string", "suffix")
        if isinstance(prompt, str):
            if suffix:
                ids, truncated = self._fim(prompt, suffix, body)
            elif suffix is not None and self.fim is not None:
                ids, truncated = self._fim(prompt, "", body)
            else:
                ids, truncated = self.encode_prompt(prompt), False
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                              for t in prompt):
            if suffix:
                raise bad("'suffix' needs a text prompt, not token ids", "suffix")
            if any(t < 0 or t >= self.vocab_size for t in prompt):
                raise bad("the prompt has token ids outside the vocabulary", "prompt")
            ids, truncated = list(prompt), False
        else:
            raise bad("'prompt' must be a string, a list of token ids, or a list of one of "
                      "those", "prompt")
        req = self._common(body, "completions", ids,
                           max_tokens_keys=("max_tokens", "n_predict"), allow_warmup=True)
        req.truncated = truncated
        self._prediction(body, req)
        return req

    def fim_completion(self, body: dict) -> GenRequest:
        """`/v1/fim/completions` (Mistral / DeepSeek style, what Continue's generic OpenAI
        provider calls for FIM): `prompt` is the prefix, `suffix` the suffix; chat-shaped
        answers."""
        prompt, suffix = body.get("prompt"), body.get("suffix") or ""
        if not isinstance(prompt, str):
            raise bad("'prompt' (the text before the cursor) must be a string", "prompt")
        if not isinstance(suffix, str):
            raise bad("'suffix' must be a string", "suffix")
        ids, truncated = self._fim(prompt, suffix, body)
        req = self._common(body, "fim", ids, max_tokens_keys=("max_tokens", "n_predict"),
                           allow_warmup=True)
        req.truncated = truncated
        return req

    def chat(self, body: dict) -> GenRequest:
        ids = self.encode(self.render_chat(body))
        req = self._common(body, "chat", ids,
                           max_tokens_keys=("max_completion_tokens", "max_tokens", "n_predict"),
                           allow_warmup=True)
        self._prediction(body, req)
        return req

    def render_chat(self, body: dict) -> str:
        """The prompt text of a chat request (`messages`, `tools`), by the model's chat
        template; what `/apply-template` answers."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad("'messages' must be a non-empty list", "messages")
        conv = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise bad(f"messages[{i}] must be an object with a 'role'", f"messages[{i}]")
            role = "system" if m["role"] == "developer" else m["role"]
            if role not in ("system", "user", "assistant", "tool"):
                raise bad(f"messages[{i}]: unknown role {m['role']!r}", f"messages[{i}].role")
            msg = {"role": role, "content": _text_parts(m.get("content"), f"messages[{i}].content")}
            for key in ("name", "tool_calls", "tool_call_id"):
                if key in m:
                    msg[key] = m[key]
            conv.append(msg)
        tools = body["tools"] if isinstance(body.get("tools"), list) else None
        try:
            with self.lock:
                return render_chat(self.tokenizer, conv, tools=tools)
        except Exception as e:  # a template that rejects the conversation
            raise bad(f"the chat template cannot render these messages: {e}", "messages") from None

    # -- llama.cpp's utility endpoints (no generation)
    def tokenize(self, body: dict) -> dict:
        """`POST /tokenize`: {content, add_special=false, parse_special=true,
        with_pieces=false} -> {"tokens": [ids]} or [{"id", "piece"}] pieces."""
        content = body.get("content")
        if content is None:
            return {"tokens": []}
        if not isinstance(content, str):
            raise bad("'content' must be a string", "content")
        flags = {}
        for key, default in (("add_special", False), ("parse_special", True),
                             ("with_pieces", False)):
            flags[key] = body.get(key, default)
            if not isinstance(flags[key], bool):
                raise bad(f"'{key}' must be a boolean", key)
        with self.lock:
            if flags["parse_special"]:
                ids = self.tokenizer.encode(content, add_special_tokens=flags["add_special"])
            else:
                try:
                    ids = self.tokenizer.encode(content, add_special_tokens=flags["add_special"],
                                                split_special_tokens=True)
                except TypeError:
                    raise bad("this tokenizer cannot read special tokens as plain text "
                              "(parse_special: false)", "parse_special") from None
        ids = [int(t) for t in ids]
        if not flags["with_pieces"]:
            return {"tokens": ids}
        out = []
        for t in ids:
            piece = self.token_bytes(t)
            try:
                out.append({"id": t, "piece": piece.decode("utf-8")})
            except UnicodeDecodeError:
                out.append({"id": t, "piece": list(piece)})
        return {"tokens": out}

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for (a byte-level BPE piece may be part of a UTF-8
        character, and a piece may start with a space that decoding alone would drop)."""
        with self.lock:
            if self._pieces is None:
                detok = self.tokenizer.detokenizer
                byte_level = type(detok).__name__ == "BPEStreamingDetokenizer"
                self._pieces = list(detok.tokenmap) if byte_level else []
            if token < len(self._pieces):
                from mlx_lm.tokenizer_utils import _byte_decoder

                bd = _byte_decoder()
                return b"".join(bytes([bd[c]]) if c in bd else c.encode()
                                for c in self._pieces[token])
            return self.tokenizer.decode([token]).encode("utf-8")

    def detokenize(self, body: dict) -> dict:
        """`POST /detokenize`: {tokens: [ids]} -> {"content": text}."""
        tokens = body.get("tokens", [])
        if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise bad("'tokens' must be a list of token ids", "tokens")
        if any(t < 0 or t >= self.vocab_size for t in tokens):
            raise bad("'tokens' has ids outside the vocabulary", "tokens")
        with self.lock:
            return {"content": self.tokenizer.decode(tokens) if tokens else ""}

    def apply_template(self, body: dict) -> dict:
        """`POST /apply-template`: {messages, tools?} -> {"prompt": text}."""
        return {"prompt": self.render_chat(body)}

    def _prediction(self, body: dict, req: GenRequest) -> None:
        """OpenAI's predicted output (on completions too, as an extension)."""
        pred = body.get("prediction")
        if pred is not None:
            if not isinstance(pred, dict) or pred.get("type", "content") != "content":
                raise bad("'prediction' must be {\"type\": \"content\", \"content\": ...}",
                          "prediction")
            text = _text_parts(pred.get("content"), "prediction.content")
            req.prediction = self.encode(text) if text else None

    def infill(self, body: dict) -> GenRequest:
        for key in ("input_prefix", "input_suffix", "prompt"):
            if body.get(key) is not None and not isinstance(body[key], str):
                raise bad(f"'{key}' must be a string", key)
        extra = body.get("input_extra") or []
        if not isinstance(extra, list) or not all(isinstance(c, dict) for c in extra):
            raise bad("'input_extra' must be a list of {\"filename\", \"text\"} objects",
                      "input_extra")
        for i, c in enumerate(extra):
            if not isinstance(c.get("text", ""), str) or not isinstance(c.get("filename", ""), str):
                raise bad(f"input_extra[{i}]: 'filename' and 'text' must be strings",
                          f"input_extra[{i}]")
        if self.fim is None:
            # llama.cpp's answer for a model without FIM tokens, word for word: editors
            # (llama.vim, llama.vscode) match on it.
            raise ApiError(501, "Infill is not supported by this model: prefix token is "
                           "missing. suffix token is missing. middle token is missing. ",
                           type="not_supported_error")
        n_predict = body.get("n_predict", body.get("max_tokens"))
        n = n_predict if isinstance(n_predict, int) and n_predict > 0 else self.config.default_max_tokens
        ids, truncated = build_fim_prompt(
            self.encode, self.fim, body.get("input_prefix") or "", body.get("input_suffix") or "",
            extra=extra, middle=body.get("prompt") or "", bos=self.bos,
            budget=self._budget(n))
        req = self._common(body, "infill", ids, max_tokens_keys=("n_predict", "max_tokens"),
                           allow_warmup=True, check_model=False)
        req.truncated = truncated
        return req

    def llama_completion(self, body: dict) -> GenRequest:
        """llama.cpp's native `/completion`: `prompt` (text or ids), `n_predict`, `stream`."""
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            ids = self.encode_prompt(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                              for t in prompt):
            if any(t < 0 or t >= self.vocab_size for t in prompt):
                raise bad("the prompt has token ids outside the vocabulary", "prompt")
            ids = list(prompt)
        else:
            raise bad("'prompt' must be a string or a list of token ids", "prompt")
        return self._common(body, "completion", ids, max_tokens_keys=("n_predict", "max_tokens"),
                            allow_warmup=True, check_model=False)

    def _fim(self, prefix: str, suffix: str, body: dict) -> tuple[list[int], bool]:
        if self.fim is None:
            raise bad("'suffix' needs fill-in-the-middle, and this model's tokenizer has no FIM "
                      "tokens (<|fim_prefix|>, <fim_prefix> or <PRE>)", "suffix")
        n = body.get("max_tokens")
        n = n if isinstance(n, int) and n > 0 else self.config.default_max_tokens
        return build_fim_prompt(self.encode, self.fim, prefix, suffix, bos=self.bos,
                                budget=self._budget(n))

    def _budget(self, max_tokens: int) -> int | None:
        ctx = self.config.max_context
        if not ctx:
            return None
        return max(16, ctx - min(max_tokens, ctx // 2) - 1)


class IndentStop:
    """llama.cpp's `n_indent`: once the completion has started a new line, a line whose
    first character other than a space or tab (a newline included: an empty line) sits at an
    indentation below `n_indent` ends it, cut just before that character. The first line of
    the completion is never checked. Fed the answer's text in order; returns what may be
    emitted and whether the completion ends here."""

    def __init__(self, n_indent: int):
        self.n_indent = n_indent
        self.seen_newline = False
        self.at_line_start = False  # inside the indentation of a line after a newline
        self.indent = 0
        self.stopped = False

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        for i, ch in enumerate(text):
            if self.at_line_start:
                if ch in " \t":
                    self.indent += 1
                    continue
                self.at_line_start = False
                if self.indent < self.n_indent:
                    self.stopped = True
                    return text[:i], True
            if ch == "\n":
                self.seen_newline = True
                self.at_line_start, self.indent = True, 0
        return text, False


# ----------------------------------------------------------------------------- responses


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


def completion_body(req: GenRequest, text: str, finish: str | None, usage: Usage | None) -> dict:
    body = {"id": f"cmpl-{req.id}", "object": "text_completion", "created": req.created,
            "model": req.model,
            "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]}
    if usage is not None:
        body["usage"] = usage.openai()
    return body


def chat_body(req: GenRequest, text: str, finish: str | None, usage: Usage | None) -> dict:
    body = {"id": f"chatcmpl-{req.id}", "object": "chat.completion", "created": req.created,
            "model": req.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish}]}
    if usage is not None:
        body["usage"] = usage.openai()
    return body


def chat_chunk(req: GenRequest, delta: dict | None, finish: str | None,
               usage: Usage | None = None) -> dict:
    body = {"id": f"chatcmpl-{req.id}", "object": "chat.completion.chunk",
            "created": req.created, "model": req.model,
            "choices": [] if delta is None else [
                {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
    if usage is not None:
        body["usage"] = usage.openai()
    return body


def completion_chunk(req: GenRequest, text: str | None, finish: str | None,
                     usage: Usage | None = None) -> dict:
    body = {"id": f"cmpl-{req.id}", "object": "text_completion", "created": req.created,
            "model": req.model,
            "choices": [] if text is None else [
                {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]}
    if usage is not None:
        body["usage"] = usage.openai()
    return body


def llama_body(req: GenRequest, text: str, finish: str | None, usage: Usage | None,
               stopping_word: str = "", index: int = 0) -> dict:
    """llama.cpp's `/completion` and `/infill` response (final when `usage` is given)."""
    body: dict[str, Any] = {"index": index, "content": text, "tokens": [], "id_slot": 0,
                            "stop": usage is not None, "model": req.model}
    if usage is not None:
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
            "has_new_line": "\n" in text,
            "stop_type": stop_type,
            "stopping_word": stopping_word,
            "generation_settings": {
                "n_ctx": req.n_ctx or 0,
                "n_predict": 0 if req.warmup else req.max_tokens,
                "temperature": req.temperature, "top_k": req.top_k, "top_p": req.top_p,
                "min_p": req.min_p, "seed": req.seed, "stop": req.stop,
                "n_indent": req.n_indent, "n_cmpl": req.n_cmpl,
                "speculative.mode": usage.mode},
            "timings": usage.timings(),
        })
    if req.response_fields is not None and usage is not None:
        body = pick_fields(body, req.response_fields)
    return body


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
