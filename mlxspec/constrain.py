"""Per-request work on the target's logits, exact under speculation: a logit bias, a grammar
(JSON, JSON Schema, GBNF / Lark, a regex, on llguidance) and log-probabilities.

The step (`step.py`) asks `RequestState` of a row for what to do with the logits of the
positions it verifies:
- a bias is added to every position's logits;
- a grammar's mask: position i's allowed tokens are the grammar's after the committed tokens
  and the first i proposed ones; a proposal is cut before its first token the grammar refuses
  (the target could never accept it); the matcher advances only on committed tokens (it is
  walked through a proposal to compute its masks and rolled back at once), so it "rolls back
  with the cache" for free;
- log-probabilities are read from the same logits (before bias and mask: what the model says;
  `post_probs`: after them and the sampling transforms), per committed token.

Every rule (greedy, keyed, rejection) then sees the same biased and masked p at each position as
`none` does, so the output stays token-identical to `none` (and in distribution at T > 0).

The matcher is kept in step with the row by absolute position (`RequestState.align`): `pos`
tokens (prompt included) consumed, the tokens by position as they are drawn, fed or
committed. A draw at position p needs the matcher at p: behind, it consumes the tokens known
since; ahead (a step undone), it rolls back. So pipelined, undone or re-planned steps cannot
desynchronize it.
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from . import sampling
from .errors import MlxspecError

_LLG_TOKENIZERS: dict[int, tuple[object, object]] = {}  # id(tokenizer) -> (tokenizer, LLTokenizer)
_LOCK = threading.Lock()
_EXECUTOR = None

# JSON whitespace as llama.cpp's schema converter allows it between tokens: nothing, a space,
# or one or two newlines and an indentation of up to 20 spaces or tabs (a model may write
# pretty-printed JSON, but cannot spend its budget on blank lines).
JSON_OPTIONS = {"whitespace_flexible": True, "item_separator": ",", "key_separator": ":",
                "whitespace_pattern": r"[ ]?|\n{1,2}[ \t]{0,20}", "lenient": True}


# ----------------------------------------------------------------------------- tokenizer


def eos_ids(tokenizer) -> list[int]:
    ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    return sorted(ids)


class _ByteTable:
    """llguidance's view of a tokenizer without a Hugging Face fast tokenizer: each id's
    bytes (its decoded text), and encoding through the tokenizer."""

    def __init__(self, tokenizer, eos: int):
        n = len(tokenizer.get_vocab())
        self.tokens = [tokenizer.decode([i]).encode("utf-8") for i in range(n)]
        self.eos_token_id = eos
        self.bos_token_id = None
        self.special_token_ids = [eos]
        self._tok = tokenizer

    def __call__(self, s):
        if isinstance(s, bytes):
            s = s.decode("utf-8", errors="replace")
        return list(self._tok.encode(s, add_special_tokens=False))


def llg_tokenizer(tokenizer):
    """The llguidance tokenizer of an engine's tokenizer (built once: ~1 s for 150 k tokens)."""
    import llguidance

    with _LOCK:
        got = _LLG_TOKENIZERS.get(id(tokenizer))
        if got is not None and got[0] is tokenizer:
            return got[1]
        eos = eos_ids(tokenizer)
        if not eos:
            raise MlxspecError("constrained decoding needs a tokenizer with an end-of-sequence "
                               "token (the grammar ends the answer with it)")
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        if hasattr(hf, "backend_tokenizer"):
            from llguidance.hf import from_tokenizer

            llg = from_tokenizer(hf, eos_token=eos)
        else:
            from llguidance import TokenizerWrapper

            llg = llguidance.LLTokenizer(TokenizerWrapper(_ByteTable(tokenizer, eos[0])),
                                         eos_token=eos)
        _LLG_TOKENIZERS[id(tokenizer)] = (tokenizer, llg)
        return llg


def _executor():
    global _EXECUTOR
    if _EXECUTOR is None:
        import llguidance

        _EXECUTOR = llguidance.LLExecutor(1)
    return _EXECUTOR


# ----------------------------------------------------------------------------- grammars


