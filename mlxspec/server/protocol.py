"""What clients send and what they get back: the request bodies as pydantic models (one per
endpoint family), fill-in-the-middle prompt assembly, and the response bodies.

Nothing here touches MLX: the app validates and tokenizes a request before it reaches the
worker, so bad input is answered without ever queueing behind generation.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from pydantic import StrictBool as Bool
from pydantic_core import PydanticCustomError

from .. import __version__
from ..chat_session import check_chat_template, render_chat
from ..fim import FimTokens, detect_fim  # noqa: F401  (FimTokens: re-exported)
from .tools import choose_calls, template_calls, tool_syntax

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


# ----------------------------------------------------------------------------- request models


def refuse(message: str) -> PydanticCustomError:
    """A validation error whose message is answered as it is."""
    return PydanticCustomError("api", message)


def _number(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PydanticCustomError("number", "must be a number, got {kind}",
                                  {"kind": type(value).__name__})
    return value


# JSON numbers only (no strings, no booleans); floats finite, integers whole.
Number = Annotated[float, BeforeValidator(_number), Field(allow_inf_nan=False)]
Integer = Annotated[int, BeforeValidator(_number)]


def _check(test, message: str):
    def check(value):
        if value is not None and not test(value):
            raise refuse(message)
        return value
    return BeforeValidator(check)


def _is_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


Stop = Annotated[Any, _check(lambda v: isinstance(v, str) or (isinstance(v, list) and all(
    isinstance(s, str) for s in v)), "'stop' must be a string or a list of strings")]
LogitBias = Annotated[Any, _check(lambda v: isinstance(v, (dict, list)),
                                  "'logit_bias' must be an object {token: bias} or a list of "
                                  "[token, bias] pairs")]
Content = Annotated[Any, _check(lambda v: isinstance(v, (str, list)),
                                "must be a string or a list of text parts")]


class Loose(BaseModel):
    """A request object: fields this server does not know are accepted (clients send many)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class Speculative(Loose):
    mode: str | None = None
    num_draft: Integer | None = Field(None, ge=1, le=64)
    suffix: Bool | None = None
    sources: Bool | None = None  # true: a streamed chat's deltas say where each token came from


class StreamOptions(Loose):
    include_usage: Any = False


class SchemaWrapper(Loose):
    schema_: dict | None = Field(None, alias="schema")


class ResponseFormat(Loose):
    type: Any = None
    schema_: dict | None = Field(None, alias="schema")
    json_schema: SchemaWrapper | None = None

    @model_validator(mode="after")
    def _known_type(self):
        if self.type not in (None, "", "text", "json_object", "json_schema"):
            raise ValueError('response_format type must be one of "text", "json_object" or '
                             f'"json_schema", but got: {self.type}')
        return self


class Prediction(Loose):
    type: Any = "content"
    content: Content = None

    @model_validator(mode="after")
    def _content(self):
        if self.type != "content":
            raise ValueError("'prediction' must be {\"type\": \"content\", \"content\": ...}")
        return self


class Generation(Loose):
    """The fields every generation endpoint shares (null means absent, as before)."""

    model: str | None = None
    max_tokens: Integer | None = None
    max_completion_tokens: Integer | None = None
    n_predict: Integer | None = None
    temperature: Number | None = Field(None, ge=0, le=100)
    top_p: Number | None = Field(None, ge=0, le=1)
    top_k: Integer | None = None
    min_p: Number | None = Field(None, ge=0, le=0.999999)
    seed: Integer | None = None
    random_seed: Integer | None = None  # Mistral's name
    stop: Stop = None
    stream: Bool = False
    stream_options: StreamOptions | None = None
    n: Integer | None = Field(None, ge=1)
    n_cmpl: Integer | None = Field(None, ge=1)
    speculative: Speculative | None = None
    t_max_predict_ms: Number | None = None
    response_fields: list[str] | None = None
    n_indent: Integer | None = Field(None, ge=0)
    n_cache_reuse: Integer | None = Field(None, ge=0)
    return_tokens: Bool | None = None
    return_progress: Bool | None = None
    timings_per_token: Bool | None = None
    # constrained output, log-probabilities, logit bias (`constrain.py`)
    grammar: str | None = None
    json_schema: dict | None = None
    response_format: ResponseFormat | None = None
    logprobs: Any = None  # each family says what it takes
    top_logprobs: Integer | None = Field(None, ge=0, le=MAX_LOGPROBS)
    n_probs: Integer | None = Field(None, ge=0, le=MAX_N_PROBS)
    post_sampling_probs: Bool | None = None
    logit_bias: LogitBias = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            # llama-server: top_logprobs without logprobs is an error
            raise ValueError("top_logprobs requires logprobs to be set to true")
        return self


