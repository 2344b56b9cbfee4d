"""What clients send and what they get back: request parsing and validation for the OpenAI and
llama.cpp endpoints, fill-in-the-middle prompt assembly, and the response bodies.

Nothing here touches MLX: handlers run it on their own threads before a request reaches the
worker, so bad input is answered without ever queueing behind generation.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
import uuid
from dataclasses import dataclass, field, fields
from typing import Any

from .. import __version__
from ..chat_session import check_chat_template, render_chat
from ..fim import FimTokens, detect_fim  # noqa: F401  (FimTokens: re-exported)
from ..stats import Stats

# llama-server's `system_fingerprint` is "b<build>-<commit>"; clients check the "b".
SYSTEM_FINGERPRINT = f"b{__version__}-mlxspec"
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit (and completions' logprobs here)
MAX_N_PROBS = 100  # llama.cpp's n_probs
LOWEST = -3.4028234663852886e38  # llama.cpp's log(0): the lowest float (JSON has no -inf)


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


def _is_true(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"'{name}' must be true or false", name)
    return value


def check_fields(body: dict, endpoint: str) -> None:
    """The shapes of the fields that need no tokenizer, as llama-server checks them (an
    unknown `response_format` type, a schema that is not an object, `top_logprobs` without
    `logprobs`): 400 with a clear message."""
    grammar = body.get("grammar")
    if grammar is not None and not isinstance(grammar, str):
        raise bad("'grammar' must be a string (GBNF)", "grammar")
    if body.get("json_schema") is not None and not isinstance(body["json_schema"], dict):
        raise bad("'json_schema' must be an object (a JSON Schema)", "json_schema")
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict):
            raise bad("'response_format' must be an object like {\"type\": \"text\"}",
                      "response_format")
        kind = rf.get("type")
        if kind == "json_object":
            if rf.get("schema") is not None and not isinstance(rf["schema"], dict):
                raise bad("'response_format.schema' must be an object (a JSON Schema)",
                          "response_format.schema")
        elif kind == "json_schema":
            wrapper = rf.get("json_schema")
            if wrapper is not None and not isinstance(wrapper, dict):
                raise bad("'response_format.json_schema' must be an object like "
                          "{\"schema\": {...}}", "response_format.json_schema")
            schema = (wrapper or {}).get("schema")
            if schema is not None and not isinstance(schema, dict):
                raise bad("'response_format.json_schema.schema' must be an object (a JSON "
                          "Schema)", "response_format.json_schema.schema")
        elif kind not in (None, "", "text"):
            # llama-server's message (it accepts json_schema too)
            raise bad('response_format type must be one of "text", "json_object" or '
                      f'"json_schema", but got: {kind}', "response_format.type")
    logprobs = body.get("logprobs")
    if logprobs is not None:
        if endpoint in ("chat", "fim"):
            if not isinstance(logprobs, bool):
                raise bad("'logprobs' must be true or false", "logprobs")
        elif endpoint == "completions":
            if not isinstance(logprobs, (bool, int)) or (
                    not isinstance(logprobs, bool) and not 0 <= logprobs <= MAX_LOGPROBS):
                raise bad(f"'logprobs' must be an integer from 0 to {MAX_LOGPROBS}", "logprobs")
        elif logprobs is not False:  # llama.cpp's native endpoints ask with n_probs
            raise bad("'logprobs' is an OpenAI field: this endpoint reports probabilities "
                      "with 'n_probs'", "logprobs")
    top = body.get("top_logprobs")
    if top is not None:
        if not logprobs:
            # llama-server: top_logprobs without logprobs is an error
            raise bad("top_logprobs requires logprobs to be set to true", "top_logprobs")
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_LOGPROBS:
            raise bad(f"'top_logprobs' must be an integer from 0 to {MAX_LOGPROBS}",
                      "top_logprobs")
    n_probs = body.get("n_probs")
    if n_probs is not None:
        if isinstance(n_probs, bool) or not isinstance(n_probs, int) or n_probs < 0:
            raise bad("'n_probs' must be an integer >= 0", "n_probs")
        if n_probs > MAX_N_PROBS:
            raise bad(f"'n_probs' must be at most {MAX_N_PROBS}", "n_probs")
    _is_true(body, "post_sampling_probs")
    bias = body.get("logit_bias")
    if bias is not None and not isinstance(bias, (dict, list)):
        raise bad("'logit_bias' must be an object {token: bias} or a list of "
                  "[token, bias] pairs", "logit_bias")
    if endpoint in ("completions",):
        if _is_true(body, "echo"):
            raise bad("Only no echo is supported ('echo' must be false)", "echo")
        best_of = body.get("best_of")
        if best_of is not None and best_of != 1:
            raise bad("Unsupported param: best_of (only 1 is supported)", "best_of")


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
    n_cmpl: int = 1  # answers of the same prompt (llama.cpp's n_cmpl, OpenAI's n)
    index: int = 0  # this answer's place in the response (choices[i], llama.cpp's index)
    response_fields: list[str] | None = None
    return_tokens: bool = False  # llama.cpp: the answer's token ids in `tokens`
    return_progress: bool = False  # llama.cpp: `prompt_progress` chunks while prefilling
    timings_per_token: bool = False  # llama.cpp: `timings` in every streamed chunk
    # per-row work on the logits (`constrain.py`): ((id, bias), ...); the top alternatives
    # reported with each token's log-probability (None: none asked); llama.cpp's
    # post_sampling_probs; a grammar (kind, spec)
    logit_bias: tuple = ()
    logprobs: int | None = None
    post_probs: bool = False
    grammar: tuple | None = None
    model: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])

    def engine_options(self) -> dict:
        """What `request.prepare` takes for this request's per-row work (keyword arguments
        beside max_tokens, temperature, ...): empty when it asks for none."""
        out: dict[str, Any] = {}
        if self.logit_bias:
            out["logit_bias"] = [[t, b] for t, b in self.logit_bias]
        if self.logprobs is not None:
            out["logprobs"], out["post_probs"] = self.logprobs, self.post_probs
        if self.grammar is not None:
            out["grammar"] = self.grammar
        return out


def _is_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


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
            # llama-server's type and words (its clients match on both), OpenAI's code
            raise ApiError(400, f"request ({len(prompt)} tokens) exceeds the available context "
                                f"size ({ctx} tokens), try increasing it", param="prompt",
                           type="exceed_context_size_error", code="context_length_exceeded",
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
        # Several answers of each prompt: OpenAI's n, llama.cpp's n_cmpl (n as a fallback);
        # each answer is a job of its own (a row of the shared batch).
        key = "n_cmpl" if not check_model and body.get("n_cmpl") is not None else "n"
        n_cmpl = _number(body, key, 1, int, 1, cfg.max_n_cmpl)
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
        if fields == []:  # llama.cpp: an empty list means every field
            fields = None
        req = GenRequest(
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
            cache_reuse=_number(body, "n_cache_reuse", cfg.cache_reuse, int, 0),
            return_tokens=_is_true(body, "return_tokens"),
            return_progress=_is_true(body, "return_progress"),
            timings_per_token=_is_true(body, "timings_per_token"))
        self._row_options(body, endpoint, req)
        return req

    def _row_options(self, body: dict, endpoint: str, req: GenRequest) -> None:
        """logit_bias, log-probabilities (OpenAI's logprobs / top_logprobs, llama.cpp's n_probs
        / post_sampling_probs) and a grammar (llama.cpp's grammar and json_schema, OpenAI's
        response_format), checked (`check_fields` checked their shapes)."""
        from ..constrain import parse_logit_bias

        try:
            req.logit_bias = parse_logit_bias(body.get("logit_bias") or None, self.vocab_size,
                                              self.encode)
        except ValueError as e:
            raise bad(str(e), "logit_bias") from None
        if endpoint in ("chat", "fim"):
            if body.get("logprobs") is True:
                req.logprobs = body.get("top_logprobs") or 0
        elif endpoint == "completions":
            lp = body.get("logprobs")
            if lp is not None and lp is not False:
                req.logprobs = 0 if lp is True else lp
        else:  # llama.cpp's native endpoints
            n = body.get("n_probs") or 0
            if n > 0:
                req.logprobs = n
                req.post_probs = _is_true(body, "post_sampling_probs")
        req.grammar = self._grammar(body)

    def _grammar(self, body: dict) -> tuple | None:
        """The request's grammar (kind, spec), compiled once here to answer a bad one 400."""
        grammar = body.get("grammar") or None
        schema = body.get("json_schema")
        spec, param = None, None
        if schema is not None:
            spec, param = ("json_schema", schema), "json_schema"
        rf = body.get("response_format")
        if isinstance(rf, dict) and rf.get("type") in ("json_object", "json_schema"):
            if schema is not None:
                raise bad("give the JSON Schema once: 'json_schema' or 'response_format'",
                          "response_format")
            if rf["type"] == "json_object":
                spec = ("json", rf.get("schema"))
            else:
                spec = ("json_schema", (rf.get("json_schema") or {}).get("schema") or {})
            param = "response_format"
        if grammar is not None:
            if spec is not None:  # llama-server's words
                raise bad('Either "json_schema" or "grammar" can be specified, but not both',
                          "grammar")
            spec, param = ("gbnf", grammar), "grammar"
        if spec is None:
            return None
        from ..constrain import check_grammar
        from ..errors import MlxspecError

        try:
            check_grammar(self.tokenizer, *spec)
        except MlxspecError as e:
            raise bad(str(e), param) from None
        return spec

    # -- endpoints
    def requests(self, kind: str, body: dict) -> list[GenRequest]:
        """Every answer a request asks for, in the order they are answered: each prompt
        (several on the completion endpoints) times `n` / `n_cmpl`, `index` 0, 1, ... Sampled
        answers of one prompt use seeds seed, seed + 1, ... when a seed is given."""
        check_fields(body, {"completion": "completions", "llama_completion": "completion"}
                     .get(kind, kind))
        if kind == "completion":
            per_prompt = self.completions(body)
        elif kind == "llama_completion":
            per_prompt = self.llama_completions(body)
        else:
            per_prompt = [getattr(self, "fim_completion" if kind == "fim" else kind)(body)]
        out = []
        for req in per_prompt:
            for j in range(req.n_cmpl):
                seed = req.seed + j if req.seed is not None and req.temperature > 0 else req.seed
                out.append(dataclasses.replace(req, index=len(out), seed=seed))
        return out

    def _sub_prompts(self, prompt) -> list:
        """llama.cpp's `tokenize_input_prompts`: a list holding no token id is several
        prompts (each a string, a list of ids, or a mixed list); anything else is one."""
        if isinstance(prompt, list) and not any(_is_id(p) for p in prompt):
            if not prompt:
                raise bad('"prompt" must not be empty', "prompt")
            return prompt
        return [prompt]

    def _mixed_ids(self, prompt: list) -> list[int]:
        """llama.cpp's `tokenize_mixed`: ids as they are, strings tokenized (BOS only before
        a first element that is a string)."""
        ids: list[int] = []
        for i, p in enumerate(prompt):
            if not isinstance(p, str):
                ids.append(p)
            else:
                ids += self.encode_prompt(p) if i == 0 else self.encode(p)
        return ids

    def _prompt_ids(self, prompt, i: int, n: int) -> list[int] | str:
        """One prompt: its ids, or its text (str) to be tokenized by the caller."""
        where = "prompt" if n == 1 else f"prompt[{i}]"
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and prompt and all(_is_id(t) or isinstance(t, str)
                                                      for t in prompt):
            if all(_is_id(t) for t in prompt):
                ids = list(prompt)
            else:
                ids = self._mixed_ids(prompt)
            if any(t < 0 or t >= self.vocab_size for t in ids):
                raise bad(f"{where} has token ids outside the vocabulary", where)
            return ids
        raise bad(f'"{where}" elements must be a string, a list of tokens, or a list of mixed '
                  "strings & tokens", where)

    def completion(self, body: dict) -> GenRequest:
        """`/v1/completions` with one prompt (the first of several)."""
        return self.completions(body)[0]

    def completions(self, body: dict) -> list[GenRequest]:
        """`/v1/completions`: one request per prompt (`prompt` may hold several)."""
        prompt = body.get("prompt")
        if prompt is None:
            raise bad("'prompt' is required", "prompt")
        suffix = body.get("suffix")
        if suffix is not None and not isinstance(suffix, str):
            raise bad("'suffix' must be a string", "suffix")
        prompts = self._sub_prompts(prompt)
        out = []
        for i, p in enumerate(prompts):
            got = self._prompt_ids(p, i, len(prompts))
            if isinstance(got, str):
                if suffix:
                    ids, truncated = self._fim(got, suffix, body)
                elif suffix is not None and self.fim is not None:
                    ids, truncated = self._fim(got, "", body)
                else:
                    ids, truncated = self.encode_prompt(got), False
            else:
                if suffix:
                    raise bad("'suffix' needs a text prompt, not token ids", "suffix")
                ids, truncated = got, False
            req = self._common(body, "completions", ids,
                               max_tokens_keys=("max_tokens", "n_predict"), allow_warmup=True)
            req.truncated = truncated
            self._prediction(body, req)
            out.append(req)
        return out

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
        """The prompt text of a chat request (`messages`, `tools`, `add_generation_prompt`,
        `continue_final_message`), by the model's chat template; what `/apply-template`
        answers. A last assistant message is continued (llama-server's prefill)."""
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
            # llama-server's checks and words
            if role != "assistant" and "content" not in m:
                raise bad("All non-assistant messages must contain 'content'",
                          f"messages[{i}].content")
            if role == "assistant" and m.get("content") is None and not m.get("tool_calls"):
                raise bad("Assistant message must contain either 'content' or 'tool_calls'!",
                          f"messages[{i}]")
            msg = {"role": role, "content": _text_parts(m.get("content"), f"messages[{i}].content")}
            for key in ("name", "tool_calls", "tool_call_id"):
                if key in m:
                    msg[key] = m[key]
            conv.append(msg)
        if len(conv) >= 2 and conv[-1]["role"] == conv[-2]["role"] == "assistant":
            raise bad("Cannot have 2 or more assistant messages at the end of the list.",
                      "messages")
        gen = _is_true(body, "add_generation_prompt", True)
        cont = _is_true(body, "continue_final_message", False)
        if cont and body.get("add_generation_prompt") is True:
            # vLLM's and transformers' rule: the two ask for opposite things
            raise bad("'add_generation_prompt' and 'continue_final_message' cannot both be "
                      "true: the first starts a new assistant message, the second continues "
                      "the last one", "continue_final_message")
        if cont and conv[-1]["role"] != "assistant":
            raise bad("'continue_final_message' needs the last message to be the assistant's",
                      "continue_final_message")
        tools = body["tools"] if isinstance(body.get("tools"), list) else None
        try:
            with self.lock:
                if not gen and conv[-1]["role"] != "assistant":
                    # the conversation as it stands, no assistant turn opened
                    check_chat_template(self.tokenizer)
                    return self.tokenizer.apply_chat_template(
                        conv, add_generation_prompt=False, tokenize=False,
                        **({"tools": tools} if tools is not None else {}))
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

    def prompt_text(self, ids: list[int]) -> str:
        """A prompt's text, special tokens included (llama.cpp's `prompt` field)."""
        with self.lock:
            return self.tokenizer.decode(ids)

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
        extra = body.get("input_extra")
        if extra is None:
            extra = []
        if not isinstance(extra, list):  # llama-server's words
            raise bad('"input_extra" must be an array of {"filename": string, "text": string}',
                      "input_extra")
        for i, c in enumerate(extra):
            if not isinstance(c, dict) or not isinstance(c.get("text"), str):
                raise bad('extra_context chunk must contain a "text" field with a string value',
                          f"input_extra[{i}].text")
            if c.get("filename") is not None and not isinstance(c["filename"], str):
                raise bad('extra_context chunk\'s "filename" field must be a string',
                          f"input_extra[{i}].filename")
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
        """llama.cpp's native `/completion` with one prompt (the first of several)."""
        return self.llama_completions(body)[0]

    def llama_completions(self, body: dict) -> list[GenRequest]:
        """llama.cpp's native `/completion`: `prompt` (text, ids, a mixed list, or a list of
        those: several prompts), `n_predict`, `stream`."""
        prompt = body.get("prompt")
        if prompt is None:
            raise bad("'prompt' is required", "prompt")
        prompts = self._sub_prompts(prompt)
        out = []
        for i, p in enumerate(prompts):
            got = self._prompt_ids(p, i, len(prompts))
            ids = self.encode_prompt(got) if isinstance(got, str) else got
            out.append(self._common(body, "completion", ids,
                                    max_tokens_keys=("n_predict", "max_tokens"),
                                    allow_warmup=True, check_model=False))
        return out

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


# (index, text, finish_reason) or (index, text, finish_reason, logprobs object)
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


def chat_body(req: GenRequest, choices: list[Choice], usage: Usage | None) -> dict:
    """`/v1/chat/completions`' answer (and `/v1/fim/completions`')."""
    body = {**_oai(req, "chatcmpl", "chat.completion"),
            "choices": [{"index": c[0], "message": {"role": "assistant", "content": c[1]},
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
    body = {**_oai(req, "chatcmpl", "chat.completion.chunk"),
            "choices": [] if delta is None else [
                {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
    if usage is not None:
        body["usage"] = usage.openai()
    if timings is not None:
        body["timings"] = timings
    return body


def completion_chunk(req: GenRequest, text: str | None, finish: str | None,
                     usage: Usage | None = None, index: int = 0,
                     timings: dict | None = None, logprobs: dict | None = None) -> dict:
    body = {**_oai(req, "cmpl", "text_completion"),
            "choices": [] if text is None else [
                {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}]}
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
