"""A request checked before any work (`prepare`): clear errors for bad input, and its mode,
proposer, policy, prompt cache and key resolved against the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import caches
from .caches.prompt import PromptCache
from .caches.shift import check_shiftable
from .errors import MlxspecError
from .policy import Policy, check_num_draft
from .prefill import new_cache
from .proposers.base import Proposer
from .sampling import SamplingParams
from .stats import Stats

if TYPE_CHECKING:
    from .engine import Engine

# Special tokens that tell a request's kind (`workload_signal`).
SIGNAL_TOKENS = {"fim": ("<|fim_middle|>", "<fim_middle>", "<|fim▁hole|>"),
                 "chat": ("<|im_start|>", "<start_of_turn>", "<|start_header_id|>")}


@dataclass
class Request:
    """A checked request, resolved against the engine (`prepare`)."""

    tokens: list[int]
    sampling: SamplingParams
    max_tokens: int  # already cut to what the context leaves
    stops: list[str]
    proposer: Proposer | None
    policy: Policy
    pc: PromptCache
    stats: Stats
    seed: int | None  # a sampled request draws by (seed, position) in every mode; None: not
    num_draft: int | None
    cache_reuse: int = 0  # reuse cached chunks of at least this many tokens at shifted places


def prepare(engine: Engine, prompt: str | list[int], *, max_tokens: int = 128,
            temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
            min_p: float = 0.0, seed: int | None = None, stop: list[str] | str | None = None,
            prediction: str | list[int] | None = None, num_draft: int | None = None,
            prompt_cache: PromptCache | None = None, mode: str | None = None,
            policy: Policy | None = None, cache_reuse: int = 0, logit_bias=None,
            logprobs: int | None = None, post_probs: bool = False, grammar=None,
            json_schema=None, regex: str | None = None) -> Request:
    """Check a request (clear errors before any work) and resolve its mode, proposer,
    policy, prompt cache and key. `prediction` (text or ids): a predicted output the
    n-gram proposer copies from; `prompt_cache` (default: the engine's): reused where the
    prompt shares a prefix with it; `mode`, `num_draft` (a cap on k), `policy`: for this
    request; `seed`: at T > 0 each token is drawn from noise keyed by (seed, its position), so
    every mode, batch and k draws the same tokens (None: MLX's global generator, exact in
    distribution only); `cache_reuse` N > 0: past the common
    prefix, runs of at least N cached tokens are reused where they moved (llama.cpp's
    `--cache-reuse`: not bit-identical to a fresh prefill, `caches/shift.py`).

    Per-row work on the target's logits, exact in every mode (`constrain.py`): `logit_bias`
    ({id: bias} or [[id or text, bias], ...], false bans), `logprobs` (None, or the number of
    top alternatives reported with each token's log-probability; `post_probs`: probabilities
    after bias, grammar and sampling transforms), and one grammar: `json_schema` (a JSON
    Schema, or True for any JSON object), `regex`, or `grammar` (GBNF or Lark text, or a
    (kind, spec) pair of `constrain.grammar_text`)."""
    tokens = engine.encode(prompt)
    extra = _per_row(engine, tokens, logit_bias, logprobs, grammar, json_schema, regex)
    sampling = SamplingParams(temperature, top_p, top_k, min_p, post_probs=bool(post_probs),
                              **extra)
    try:
        sampling.validate()
    except ValueError as e:
        raise MlxspecError(str(e)) from None
    if max_tokens < 1:
        raise MlxspecError(f"max_tokens must be >= 1, got {max_tokens}")
    if num_draft is not None:
        check_num_draft(num_draft)
    if not tokens:
        raise MlxspecError("the prompt is empty")
    if engine.max_context and len(tokens) >= engine.max_context:
        raise MlxspecError(
            f"the prompt has {len(tokens)} tokens but the model's context is "
            f"{engine.max_context} tokens")
    if engine.max_context:
        max_tokens = min(max_tokens, engine.max_context - len(tokens))
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    mode = mode or engine.mode
    proposer = engine.proposer_of(mode)
    if proposer is not None:
        if proposer.uses_trees:  # refused before anything runs where it cannot be exact
            caches.check_tree_support(engine.model, caches.make_cache(engine.model), mode)
        if isinstance(prediction, str):
            prediction = engine.tokenizer.encode(prediction, add_special_tokens=False)
        proposer.set_prediction(prediction)
    if cache_reuse < 0:
        raise MlxspecError(f"cache_reuse must be >= 0, got {cache_reuse}")
    if cache_reuse:
        check_shiftable(engine.model, new_cache(engine, proposer))
    return Request(
        tokens=tokens, sampling=sampling, max_tokens=max_tokens, stops=stops,
        proposer=proposer,
        policy=policy or engine.policy_for(proposer, workload_signal(engine, tokens, prediction)),
        pc=prompt_cache if prompt_cache is not None else engine.prompt_cache,
        stats=Stats(mode=mode, prompt_tokens=len(tokens), sampling_rule="greedy" if sampling.greedy
                    else "rejection" if seed is None else "keyed"), num_draft=num_draft,
        seed=seed, cache_reuse=cache_reuse)


def workload_signal(engine: Engine, tokens: list[int], prediction) -> str:
    """The kind of request, for its policy: "edit" (a predicted output), "fim" (a
    fill-in-the-middle token in the prompt), "chat" (a chat template's turn marker), or ""
    (plain text)."""
    if prediction:
        return "edit"
    if engine.signal_ids is None:
        vocab = getattr(engine.tokenizer, "get_vocab", dict)()
        engine.signal_ids = {vocab[t]: signal for signal, names in SIGNAL_TOKENS.items()
                              for t in names if t in vocab}
    if not engine.signal_ids:
        return ""
    found = {engine.signal_ids[t] for t in set(tokens) if t in engine.signal_ids}
    return "fim" if "fim" in found else "chat" if "chat" in found else ""


def _per_row(engine: Engine, tokens: list[int], logit_bias, logprobs, grammar, json_schema,
             regex) -> dict:
    """SamplingParams' per-row fields of a request (`constrain.py`), checked."""
    from .constrain import make_state, parse_logit_bias

    out: dict = {}
    if logit_bias:
        vocab = len(engine.tokenizer.get_vocab())
        try:
            out["logit_bias"] = parse_logit_bias(
                logit_bias, vocab, lambda t: engine.tokenizer.encode(t, add_special_tokens=False))
        except ValueError as e:
            raise MlxspecError(str(e)) from None
    if logprobs is not None:
        if isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0:
            raise MlxspecError(f"logprobs must be an integer >= 0, got {logprobs!r}")
        out["logprobs"] = logprobs
    kinds = [g for g in (grammar, json_schema, regex) if g is not None and g is not False]
    if len(kinds) > 1:
        raise MlxspecError("give one of grammar, json_schema and regex")
    spec = None
    if json_schema is not None and json_schema is not False:
        spec = ("json", None) if json_schema is True else ("json_schema", json_schema)
    elif regex is not None:
        spec = ("regex", regex)
    elif grammar is not None:
        spec = grammar if isinstance(grammar, tuple) else ("gbnf", grammar)
    state = make_state(engine.tokenizer, len(tokens), spec, logprobs)
    if state is not None:
        out["state"] = state
    return out
