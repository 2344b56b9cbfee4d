"""`auto`: step by step, the proposal source expected to pay.

Order of preference, each only when the policy's estimate says it beats plain decoding:
1. the prompt / prediction n-gram match (free to propose; what edits, RAG and code copy),
2. the draft model, if one is loaded,
3. nothing: a plain step. A switched-off source is probed again now and then.
The choice and k come from one `AdaptiveK`, fed by the engine with every step's outcome and time.
"""

from __future__ import annotations

import mlx.core as mx

from ..policy import AdaptiveK
from ..sampling import SamplingParams
from .base import Proposal
from .draft import DraftModelProposer
from .ngram import NgramProposer


class AutoProposer:
    name = "auto"

    def __init__(self, model, draft_model=None, max_k: int = 8, min_ngram: int = 1,
                 max_ngram: int = 4):
        self.ngram = NgramProposer(min_ngram=min_ngram, max_ngram=max_ngram)
        self.draft = DraftModelProposer(draft_model) if draft_model is not None else None
        self.policy = AdaptiveK(max_k=max_k)

    def set_prediction(self, tokens: list[int] | None) -> None:
        self.ngram.set_prediction(tokens)

    def reset(self, prompt: list[int], sampling: SamplingParams) -> None:
        self.ngram.reset(prompt, sampling)
        if self.draft is not None:
            self.draft.reset(prompt, sampling)

    def propose(self, context: list[int], num_draft: int, key: mx.array | None) -> Proposal | None:
        proposal = self.ngram.propose(context, num_draft, key)
        if proposal is not None and self.policy.choose(proposal.source) > 0:
            return proposal
        if self.draft is not None:
            k = min(num_draft, self.policy.choose_or_probe("draft"))
            if k > 0:
                return self.draft.propose(context, k, key)
        # Let the engine's policy decide: a switched-off n-gram source is probed now and then.
        return proposal

    def update(self, context: list[int], num_accepted: int) -> None:
        self.ngram.update(context, num_accepted)
        if self.draft is not None:
            self.draft.update(context, num_accepted)
