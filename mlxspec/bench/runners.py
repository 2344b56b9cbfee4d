"""What the benchmark runs: our engine in each mode, and mlx-lm's own decoders as peers.

Every runner prefills the prompt (all but its last token) outside the timed decode, so
tokens/s compares decoding alone, the part speculation changes. Our engine's runners of one
prompt may share a `PromptCache`: the prompt's KV is then built once and trimmed back exactly
for each mode (as a server's prefix cache does), which saves wall-clock time on real models'
long prompts and changes no timed figure.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from ..engine import Engine, PromptCache
from ..errors import MlxspecError


@dataclass
class Run:
    tokens: list[int]
    decode_seconds: float
    target_forwards: int
    drafted: int = 0
    accepted: int = 0
    stats: dict = field(default_factory=dict)

    @property
    def tps(self) -> float:
        return len(self.tokens) / self.decode_seconds if self.decode_seconds > 0 else 0.0


class EngineRunner:
    """Our engine in `mode`; `policy` (FixedK / AdaptiveK) persists across the runs, as it
    would across a user's requests."""

    def __init__(self, engine: Engine, mode: str, label: str | None = None, num_draft=None,
                 policy=None):
        self.engine, self.mode, self.label = engine, mode, label or mode
        self.num_draft, self.policy = num_draft, policy

    def run(self, tokens: list[int], max_tokens: int, temperature: float, seed: int,
            prediction: str | None = None, prompt_cache: PromptCache | None = None,
            grammar: tuple | None = None) -> Run:
        result = self.engine.generate(tokens, max_tokens=max_tokens, temperature=temperature,
                                      seed=seed, mode=self.mode, prediction=prediction,
                                      num_draft=self.num_draft, policy=self.policy,
                                      prompt_cache=prompt_cache or PromptCache(),
                                      grammar=grammar)
        s = result.stats
        return Run(result.tokens, s.decode_seconds, s.target_forwards, s.drafted, s.accepted,
                   s.to_dict())


def _unconstrained(label: str, grammar) -> None:
    if grammar is not None:
        raise MlxspecError(f"{label} cannot hold an answer to a grammar (the agent workload's "
                           "tool calls): leave it out of --modes")


def _eos(engine: Engine) -> set[int]:
    return set(getattr(engine.tokenizer, "eos_token_ids", None) or [])


class MlxLmRunner:
    """`mlx_lm.generate`'s decoder (generate_step)."""

    label = "mlx_lm"

    def __init__(self, engine: Engine):
        self.engine = engine

    def run(self, tokens, max_tokens, temperature, seed, prediction=None,
            prompt_cache=None, grammar=None) -> Run:
        _unconstrained(self.label, grammar)
        model, eos = self.engine.model, _eos(self.engine)
        cache = make_prompt_cache(model)
        if len(tokens) > 1:
            model(mx.array(tokens[:-1], mx.uint32)[None], cache=cache)
            mx.eval([c.state for c in cache])
        mx.random.seed(seed)
        out = []
        start = time.perf_counter()
        for token, _ in generate_step(mx.array(tokens[-1:], mx.uint32), model, max_tokens=max_tokens,
                                      sampler=make_sampler(temp=temperature), prompt_cache=cache):
            if token in eos:
                break
            out.append(token)
        return Run(out, time.perf_counter() - start, len(out))


class MlxLmSpeculativeRunner:
    """mlx-lm's speculative_generate_step with the same draft: sample-and-match acceptance."""

    label = "mlx_lm_spec"

    def __init__(self, engine: Engine, num_draft: int):
        self.engine, self.num_draft = engine, num_draft

    def run(self, tokens, max_tokens, temperature, seed, prediction=None,
            prompt_cache=None, grammar=None) -> Run:
        _unconstrained(self.label, grammar)
        model, draft, eos = self.engine.model, self.engine.draft_model, _eos(self.engine)
        cache = make_prompt_cache(model) + make_prompt_cache(draft)
        if len(tokens) > 1:
            model(mx.array(tokens[:-1], mx.uint32)[None], cache=cache[: len(model.layers)])
            draft(mx.array(tokens[:-1], mx.uint32)[None], cache=cache[len(model.layers) :])
            mx.eval([c.state for c in cache])
        mx.random.seed(seed)
        out, accepted, forwards = [], 0, 0
        start = time.perf_counter()
        for token, _, from_draft in speculative_generate_step(
                mx.array(tokens[-1:], mx.uint32), model, draft, num_draft_tokens=self.num_draft,
                max_tokens=max_tokens, sampler=make_sampler(temp=temperature), prompt_cache=cache):
            if token in eos:
                break
            out.append(token)
            accepted += bool(from_draft)
            forwards += not from_draft
        # mlx-lm does not report drafted tokens; it drafts num_draft per verify (fewer only
        # near max_tokens), so forwards * num_draft is the count to within one step.
        drafted = forwards * self.num_draft
        return Run(out, time.perf_counter() - start, forwards, drafted, accepted)