def _prompt_shape(value):
    if value is None:
        raise refuse("'prompt' is required")
    return value


class CompletionRequest(Generation):
    """`/v1/completions` (OpenAI's legacy completions, FIM with `suffix`)."""

    prompt: Annotated[Any, BeforeValidator(_prompt_shape)]
    suffix: str | None = None
    prediction: Prediction | None = None
    logprobs: Annotated[Any, _check(lambda v: isinstance(v, bool) or (
        isinstance(v, int) and 0 <= v <= MAX_LOGPROBS),
        f"'logprobs' must be an integer from 0 to {MAX_LOGPROBS}")] = None
    echo: Annotated[Any, _check(lambda v: v is False,
                                "Only no echo is supported ('echo' must be false)")] = None
    best_of: Annotated[Any, _check(lambda v: v == 1,
                                   "Unsupported param: best_of (only 1 is supported)")] = None


class LlamaCompletionRequest(Generation):
    """llama.cpp's native `/completion`."""

    prompt: Annotated[Any, BeforeValidator(_prompt_shape)]
    logprobs: Annotated[Any, _check(lambda v: v is False,
                                    "'logprobs' is an OpenAI field: this endpoint reports "
                                    "probabilities with 'n_probs'")] = None


class ExtraChunk(Loose):
    text: Any = None
    filename: Annotated[Any, _check(lambda v: isinstance(v, str),
                                    'extra_context chunk\'s "filename" field must be a '
                                    "string")] = None

    @model_validator(mode="after")
    def _has_text(self):  # llama-server's words
        if not isinstance(self.text, str):
            raise ValueError('extra_context chunk must contain a "text" field with a string '
                             "value")
        return self


class InfillRequest(LlamaCompletionRequest):
    """llama.cpp's `/infill` (llama.vim, llama.vscode)."""

    prompt: str | None = None  # the current line up to the cursor
    input_prefix: str | None = None
    input_suffix: str | None = None
    input_extra: Annotated[list[ExtraChunk] | None, _check(
        lambda v: isinstance(v, list),
        '"input_extra" must be an array of {"filename": string, "text": string}')] = None


class FimRequest(Generation):
    """`/v1/fim/completions` (Mistral, DeepSeek; Continue's FIM): prefix and suffix."""

    prompt: Any = None
    suffix: str | None = None
    logprobs: Bool | None = None

    @model_validator(mode="after")
    def _prompt_is_text(self):
        if not isinstance(self.prompt, str):
            raise ValueError("'prompt' (the text before the cursor) must be a string")
        return self


class ChatMessage(Loose):
    role: str
    content: Content = None
    name: Any = None
    tool_calls: Any = None
    tool_call_id: Any = None

    @model_validator(mode="after")
    def _known_role(self):
        role = "system" if self.role == "developer" else self.role
        if role not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"unknown role {self.role!r}")
        # llama-server's checks and words
        if role != "assistant" and "content" not in self.model_fields_set:
            raise ValueError("All non-assistant messages must contain 'content'")
        if role == "assistant" and self.content is None and not self.tool_calls:
            raise ValueError("Assistant message must contain either 'content' or 'tool_calls'!")
        self.role = role
        return self


class FunctionSpec(Loose):
    name: str
    description: str | None = None
    parameters: dict | None = None