def grammar_text(kind: str, spec) -> str:
    """llguidance's grammar for a request's constraint: `kind` "json" (any JSON object; `spec`
    an optional schema), "json_schema" (`spec` a JSON Schema, dict or text), "gbnf" (llama.cpp's
    GBNF, or Lark), "lark", "regex". Raises MlxspecError on a malformed one."""
    import llguidance

    try:
        if kind in ("json", "json_schema"):
            schema = spec if spec is not None else {"type": "object"}
            if isinstance(schema, str):
                schema = json.loads(schema)
            if not isinstance(schema, dict):
                raise MlxspecError("a JSON Schema must be an object")
            if schema == {}:
                schema = {"type": "object"} if kind == "json" else {}
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if kind == "gbnf":
            from llguidance.gbnf_to_lark import any_to_lark

            return llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec))
        if kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(spec)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
    except MlxspecError:
        raise
    except Exception as e:  # a schema that is not JSON, a GBNF that does not convert
        raise MlxspecError(f"invalid {kind} grammar: {e}") from None
    raise MlxspecError(f"unknown grammar kind {kind!r} (json, json_schema, gbnf, lark, regex)")


def check_grammar(tokenizer, kind: str, spec) -> None:
    """Raise MlxspecError, naming what is wrong, where a grammar does not compile."""
    import llguidance

    err = llguidance.LLMatcher.validate_grammar(grammar_text(kind, spec), llg_tokenizer(tokenizer))
    if err:
        raise MlxspecError(f"invalid {kind} grammar: {err}")


