"""A small draft model with the target's tokenizer proposes k tokens autoregressively.

The draft keeps its own cache. `cached` mirrors the tokens it holds, so a step only feeds what
the draft has not seen yet (the target's last token, plus the last drafted token when all k were
accepted) and a rejection is a rollback (`caches.rollback`: a trim, or for a recurrent draft a
restored state and the accepted tokens fed again).
"""

from __future__ import annotations

import time

import mlx.core as mx
import mlx.nn as nn

from .. import caches
from ..caches.prompt import common_prefix_len  # noqa: F401  (importable from here too)
from ..sampling import SamplingParams, probs_from_logits, sample
from .base import Proposal, Proposer

# A draft behind by more tokens than this catches up in a forward of its own (timed apart).
CATCH_UP_APART = 8


class DraftModelProposer(Proposer):
    name = "draft"
    cheap = False

    def __init__(self, draft_model: nn.Module, prefill_step_size: int = 512,
                 prefill_at_reset: bool = True):
        self.model = draft_model
        self.prefill_step_size = prefill_step_size
        # True: the prompt is prefilled (and evaluated) in `reset`, as prefill time. False
        # (auto, which may not use the draft in a request): the first `propose` catches up.
        self.prefill_at_reset = prefill_at_reset
        self.cache = caches.make_cache(draft_model)
        self.cached: list[int] = []
        self.sampling = SamplingParams()
        self._fed_drafts = 0  # draft tokens fed to the draft cache by the last propose
        self._checkpoint: caches.Checkpoint | None = None

    def reset(self, prompt: list[int], sampling: SamplingParams) -> None:
        self.sampling = sampling
        if self._fed_drafts:  # an interrupted step left speculative tokens in the cache
            caches.rollback(self.model, self.cache, self._checkpoint, [0] * self._fed_drafts, 0)
            self._fed_drafts, self._checkpoint = 0, None
        keep = common_prefix_len(self.cached, prompt[:-1])
        self._trim(len(self.cached) - keep)
        if self.prefill_at_reset:  # the prompt, as the target's prefill did
            self._feed(prompt[len(self.cached) : -1])
            mx.eval([c.state for c in self.cache])

    def _feed(self, tokens: list[int]) -> mx.array | None:
        """Append `tokens` to the draft cache in chunks; the logits after the last one."""
        logits = None
        for start in range(0, len(tokens), self.prefill_step_size):
            chunk = tokens[start : start + self.prefill_step_size]
            logits = self.model(mx.array(chunk, mx.uint32)[None], cache=self.cache)[0, -1]
            if start + len(chunk) < len(tokens):
                mx.eval([c.state for c in self.cache])
            self.cached += chunk
        return logits

    def _trim(self, num: int) -> None:
        """Forget the last `num` committed tokens (start over when the cache cannot trim)."""
        if num <= 0:
            return
        if caches.trim_exact(self.cache, num):
            del self.cached[len(self.cached) - num :]
        else:
            self.cache, self.cached = caches.make_cache(self.model), []

    def _next(self, logits: mx.array, key: mx.array | None):
        if self.sampling.greedy:
            return mx.argmax(logits, axis=-1), None
        q = probs_from_logits(logits, self.sampling)
        return sample(q, key), q

    def propose(self, context: list[int], num_draft: int, key: mx.array | None,
                source: str | None = None) -> Proposal | None:
        if num_draft < 1:
            return None
        if len(self.cached) >= len(context):  # need at least one token to get logits from
            self._trim(len(self.cached) - len(context) + 1)
        # Usually the target's last token (and the last draft when all were accepted); more
        # when `auto` skipped this proposer for a while: that catch-up is a prefill, timed
        # apart so that the step is not charged with it (`Proposal.setup_seconds`).
        setup = 0.0
        if len(context) - len(self.cached) > CATCH_UP_APART:
            start = time.perf_counter()
            self._feed(context[len(self.cached) : -1])
            mx.eval([c.state for c in self.cache])
            setup = time.perf_counter() - start
        logits = self._feed(context[len(self.cached) :])
        self._checkpoint = caches.checkpoint(self.cache)
        keys = mx.random.split(key, num_draft) if key is not None else [None] * num_draft
        tokens, probs = [], []
        for i in range(num_draft):
            token, q = self._next(logits, keys[i])
            tokens.append(token)
            probs.append(q)
            if i + 1 < num_draft:
                logits = self.model(token.reshape(1, 1), cache=self.cache)[0, -1]
            mx.async_eval(token)
        # The draft cache now also holds tokens[:-1]; their values are known only after verify.
        self._fed_drafts = num_draft - 1
        draft_probs = None if self.sampling.greedy else mx.stack(probs)
        return Proposal(tokens=mx.stack(tokens), draft_probs=draft_probs, source="draft",
                        setup_seconds=setup)

    def update(self, context: list[int], num_accepted: int) -> None:
        if not self._fed_drafts:
            return
        kept = min(num_accepted, self._fed_drafts)
        start = len(self.cached)
        # The fed drafted tokens that were accepted are in `context` now; the others are not
        # known on the host (rejected), but rollback re-feeds only accepted ones.
        fed = context[start : start + kept] + [0] * (self._fed_drafts - kept)
        caches.rollback(self.model, self.cache, self._checkpoint, fed, kept)
        self.cached += context[start : start + kept]
        self._fed_drafts = 0
        self._checkpoint = None