class ChatTool(Loose):
    """A `tools` entry: a function the model may call (OpenAI's chat shape)."""

    type: Annotated[Any, _check(lambda v: v == "function",
                                "only tools of type 'function' are supported")] = "function"
    function: FunctionSpec


class ChatTemplateRequest(Loose):
    """What the chat template renders (`/v1/chat/completions`, `/apply-template`)."""

    messages: Annotated[list[ChatMessage], _check(
        lambda v: isinstance(v, list) and v, "'messages' must be a non-empty list")]
    tools: list[ChatTool] | None = None
    add_generation_prompt: Bool | None = None
    continue_final_message: Bool | None = None


class ChatRequest(Generation, ChatTemplateRequest):
    """`/v1/chat/completions`."""

    tool_choice: Any = None  # "none", "auto", "required" or {"type": "function", ...}
    parallel_tool_calls: Bool | None = None

    prediction: Prediction | None = None
    logprobs: Annotated[Any, _check(lambda v: isinstance(v, bool),
                                    "'logprobs' must be true or false")] = None


class TokenizeRequest(Loose):
    content: str | None = None
    add_special: Bool = False
    parse_special: Bool = True
    with_pieces: Bool = False


class DetokenizeRequest(Loose):
    tokens: Annotated[list, _check(lambda v: isinstance(v, list) and all(map(_is_id, v)),
                                   "'tokens' must be a list of token ids")] = []


def parse(model: type[BaseModel], body: dict):
    """`body` as a `model`, or the first problem as a 400 in the endpoint's words."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None


def _where(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not (isinstance(part, str) and (part.startswith(("function-", "list[", "dict["))
                                             or part in ("str", "int", "bool", "float"))):
            out += ("." if out else "") + str(part).rstrip("_")
    return out


WORDS = {
    "number": "'{name}' must be a number, got {kind}",
    "int_from_float": "'{name}' must be an integer, got {input}",
    "int_type": "'{name}' must be an integer, got {input}",
    "finite_number": "'{name}' must be a finite number, got {input}",
    "greater_than_equal": "'{name}' must be >= {ge}, got {input}",
    "less_than_equal": "'{name}' must be <= {le}, got {input}",
    "bool_type": "'{name}' must be true or false",
    "string_type": "'{name}' must be a string",
    "list_type": "'{name}' must be a list",
    "dict_type": "'{name}' must be an object",
    "model_type": "'{name}' must be an object",
    "model_attributes_type": "'{name}' must be an object",
    "missing": "'{name}' is required",
}


def validation_error(e: ValidationError) -> ApiError:
    """A pydantic error as the 400 this server answers: its field (`param`) and words."""
    err = e.errors(include_url=False)[0]
    name = _where(err["loc"])
    kind = err["type"]
    if kind == "api":
        message = err["msg"]
    elif kind == "value_error":
        message = str(err["ctx"]["error"])
        if name and not message.startswith(("'", '"')) and "[" in name:
            message = f"{name}: {message}"
    else:
        template = WORDS.get(kind, "'{name}': {msg}")
        message = template.format(name=name, input=err.get("input"), msg=err["msg"],
                                  **(err.get("ctx") or {}))
    return bad(message, name or None)


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
    # "speculative": {"sources": true}: a streamed chat's deltas carry `sources`, the spans of
    # their text with where each span's tokens came from (relay.py's `SourceSpans`)
    return_sources: bool = False
    # per-row work on the logits (`constrain.py`): ((id, bias), ...); the top alternatives
    # reported with each token's log-probability (None: none asked); llama.cpp's
    # post_sampling_probs; a grammar (kind, spec)
    logit_bias: tuple = ()
    logprobs: int | None = None
    post_probs: bool = False
    grammar: tuple | None = None
    tools: list | None = None  # the functions whose calls are parsed out of the answer
    tool_parallel: bool = True  # several calls per answer ("parallel_tool_calls" not false)
    model: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])

    def engine_options(self) -> dict:
        """What `Engine.request` takes for this request's per-row work (keyword arguments
        beside max_tokens, temperature, ...): empty when it asks for none."""
        out: dict[str, Any] = {}
        if self.logit_bias:
            out["logit_bias"] = [[t, b] for t, b in self.logit_bias]
        if self.logprobs is not None:
            out["logprobs"], out["post_probs"] = self.logprobs, self.post_probs
        if self.grammar is not None:
            out["grammar"] = self.grammar
        return out


def _text_parts(content, where: str) -> str:
    """OpenAI content: a string or a list of {"type": "text", "text": ...} parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
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


