"""`auto`: step by step, the proposal source expected to pay.

Sources: the prompt / prediction n-gram match (free to propose; what edits, RAG and code copy),
the text of earlier requests and answers (`suffix.py`, arms `suffix:N`; what editors, agents
and chat repeat across requests) and the draft model, if one is loaded. Which one, and k, is decided by the engine's one policy
(`AdaptiveK`), from what each source offers this step and its measured acceptance and cost;
a plain step when none is expected to beat plain decoding.
"""

from __future__ import annotations

from mlx.utils import tree_flatten

from ..cost import PRIOR, StepCost
from ..policy import AdaptiveK
from ..sampling import SamplingParams
from .base import Proposal, Proposer
from .draft import CONTINUED, DRAFT_ARMS, TREE, TREE_WIDTH, DraftModelProposer
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


# -- auto's draft model: its priors, and whether its catch-up on skipped context pays

# A draft of the target's own family with at least this fraction of its parameters starts from
# SAME_FAMILY_ACCEPT per position: Qwen2.5-Coder-0.5B for the 1.5B (0.32 of it) accepts 86-94 %
# of its drafts on code, and 68 % on chat at k = 4 (3.48 tokens per forward: 0.85 per
# position, each given the ones before; docs/PERFORMANCE.md); smaller drafts, such as the
# bundled 0.8 M one for its 6.4 M target, keep the pessimistic prior and are probed.
SAME_FAMILY_MIN_RATIO = 0.2
SAME_FAMILY_ACCEPT = 0.85
# A draft the estimates keep off is probed only where its catch-up costs at most this share of
# the request's plain decoding time (`catch_up_pays`)
PROBE_CATCH_UP = 0.02
# Before any step is measured, a plain decode step is taken to cost at least this many times the
# target's prefill time per token: a lower bound (14-24x measured for the coder 1.5B on this
# CPU, docs/PERFORMANCE.md), so that a fresh process's first request judges its draft's catch-up
DECODE_OVER_PREFILL = 8.0
# Until its first position was reached this often, a draft the estimates turn on is judged at
# this acceptance per position (a prior judged it would keep a draft off for good where
# requests are short: nothing would measure it)
CATCH_UP_MEASURED, CATCH_UP_ACCEPT = 4.0, 0.9


def draft_priors(target, draft_proposer) -> dict:
    """`AdaptiveK` settings for auto's draft model: the acceptance a same-family draft earns;
    and (`forward_prior`, for the engine's `StepCost`, relative to a target step) a cost per
    drafted token of the draft's share of the target's parameters (0.34 measured for the coder
    pair, 0.32 by parameters; a tree's forward also has the target verify W rows per depth)."""
    draft = getattr(draft_proposer, "model", None)
    if draft is None:
        return {}
    sizes = [sum(v.size for _, v in tree_flatten(m.parameters())) for m in (draft, target)]
    ratio = sizes[0] / max(sizes[1], 1)
    priors = {"forward_prior": {"draft": ratio, CONTINUED: ratio,
                                TREE: ratio + PRIOR[2] * (TREE_WIDTH - 1)},
              "variants": {"draft": TREE}, "draft_ratio": ratio}
    family = [getattr(getattr(m, "args", None), "model_type", None) for m in (target, draft)]
    if family[0] is not None and family[0] == family[1] and ratio >= SAME_FAMILY_MIN_RATIO:
        priors["group_prior_accept"] = {"draft": SAME_FAMILY_ACCEPT,
                                        TREE: SAME_FAMILY_ACCEPT,
                                        CONTINUED: SAME_FAMILY_ACCEPT}
    return priors


def draft_policy(target, draft_proposer, cost: StepCost | None = None, **kwargs) -> AdaptiveK:
    """`AdaptiveK` on `cost` (the engine's) with `draft_priors`, the draft's forward cost
    prior put in `cost`; `kwargs`: other settings (max_k)."""
    cost = cost or StepCost()
    priors = draft_priors(target, draft_proposer)
    cost.forward_prior.update(priors.pop("forward_prior", {}))
    return AdaptiveK(cost=cost, **priors, **kwargs)


def catch_up_pays(policy: AdaptiveK, behind: int, remaining: int,
                  prefill_per_token: float) -> bool:
    """Whether a draft that has not read the last `behind` tokens (auto's draft reads a
    request's prompt at its first proposal) repays that catch-up, at its share of the target's
    prefill per token, over the `remaining` tokens the request may generate: by the time per
    token it is expected to save at its best k (at CATCH_UP_ACCEPT until measured; where the
    estimates keep it off, only a catch-up within PROBE_CATCH_UP of the request's plain time
    is worth a probe). On the coder pair here a 40-token fill-in-the-middle answer after
    1,400 prompt tokens cannot repay 13 s of catch-up; a chat answer can."""
    if not policy.draft_ratio or prefill_per_token <= 0:
        return True
    catch_up = behind * prefill_per_token * policy.draft_ratio
    measured = policy.cost.seconds  # else a plain step at its lower bound
    plain = policy.plain_time() if measured else DECODE_OVER_PREFILL * prefill_per_token
    if catch_up <= plain:  # a few tokens behind
        return True
    k = policy.choose("draft", max(1, remaining - 1))
    if k == 0:
        return catch_up <= remaining * plain * PROBE_CATCH_UP
    if policy.measured("draft") < CATCH_UP_MEASURED:  # judged as a draft that pays would
        expected = sum(CATCH_UP_ACCEPT ** i for i in range(k + 1))
    else:
        expected = policy.expected_tokens("draft", k)
    saved = plain * (1.0 - policy.step_time("draft", k) / policy.plain_time() / expected)
    return catch_up <= remaining * saved


def catch_up_at_start(policy, behind: int, remaining: int, prefill_per_token: float) -> bool:
    """Whether auto's draft reads the prompt with the target's prefill: where its catch-up
    pays over the whole request (its first proposal would catch up anyway, timed as
    decoding)."""
    return (isinstance(policy, AdaptiveK) and policy.draft_ratio > 0 and prefill_per_token > 0
            and behind > 0 and catch_up_pays(policy, behind, remaining, prefill_per_token))
