"""A request checked before any work and resolved once (`checked`, then `resolved`): its
tokens, sampling, limits, proposer, policy and prompt cache, everything the decode loop needs
of it. The engine resolves it (`Engine.request`); nothing below reads the engine."""

from __future__ import annotations

from dataclasses import dataclass, replace

from . import caches
from .caches.prompt import PromptCache
from .caches.shift import check_shiftable
from .errors import MlxspecError
from .policy import MAX_NUM_DRAFT, Policy, check_num_draft
from .proposers.base import Proposer
from .sampling import SamplingParams
from .stats import Stats
from .target import Target

# Special tokens that tell a request's kind (`workload_signal`).
SIGNAL_TOKENS = {"fim": ("<|fim_middle|>", "<fim_middle>", "<|fim▁hole|>"),
                 "chat": ("<|im_start|>", "<start_of_turn>", "<|start_header_id|>")}


@dataclass
class Request:
    """A request: checked (`checked`), then resolved against the engine (`resolved`)."""

    tokens: list[int]
    sampling: SamplingParams
    max_tokens: int  # already cut to what the context leaves
    stops: list[str]
    seed: int | None  # a sampled request draws by (seed, position) in every mode; None: not
    num_draft: int | None  # a cap on k
    cache_reuse: int = 0  # reuse cached chunks of at least this many tokens at shifted places
    mode: str = "none"
    proposer: Proposer | None = None
    policy: Policy | None = None
    pc: PromptCache | None = None
    prediction: list[int] | None = None  # a predicted output its proposer copies from
    stats: Stats | None = None
    shares: bool = False  # may share a batch with other requests (`Target.shareable`)

    @property
    def end(self) -> int:
        """The context length at which it ends (max_tokens)."""
        return len(self.tokens) + self.max_tokens

    @property
    def k_cap(self) -> int:
        return self.num_draft or MAX_NUM_DRAFT


def checked(target: Target, tokens: list[int], max_context: int | None, *,
            max_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
            top_k: int = 0, min_p: float = 0.0, seed: int | None = None,
            stop: list[str] | str | None = None, num_draft: int | None = None,
            cache_reuse: int = 0, logit_bias=None, logprobs: int | None = None,
            post_probs: bool = False, grammar=None, json_schema=None,
            regex: str | None = None) -> Request:
    """A request's options checked, with clear errors before any work (options as
    `Engine.request`); its proposer, policy and prompt cache are resolved next (`resolved`)."""
    extra = _per_row(target.tokenizer, tokens, logit_bias, logprobs, grammar, json_schema, regex)
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
    if max_context and len(tokens) >= max_context:
        raise MlxspecError(
            f"the prompt has {len(tokens)} tokens but the model's context is "
            f"{max_context} tokens")
    if max_context:
        max_tokens = min(max_tokens, max_context - len(tokens))
    if cache_reuse < 0:
        raise MlxspecError(f"cache_reuse must be >= 0, got {cache_reuse}")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    return Request(tokens, sampling, max_tokens, stops, seed, num_draft, cache_reuse)


def resolved(req: Request, target: Target, mode: str, proposer: Proposer | None,
             policy: Policy, pc: PromptCache, prediction: list[int] | None) -> Request:
    """The checked request with its mode's proposer, its policy and its prompt cache; refused
    where its proposer cannot be exact on the target's cache. Nothing is changed here: the
    proposer hears of the prediction when the request starts (`prefill.start_proposer`)."""
    if proposer is not None and proposer.uses_trees:
        caches.check_tree_support(target.model, caches.make_cache(target.model), mode)
    if req.cache_reuse:
        check_shiftable(target.model, target.new_cache(proposer))
    rule = "greedy" if req.sampling.greedy else "rejection" if req.seed is None else "keyed"
    stats = Stats(mode=mode, prompt_tokens=len(req.tokens), sampling_rule=rule)
    return replace(req, mode=mode, proposer=proposer, policy=policy, pc=pc,
                   prediction=prediction if proposer is not None else None, stats=stats,
                   shares=target.shareable(proposer))


def signal_ids(tokenizer) -> dict[int, str]:
    """Token id -> the kind of request its presence tells (`workload_signal`)."""
    vocab = getattr(tokenizer, "get_vocab", dict)()
    return {vocab[t]: signal for signal, names in SIGNAL_TOKENS.items()
            for t in names if t in vocab}


def workload_signal(signals: dict[int, str], tokens: list[int], prediction) -> str:
    """The kind of request, for its policy: "edit" (a predicted output), "fim" (a
    fill-in-the-middle token in the prompt), "chat" (a chat template's turn marker), or ""
    (plain text); `signals`: `signal_ids` of the tokenizer."""
    if prediction:
        return "edit"
    if not signals:
        return ""
    found = {signals[t] for t in set(tokens) if t in signals}
    return "fim" if "fim" in found else "chat" if "chat" in found else ""


def _per_row(tokenizer, tokens: list[int], logit_bias, logprobs, grammar, json_schema,
             regex) -> dict:
    """SamplingParams' per-row fields of a request (`constrain.py`), checked."""
    from .constrain import make_state, parse_logit_bias

    out: dict = {}
    if logit_bias:
        vocab = len(tokenizer.get_vocab())
        try:
            out["logit_bias"] = parse_logit_bias(
                logit_bias, vocab, lambda t: tokenizer.encode(t, add_special_tokens=False))
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
    state = make_state(tokenizer, len(tokens), spec, logprobs)
    if state is not None:
        out["state"] = state
    return out