@dataclass
class ServerConfig:
    """What request parsing needs to know about the model and the server's defaults."""

    model_name: str
    model_aliases: set[str]
    max_context: int | None
    default_max_tokens: int = 512
    default_temperature: float = 0.0
    modes: tuple[str, ...] = ()
    accept_any_model: bool = False  # --accept-any-model: OpenAI requests may name any model
    max_n_cmpl: int = 16
    cache_reuse: int = 0  # --cache-reuse: a request's default n_cache_reuse
    default_seed: int | None = None  # --seed: the seed of a request that sends none


# endpoint kind -> (request model, max_tokens keys in order, OpenAI's model check)
KINDS = {
    "completion": (CompletionRequest, ("max_tokens", "n_predict"), True),
    "chat": (ChatRequest, ("max_completion_tokens", "max_tokens", "n_predict"), True),
    "fim": (FimRequest, ("max_tokens", "n_predict"), True),
    "infill": (InfillRequest, ("n_predict", "max_tokens"), False),
    "llama_completion": (LlamaCompletionRequest, ("n_predict", "max_tokens"), False),
}


class RequestParser:
    """Turns request bodies into `GenRequest`s, tokenizing with the engine's tokenizer."""

    def __init__(self, tokenizer, config: ServerConfig, tokenize_lock=None):
        import threading

        self.tokenizer = tokenizer
        self.config = config
        self.lock = tokenize_lock or threading.Lock()
        vocab = tokenizer.get_vocab()
        self.fim = detect_fim(vocab)
        self.tool_syntax = tool_syntax(tokenizer)
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

    # -- endpoints
    def requests(self, kind: str, body: dict) -> list[GenRequest]:
        """Every answer a request asks for, in the order they are answered: each prompt
        (several on the completion endpoints) times `n` / `n_cmpl`, `index` 0, 1, ... Sampled
        answers of one prompt use seeds seed, seed + 1, ... when a seed is given."""
        model, keys, openai = KINDS[kind]
        r = parse(model, body)
        prompts = getattr(self, f"{kind}_prompts")(r)
        out = []
        for ids, truncated in prompts:
            req = self._common(r, kind, ids, keys, openai)
            req.truncated = truncated
            for j in range(req.n_cmpl):
                seed = req.seed + j if req.seed is not None and req.temperature > 0 else req.seed
                out.append(dataclasses.replace(req, index=len(out), seed=seed))
        return out

    def completion_prompts(self, r: CompletionRequest) -> list[tuple[list[int], bool]]:
        """`/v1/completions`: one prompt per entry of `prompt`, FIM with `suffix`."""
        out = []
        for got in self._split_prompts(r.prompt):
            if isinstance(got, str):
                if r.suffix or (r.suffix is not None and self.fim is not None):
                    out.append(self._fim(got, r.suffix, r))
                else:
                    out.append((self.encode_prompt(got), False))
            elif r.suffix:
                raise bad("'suffix' needs a text prompt, not token ids", "suffix")
            else:
                out.append((got, False))
        return out

    def llama_completion_prompts(self, r: LlamaCompletionRequest) -> list[tuple[list[int], bool]]:
        """llama.cpp's `/completion`: `prompt` (text, ids, a mixed list, or a list of those:
        several prompts)."""
        return [(self.encode_prompt(got) if isinstance(got, str) else got, False)
                for got in self._split_prompts(r.prompt)]

    def fim_prompts(self, r: FimRequest) -> list[tuple[list[int], bool]]:
        """`/v1/fim/completions`: `prompt` is the prefix, `suffix` the suffix."""
        return [self._fim(r.prompt, r.suffix or "", r)]

    def chat_prompts(self, r: ChatRequest) -> list[tuple[list[int], bool]]:
        return [(self.encode(self.render_chat(r, tools=r.tool_choice != "none")), False)]

    def infill_prompts(self, r: InfillRequest) -> list[tuple[list[int], bool]]:
        """llama.cpp's `/infill`: `input_prefix`, `prompt` (the line to the cursor),
        `input_suffix` and `input_extra` chunks, laid out by `build_fim_prompt`."""
        if self.fim is None:
            # llama.cpp's answer for a model without FIM tokens, word for word: editors
            # (llama.vim, llama.vscode) match on it.
            raise ApiError(501, "Infill is not supported by this model: prefix token is "
                           "missing. suffix token is missing. middle token is missing. ",
                           type="not_supported_error")
        n = r.n_predict if r.n_predict is not None else r.max_tokens
        extra = [{"filename": c.filename, "text": c.text} for c in r.input_extra or []]
        return [build_fim_prompt(
            self.encode, self.fim, r.input_prefix or "", r.input_suffix or "", extra=extra,
            middle=r.prompt or "", bos=self.bos, budget=self._budget(n))]

    # -- shared fields
    def _common(self, r: Generation, kind: str, prompt: list[int], max_tokens_keys,
                openai: bool) -> GenRequest:
        """Fields every endpoint shares. OpenAI endpoints refuse model names not served here
        (404, unless --accept-any-model); llama.cpp's own endpoints ignore `model`."""
        cfg = self.config
        if openai and r.model and r.model not in cfg.model_aliases and not cfg.accept_any_model:
            raise ApiError(404, f"model '{r.model}' is not served here; this server serves "
                                f"'{cfg.model_name}' (see GET /v1/models; --model-alias "
                                f"{r.model} or --accept-any-model accept this name)",
                           param="model", code="model_not_found")
        max_tokens = None
        for key in max_tokens_keys:
            max_tokens = getattr(r, key)
            if max_tokens is not None:
                if key == "n_predict" and max_tokens < 0:  # llama.cpp: -1 = unlimited
                    max_tokens = None
                elif max_tokens < (0 if key == "n_predict" else 1):
                    raise bad(f"'{key}' must be >= 1, got {max_tokens}", key)
                break
        warmup = max_tokens == 0  # n_predict 0: prefill and cache the prompt only
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
        seed = r.seed if r.seed is not None else r.random_seed
        seed = cfg.default_seed if seed is None else seed if seed >= 0 else None  # -1: random
        # Several answers of each prompt: OpenAI's n, llama.cpp's n_cmpl (n as a fallback).
        n_cmpl = r.n_cmpl if not openai and r.n_cmpl is not None else r.n or 1
        if n_cmpl > cfg.max_n_cmpl:
            key = "n_cmpl" if not openai and r.n_cmpl is not None else "n"
            raise bad(f"'{key}' must be <= {cfg.max_n_cmpl}, got {n_cmpl}", key)
        spec = r.speculative or Speculative()
        if spec.mode is not None and spec.mode not in cfg.modes:
            raise bad(f"unknown speculative mode {spec.mode!r}; choose one of: "
                      f"{', '.join(cfg.modes)}", "speculative.mode")
        t_max = r.t_max_predict_ms
        temperature = cfg.default_temperature if r.temperature is None else r.temperature
        req = GenRequest(
            endpoint={"completion": "completions", "llama_completion": "completion"}.get(
                kind, kind),
            prompt=prompt, max_tokens=max_tokens, temperature=temperature,
            top_p=r.top_p or 1.0, top_k=max(0, r.top_k or 0), min_p=r.min_p or 0.0,
            seed=seed, stop=[s for s in ([r.stop] if isinstance(r.stop, str) else r.stop or [])
                             if s],
            stream=r.stream, include_usage=bool(r.stream_options and
                                                r.stream_options.include_usage),
            mode=spec.mode, num_draft=spec.num_draft, use_suffix=spec.suffix is not False,
            warmup=warmup, t_max_predict_ms=t_max if t_max and t_max > 0 else None,
            # llama.cpp: an empty list means every field
            response_fields=r.response_fields or None, model=cfg.model_name,
            context_limited=limited, n_ctx=ctx, n_indent=r.n_indent or 0, n_cmpl=n_cmpl,
            cache_reuse=cfg.cache_reuse if r.n_cache_reuse is None else r.n_cache_reuse,
            return_tokens=bool(r.return_tokens), return_progress=bool(r.return_progress),
            timings_per_token=bool(r.timings_per_token), return_sources=spec.sources is True)
        self._row_options(r, kind, req)
        if kind == "chat":
            choose_calls(r, req, self.tool_syntax, self.tokenizer)
        if getattr(r, "prediction", None) is not None:  # OpenAI's predicted output
            text = _text_parts(r.prediction.content, "prediction.content")
            req.prediction = self.encode(text) if text else None
        return req

    def _row_options(self, r: Generation, kind: str, req: GenRequest) -> None:
        """logit_bias, log-probabilities (OpenAI's logprobs / top_logprobs, llama.cpp's n_probs
        / post_sampling_probs) and a grammar (llama.cpp's grammar and json_schema, OpenAI's
        response_format)."""
        from ..constrain import parse_logit_bias

        try:
            req.logit_bias = parse_logit_bias(r.logit_bias or None, self.vocab_size,
                                              self.encode)
        except ValueError as e:
            raise bad(str(e), "logit_bias") from None
        if kind in ("chat", "fim"):
            if r.logprobs is True:
                req.logprobs = r.top_logprobs or 0
        elif kind == "completion":
            if r.logprobs is not None and r.logprobs is not False:
                req.logprobs = 0 if r.logprobs is True else r.logprobs
        elif r.n_probs:  # llama.cpp's native endpoints
            req.logprobs = r.n_probs
            req.post_probs = bool(r.post_sampling_probs)
        req.grammar = self._grammar(r)

    def _grammar(self, r: Generation) -> tuple | None:
        """The request's grammar (kind, spec), compiled once here to answer a bad one 400."""
        spec, param = None, None
        if r.json_schema is not None:
            spec, param = ("json_schema", r.json_schema), "json_schema"
        rf = r.response_format
        if rf is not None and rf.type in ("json_object", "json_schema"):
            if spec is not None:
                raise bad("give the JSON Schema once: 'json_schema' or 'response_format'",
                          "response_format")
            if rf.type == "json_object":
                spec = ("json", rf.schema_)
            else:
                spec = ("json_schema", (rf.json_schema and rf.json_schema.schema_) or {})
            param = "response_format"
        if r.grammar:
            if spec is not None:  # llama-server's words
                raise bad('Either "json_schema" or "grammar" can be specified, but not both',
                          "grammar")
            spec, param = ("gbnf", r.grammar), "grammar"
        if spec is None:
            return None
        from ..constrain import check_grammar
        from ..errors import MlxspecError

        try:
            check_grammar(self.tokenizer, *spec)
        except MlxspecError as e:
            raise bad(str(e), param) from None
        return spec

    def _split_prompts(self, prompt) -> list[list[int] | str]:
        """llama.cpp's `tokenize_input_prompts`: a list holding no token id is several
        prompts (each a string, a list of ids, or a mixed list); anything else is one. Each
        comes back as its ids, or its text to be tokenized by the caller."""
        several = isinstance(prompt, list) and not any(_is_id(p) for p in prompt)
        if several and not prompt:
            raise bad('"prompt" must not be empty', "prompt")
        prompts = prompt if several else [prompt]
        out = []
        for i, p in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if isinstance(p, str):
                out.append(p)
                continue
            if not (isinstance(p, list) and p and all(_is_id(t) or isinstance(t, str)
                                                      for t in p)):
                raise bad(f'"{where}" elements must be a string, a list of tokens, or a list '
                          "of mixed strings & tokens", where)
            # llama.cpp's `tokenize_mixed`: ids as they are, strings tokenized (BOS only
            # before a first element that is a string)
            ids = [t for j, s in enumerate(p) for t in (
                [s] if _is_id(s) else self.encode_prompt(s) if j == 0 else self.encode(s))]
            if any(t < 0 or t >= self.vocab_size for t in ids):
                raise bad(f"{where} has token ids outside the vocabulary", where)
            out.append(ids)
        return out

    def render_chat(self, r: ChatTemplateRequest, tools: bool = True) -> str:
        """The prompt text of a chat request (`messages`, `tools` unless `tools` is false,
        `add_generation_prompt`, `continue_final_message`), by the model's chat template;
        what `/apply-template` answers. A last assistant message is continued
        (llama-server's prefill)."""
        conv, call_ids = [], set()
        for i, m in enumerate(r.messages):
            msg = {"role": m.role, "content": _text_parts(m.content, f"messages[{i}].content")}
            for key in ("name", "tool_call_id"):
                if key in m.model_fields_set:
                    msg[key] = getattr(m, key)
            if m.tool_calls:
                msg["tool_calls"] = template_calls(m.tool_calls, f"messages[{i}].tool_calls")
                call_ids.update(c.get("id") for c in msg["tool_calls"])
            if m.role == "tool" and (not call_ids or (
                    m.tool_call_id is not None and m.tool_call_id not in call_ids)):
                raise bad(f"messages[{i}] is a tool result whose call is not in an earlier "
                          "assistant message's 'tool_calls' (tool_call_id "
                          f"{m.tool_call_id!r})", f"messages[{i}].tool_call_id")
            conv.append(msg)
        if len(conv) >= 2 and conv[-1]["role"] == conv[-2]["role"] == "assistant":
            raise bad("Cannot have 2 or more assistant messages at the end of the list.",
                      "messages")
        gen = r.add_generation_prompt is not False
        if r.continue_final_message and r.add_generation_prompt:
            # vLLM's and transformers' rule: the two ask for opposite things
            raise bad("'add_generation_prompt' and 'continue_final_message' cannot both be "
                      "true: the first starts a new assistant message, the second continues "
                      "the last one", "continue_final_message")
        if r.continue_final_message and conv[-1]["role"] != "assistant":
            raise bad("'continue_final_message' needs the last message to be the assistant's",
                      "continue_final_message")
        tools = [t.model_dump(exclude_none=True) for t in r.tools] if tools and r.tools else None
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
        r = parse(TokenizeRequest, body)
        if r.content is None:
            return {"tokens": []}
        with self.lock:
            if r.parse_special:
                ids = self.tokenizer.encode(r.content, add_special_tokens=r.add_special)
            else:
                try:
                    ids = self.tokenizer.encode(r.content, add_special_tokens=r.add_special,
                                                split_special_tokens=True)
                except TypeError:
                    raise bad("this tokenizer cannot read special tokens as plain text "
                              "(parse_special: false)", "parse_special") from None
        ids = [int(t) for t in ids]
        if not r.with_pieces:
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
        tokens = parse(DetokenizeRequest, body).tokens
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
        return {"prompt": self.render_chat(parse(ChatTemplateRequest, body))}

    def _fim(self, prefix: str, suffix: str, r: Generation) -> tuple[list[int], bool]:
        if self.fim is None:
            raise bad("'suffix' needs fill-in-the-middle, and this model's tokenizer has no FIM "
                      "tokens (<|fim_prefix|>, <fim_prefix> or <PRE>)", "suffix")
        return build_fim_prompt(self.encode, self.fim, prefix, suffix, bos=self.bos,
                                budget=self._budget(r.max_tokens))

    def _budget(self, max_tokens: int | None) -> int | None:
        ctx = self.config.max_context
        if not ctx:
            return None
        n = max_tokens if max_tokens is not None and max_tokens > 0 else \
            self.config.default_max_tokens
        return max(16, ctx - min(n, ctx // 2) - 1)


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