class Constraint:
    """A request's grammar matcher, kept at the row's committed tokens by position."""

    def __init__(self, tokenizer, kind: str, spec, start: int):
        import llguidance

        self.llg = llg_tokenizer(tokenizer)
        grammar = grammar_text(kind, spec)
        err = llguidance.LLMatcher.validate_grammar(grammar, self.llg)
        if err:
            raise MlxspecError(f"invalid {kind} grammar: {err}")
        self.matcher = llguidance.LLMatcher(self.llg, grammar, log_level=0)
        if self.matcher.is_error():
            raise MlxspecError(f"invalid {kind} grammar: {self.matcher.get_error()}")
        self.kind = kind
        self.eos = set(eos_ids(tokenizer))
        self.words = (self.llg.vocab_size + 31) // 32
        self.pos = start  # tokens of the sequence consumed (the prompt's count as consumed)
        self.mask_seconds = 0.0  # time spent computing masks (the benchmark reads it)
        self.masks = 0

    def _consume(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise MlxspecError(f"the grammar refused token {int(token)}: "
                               f"{self.matcher.get_error()}")
        self.pos += 1

    def cut(self, draft: list[int]) -> int:
        """How many leading draft tokens the grammar allows (a proposal is cut there), an
        end-of-sequence token excluded (the target's own draw after the tokens before it
        ends the answer: past it the grammar allows nothing), and an id beyond the
        tokenizer's (a model's padded head, never allowed: the matcher would fail on it)."""
        if self.matcher.is_stopped() or not draft:
            return 0
        draft = [int(t) for t in draft]
        vocab = self.llg.vocab_size
        end = next((i for i, t in enumerate(draft) if t in self.eos or not 0 <= t < vocab),
                   len(draft))
        return self.matcher.validate_tokens(draft[:end]) if end else 0

    def bitmasks(self, draft: list[int]) -> np.ndarray:
        """(len(draft) + 1, words) int32: the allowed tokens now and after each draft token
        (all allowed), one bit per token."""
        import time

        start = time.perf_counter()
        out = np.zeros((len(draft) + 1, self.words), np.int32)
        if draft:
            _executor().unsafe_compute_mask_ptr_with_draft_token(
                [(self.matcher, 0, [int(t) for t in draft])], out.ctypes.data, self.words * 4,
                len(draft) + 1)
        else:
            self.matcher.unsafe_compute_mask_ptr(out.ctypes.data, self.words * 4)
        self.mask_seconds += time.perf_counter() - start
        self.masks += len(draft) + 1
        return out


class DraftGuide:
    """A drafter's walk through a row's grammar: its logits masked by the grammar's state after
    the committed tokens and what it drafted so far (so it proposes only what the target could
    accept); the matcher is rolled back when the draft is done (`close`). Each drafted token is
    read back (a sync per token, for constrained rows only)."""

    def __init__(self, state: RequestState, context_len: int):
        self.c = state.align(context_len)
        self.consumed = 0
        self.done = False

    def mask(self, logits: mx.array) -> mx.array:
        if self.done:
            return logits
        keep = allowed(self.c.bitmasks([]), logits.shape[-1])[0]
        return mx.where(keep, logits, -mx.inf)

    def take(self, token) -> None:
        if self.done:
            return
        t = int(token.item()) if not isinstance(token, int) else token
        if (t in self.c.eos or not 0 <= t < self.c.llg.vocab_size
                or not self.c.matcher.validate_tokens([t])):
            self.done = True  # the rest of the draft is cut before verification
            return
        self.c.matcher.consume_token(t)
        self.consumed += 1

    def close(self) -> None:
        if self.consumed:
            self.c.matcher.rollback(self.consumed)
            self.consumed = 0


def allowed(bitmask: np.ndarray, vocab: int) -> mx.array:
    """(rows, vocab) bool from llguidance bitmasks (rows, words): ids beyond the tokenizer's
    vocabulary (a model's padded head) are never allowed."""
    bits = np.unpackbits(bitmask.view(np.uint8), axis=-1, bitorder="little").astype(bool)
    if bits.shape[-1] >= vocab:
        bits = bits[:, :vocab]
    else:
        bits = np.pad(bits, ((0, 0), (0, vocab - bits.shape[-1])))
    return mx.array(bits)


# ----------------------------------------------------------------------------- logit bias


def parse_logit_bias(bias, vocab_size: int, encode=None) -> tuple:
    """((id, bias), ...) from OpenAI's {"id": bias} or llama.cpp's [[id, bias], ...] /
    [["text", bias], ...] (every token of the text) / {"text": bias}; a bias of `false` (or
    -inf) bans the token. Raises ValueError naming what is wrong."""
    if bias is None:
        return ()
    if isinstance(bias, dict):
        items = list(bias.items())
    elif isinstance(bias, list):
        items = []
        for i, pair in enumerate(bias):
            if not isinstance(pair, list) or len(pair) != 2:
                raise ValueError(f"logit_bias[{i}] must be a [token, bias] pair")
            items.append((pair[0], pair[1]))
    else:
        raise ValueError("logit_bias must be an object {token: bias} or a list of "
                         "[token, bias] pairs")
    out: dict[int, float] = {}
    for key, value in items:
        if value is False:
            value = -math.inf
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"logit_bias: the bias of {key!r} must be a number or false")
        elif math.isnan(value):
            raise ValueError(f"logit_bias: the bias of {key!r} is not a number")
        if isinstance(key, bool):
            raise ValueError(f"logit_bias: {key!r} is not a token")
        ids: list[int]
        if isinstance(key, int):
            ids = [key]
        elif isinstance(key, str) and key.lstrip("-").isdigit():
            ids = [int(key)]
        elif isinstance(key, str) and encode is not None:
            ids = list(encode(key))  # llama.cpp: a text biases each of its tokens
        else:
            raise ValueError(f"logit_bias: {key!r} is not a token id")
        for t in ids:
            if not 0 <= t < vocab_size:
                raise ValueError(f"logit_bias: token {t} is outside the vocabulary "
                                 f"(0..{vocab_size - 1})")
            out[t] = out.get(t, 0.0) + float(value)
    return tuple(sorted(out.items()))


_BIAS_CACHE: dict[tuple, mx.array] = {}


def bias_vector(bias: tuple, vocab: int) -> mx.array:
    """The dense (vocab,) float32 bias of ((id, bias), ...), built once per setting."""
    key = (bias, vocab)
    got = _BIAS_CACHE.get(key)
    if got is None:
        v = np.zeros(vocab, np.float32)
        for t, b in bias:
            if t < vocab:
                v[t] += b
        got = mx.array(v)
        if len(_BIAS_CACHE) > 256:
            _BIAS_CACHE.clear()
        _BIAS_CACHE[key] = got
    return got


# ----------------------------------------------------------------------------- log-probabilities


