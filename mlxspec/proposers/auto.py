"""`auto`: step by step, the proposal source expected to pay.

Sources: the prompt / prediction n-gram match (free to propose; what edits, RAG and code copy),
the text of earlier requests and answers (`suffix.py`, arms `suffix:N`; what editors, agents
and chat repeat across requests) and the draft model, if one is loaded. Which one, and k, is decided by the engine's one policy
(`AdaptiveK`), from what each source offers this step and its measured acceptance and cost;
a plain step when none is expected to beat plain decoding.
"""

from __future__ import annotations

from ..sampling import SamplingParams
from .base import Proposal, Proposer
from .draft import CONTINUED, DRAFT_ARMS, TREE, DraftModelProposer
from .ngram import NgramProposer
from .suffix import _OWN, SuffixProposer


class AutoProposer(Proposer):
    name = "auto"
    adaptive = True  # the engine gives it an AdaptiveK policy whatever `adaptive` says

    def __init__(self, model, draft_model=None, min_ngram: int = 1, max_ngram: int = 4,
                 suffix: bool = True, store=_OWN, draft_variants: bool = False):
        self.ngram = NgramProposer(min_ngram=min_ngram, max_ngram=max_ngram)
        # The current request's own text is prompt lookup's: the suffix source reads the store.
        self.suffix = SuffixProposer(store=store, local=False) if suffix else None
        # The draft is not prefilled with each prompt: most requests may never probe it, and a
        # prefill left lazy would be computed, with every other one chained to it, at the next
        # probe. Its first proposal in a request catches up on the context instead.
        self.draft = (DraftModelProposer(draft_model, prefill_at_reset=False)
                      if draft_model is not None else None)
        # The draft's tree and lookup's chain continued by the draft as arms too: exact, but
        # off by default: on the coder pair on 2 CPU cores the policy took them where prompt
        # lookup paid more (fim 1.22x against lookup's 2.51x, docs/PERFORMANCE.md).
        self.draft_variants = draft_variants

    def set_prediction(self, tokens: list[int] | None) -> None:
        self.ngram.set_prediction(tokens)

    def set_store(self, store) -> None:
        """The suffix source's store from the next generation on (None: none)."""
        if self.suffix is not None:
            self.suffix.set_store(store)

    def set_fim(self, suffix: int | None, middle: int | None) -> None:
        if self.suffix is not None:
            self.suffix.set_fim(suffix, middle)

    def finish(self) -> None:
        if self.suffix is not None:
            self.suffix.finish()

    def reset(self, prompt: list[int], sampling: SamplingParams) -> None:
        self.ngram.reset(prompt, sampling)
        if self.suffix is not None:
            self.suffix.reset(prompt, sampling)
        if self.draft is not None:
            self.draft.reset(prompt, sampling)

    def available(self, context: list[int], cap: int) -> dict[str, int]:
        lookup = self.ngram.available(context, cap)
        offered = dict(lookup)
        if self.suffix is not None:
            offered.update(self.store_offer(context, cap, offered))
        if self.draft is not None and cap > 0:
            offered["draft"] = cap
            if not self.draft_variants:
                return offered
            offered[TREE] = cap  # (where the row's cache can verify trees: `BatchRow.available`)
            if 0 < max(lookup.values(), default=0) < cap and self.draft.continues():
                offered[CONTINUED] = cap  # lookup's chain, the draft drafting on after it
        return offered

    def store_offer(self, context: list[int], cap: int, lookup: dict[str, int]) -> dict[str, int]:
        """The suffix source's offer where it proposes other or more tokens than prompt
        lookup (`lookup`: its offer); both offered, the policy takes the one whose measured
        acceptance and length pay more. The store often holds what the prompt holds (a chat
        re-sends its answers, an agent its last exchange): offered too, the same tokens would
        split one source's measurements in two and cost the new arms' probes (0.93x `auto`
        without the store on a replayed chat)."""
        offer = self.suffix.available(context, cap)
        if not offer or not lookup:
            return offer
        ((arm, n),) = offer.items()
        ours = self.ngram.peek(context, cap, next(iter(lookup)))
        theirs = self.suffix.peek(context, n, arm)
        if ours and theirs and len(theirs) <= len(ours) and ours[: len(theirs)] == theirs:
            return {}
        return offer

    def propose(self, context: list[int], num_draft: int, seed: int | None,
                source: str | None = None) -> Proposal | None:
        if source in ("draft", TREE) and self.draft is not None:
            return self.draft.propose(context, num_draft, seed, source)
        if source == CONTINUED and self.draft is not None:
            chain = self.ngram.propose(context, num_draft - 1, None)
            if chain is None or not len(chain):
                return self.draft.propose(context, num_draft, seed)
            return self.draft.propose_after(context, chain.tokens.tolist(), num_draft, seed)
        if source and source.startswith("suffix") and self.suffix is not None:
            return self.suffix.propose(context, num_draft, seed, source)
        return self.ngram.propose(context, num_draft, seed)

    def peek(self, context: list[int], num_draft: int, source: str) -> list[int] | None:
        if source in DRAFT_ARMS:
            return None
        if source.startswith("suffix") and self.suffix is not None:
            return self.suffix.peek(context, num_draft, source)
        return self.ngram.peek(context, num_draft, source)

    def update(self, context: list[int], num_accepted: int) -> None:
        self.ngram.update(context, num_accepted)
        if self.suffix is not None:
            self.suffix.update(context, num_accepted)
        if self.draft is not None:
            self.draft.update(context, num_accepted)