@dataclass
class TokenLogprob:
    """A committed token's log-probability (or probability, `post`) and the top
    alternatives, most likely first."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class RequestState:
    """What a request's row carries between steps (`SamplingParams.state`): its grammar's
    matcher, the tokens it must have consumed by position, and log-probabilities by position
    until the row's output takes them. Positions are absolute (the prompt's count)."""

    constraint: Constraint | None = None
    start: int = 0  # the prompt's length: the position of the first generated token
    logprobs: dict[int, TokenLogprob] = field(default_factory=dict)
    # drawn outside a step (`step.draw_next`): position -> (lazy token, lazy arrays, post)
    lazy: dict[int, tuple] = field(default_factory=dict)
    # a grammar's row: position -> its token (an int, or a lazy scalar drawn and not read yet)
    tokens: dict[int, object] = field(default_factory=dict)
    last: int = -1  # the last position drawn or committed

    def __post_init__(self):
        self.last = self.start - 1

    def next_position(self) -> int:
        return self.last + 1

    def known(self, pos: int, token) -> None:
        """The token at `pos` (drawn, fed or committed)."""
        self.last = max(self.last, pos)
        if self.constraint is not None:
            self.tokens[pos] = token

    def align(self, upto: int) -> Constraint:
        """The matcher having consumed exactly the tokens before position `upto` (rolled back
        past a step undone, advanced through tokens drawn since)."""
        c = self.constraint
        if c.pos > upto:
            if not c.matcher.rollback(c.pos - upto):
                raise MlxspecError(f"the grammar could not roll back {c.pos - upto} tokens")
            c.pos = upto
        while c.pos < upto:
            token = self.tokens.get(c.pos)
            if token is None:
                raise MlxspecError(f"the grammar is {upto - c.pos} tokens behind its row")
            c._consume(token if isinstance(token, int) else int(token.item()))
        for p in [p for p in self.tokens if p < upto - 64]:
            del self.tokens[p]
        return c

    def drawn(self, pos: int, token, lp: tuple | None, post: bool) -> None:
        """A token drawn outside a step at `pos` (lazy), with its lazy log-probabilities."""
        self.known(pos, token)
        self.last = max(self.last, pos)
        if lp is not None:
            self.lazy[pos] = (token, lp, post)

    def take(self, first: int, n: int) -> list[TokenLogprob | None]:
        """The log-probabilities of the tokens committed at positions first .. first + n - 1
        (each None where none was recorded), forgotten once taken."""
        self.settle()
        out = [self.logprobs.pop(first + i, None) for i in range(n)]
        for p in [p for p in self.logprobs if p < first + n]:
            del self.logprobs[p]
        return out

    def committed(self, first: int, tokens: list[int], lp: tuple | None,
                  post: bool) -> list[TokenLogprob] | None:
        """`tokens` committed at positions first..: the grammar advances through them; their
        log-probabilities (`lp`: a step's lazy arrays, evaluated) are read and kept."""
        for i, t in enumerate(tokens):
            self.known(first + i, t)
        if self.constraint is not None:
            self.align(first + len(tokens))
        if lp is None:
            return None
        got = read_logprobs(tokens, *lp, post=post)
        for i, entry in enumerate(got):
            self.logprobs[first + i] = entry
        return got

    def settle(self) -> None:
        """Read the log-probabilities of the tokens drawn outside a step (their tokens are
        read back by now)."""
        for pos, (token, lp, post) in sorted(self.lazy.items()):
            self.logprobs[pos] = read_logprobs([int(token.item())], *lp, post=post)[0]
        self.lazy.clear()


def logprob_arrays(logits: mx.array, count: int) -> tuple:
    """Lazy (log-probabilities (T, vocab), top ids (T, count), their values) of logits (T,
    vocab)."""
    x = logits.astype(mx.float32)
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    if count > 0:
        count = min(count, lp.shape[-1])
        ids = mx.argpartition(-lp, count - 1, axis=-1)[..., :count]
        return lp, ids, mx.take_along_axis(lp, ids, axis=-1)
    return lp, None, None


def read_logprobs(tokens: list[int], lp: mx.array, top_ids, top_vals,
                  post: bool = False) -> list[TokenLogprob]:
    """TokenLogprob of tokens[i] at row i of the (evaluated) arrays of `logprob_arrays`."""
    rows = np.asarray(lp[: len(tokens)]) if len(tokens) else np.zeros((0, 1), np.float32)
    ids = np.asarray(top_ids) if top_ids is not None else None
    vals = np.asarray(top_vals) if top_vals is not None else None
    out = []
    for i, t in enumerate(tokens):
        v = float(rows[i, t])
        top: list[tuple[int, float]] = []
        if ids is not None:
            pairs = sorted(zip(ids[i].tolist(), vals[i].tolist()), key=lambda p: (-p[1], p[0]))
            top = [(int(a), float(b)) for a, b in pairs]
        if post:
            v = math.exp(v)
            top = [(a, math.exp(b)) for a, b in top if b > -math.inf]
        out.append(TokenLogprob(int(t), v, top))
    return out


def adjust(logits: mx.array, s, k: int, mask) -> tuple[mx.array, tuple | None]:
    """One row's logits (T, vocab) over its 1 + k verified positions (and padding): the bias
    added, the grammar's mask (rows 0..k; None: its state now) applied; and the lazy
    log-probability arrays of rows 0..k (before bias and mask, or after them and the sampling
    transforms with `post_probs`) where asked."""
    lp = None
    if s.logprobs is not None and not s.post_probs:
        lp = logprob_arrays(logits[: k + 1], s.logprobs)
    vocab = logits.shape[-1]
    if s.logit_bias:
        logits = logits + bias_vector(s.logit_bias, vocab)
    constraint = getattr(s.state, "constraint", None)
    if constraint is not None:
        if mask is None:
            mask = allowed(constraint.bitmasks([]), vocab)
        if mask.shape[0] < logits.shape[0]:  # padding positions: anything
            mask = mx.concatenate([mask, mx.ones((logits.shape[0] - mask.shape[0], vocab),
                                                 mx.bool_)])
        logits = mx.where(mask, logits, -mx.inf)
    if s.logprobs is not None and s.post_probs:
        head = logits[: k + 1]
        post = (mx.log(mx.softmax(head.astype(mx.float32), axis=-1)) if s.greedy
                else mx.log(sampling.probs_from_logits(head, s)))
        lp = logprob_arrays(post, s.logprobs)
    return logits, lp


def adjust_next(logits: mx.array, samplings, seeds, positions) -> tuple[mx.array, list]:
    """Rows' last logits (B, vocab) for the draw of each row's next token: an adjusted row's
    bias and grammar (after every token before the one drawn) applied; and what to record on
    each row's state once drawn, (state, b, position, lazy log-probabilities, post). A row's
    position: positions[b], else its key's, else the one after its last drawn or committed."""
    rows, pending = [], []
    for b, s in enumerate(samplings):
        x, state = logits[b], s.state
        if s.adjusted:
            pos = None
            if state is not None:
                pos = (positions[b] if positions is not None and positions[b] is not None
                       else seeds[b][1] if seeds[b] is not None else state.next_position())
                if state.constraint is not None:
                    state.align(pos)
            x, lp = adjust(x[None], s, 0, None)
            x = x[0]
            if state is not None:
                pending.append((state, b, pos, lp, s.post_probs))
        rows.append(x)
    return mx.stack(rows), pending


def adjust_rows(logits: mx.array, samplings, last_tokens, sizes, masks):
    """A step's logits (B, T, vocab) with every adjusted fed row's `adjust`ed (its grammar's
    `masks[b]` over its sizes[b] + 1 verified positions), and their log-probability arrays."""
    vocab = logits.shape[-1]
    out, lps = [], []
    for b, s in enumerate(samplings):
        x, lp = logits[b], None
        if s.adjusted and last_tokens[b] is not None:
            mask = masks[b]
            x, lp = adjust(x, s, sizes[b], None if mask is None else allowed(mask, vocab))
        out.append(x)
        lps.append(lp)
    return mx.stack(out), lps


def make_state(tokenizer, prompt_len: int, grammar: tuple | None,
               logprobs: int | None) -> RequestState | None:
    """A request's state: its grammar (kind, spec) compiled, room for log-probabilities."""
    if grammar is None and logprobs is None:
        return None
    constraint = None
    if grammar is not None:
        constraint = Constraint(tokenizer, grammar[0], grammar[1], prompt_len)
    return RequestState(constraint=constraint, start=prompt_len)
