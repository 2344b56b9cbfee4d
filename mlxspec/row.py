"""One request in the decode loop: a row of a `BatchSpeculator`. It holds what the request
committed (`context`), its proposer and its side of the planning (`RowPolicy`), its sampling
and seed, and the text its steps produced (detokenized as committed). The batch steps it and
hands it back its tokens (`commit`); it holds no reference to the batch: whoever opened it
closes it through the batch (`BatchSpeculator.close`), which gives its cache back to the
prompt cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

from .caches.prompt import PromptCache
from .choose_k import RowOffer
from .cost import StepCost
from .planning import RowPolicy
from .policy import AdaptiveK, Policy
from .proposers import auto
from .proposers.base import Proposer
from .proposers.draft import DRAFT_ARMS, TREE, draft_proposer
from .sampling import SamplingParams
from .stats import Stats
from .step import draw_next
from .stopstrings import Detokenizer, StepOutput

if TYPE_CHECKING:
    from .engine import Engine


class BatchRow:
    """One request in a `BatchSpeculator`: `step()` commits its tokens and returns them."""

    def __init__(self, engine: Engine | None, pc: PromptCache, context: list[int],
                 proposer: Proposer | None, policy: Policy, sampling: SamplingParams,
                 seed: int | None, stats: Stats, end: int, num_draft: int, stops: list[str],
                 cost: StepCost):
        self.engine, self.pc = engine, pc
        self.context, self.proposer = context, proposer
        self.planner = RowPolicy(policy, proposer, cost=cost)
        # A sampled row with a seed draws by position (`sampling.keyed_draw`): the same tokens
        # whatever is proposed, accepted or batched with it. Without one: MLX's generator.
        self.seed = None if sampling.greedy else seed
        self.sampling, self.stats = sampling, stats
        self.end, self.num_draft = end, num_draft
        self.draft = None  # its DraftModelProposer, while that drafts in the batch's DraftRows
        # (request, tokens reused, seconds prefilling) until it joins; `chunk`: tokens per step
        self.opening: tuple | None = None
        self.chunk: int | None = None
        # What this step produced: detokenized as committed (a row stops at its end at once)
        self.outputs: list[StepOutput] = []
        self.shares = False  # may share a batch with other rows (`shareable`, set at `open`)
        self.error: BaseException | None = None
        self.closed = False
        self.detok = None if engine is None else Detokenizer(engine.tokenizer, stops, stats)
        # It has not ended, left or failed: kept as each of those happens (read every step)
        self.wants = len(context) < end

    @property
    def ended(self) -> bool:
        """It has ended (an end-of-sequence token, a stop string, max_tokens)."""
        return self.detok is not None and self.detok.done

    def fail(self, e: BaseException) -> None:
        """Its step or prefill failed: `output` raises `e`."""
        self.error, self.wants = e, False

    def available(self, trees: bool = False) -> dict[str, int] | None:
        """Its proposer's offer per source, k <= remaining - 1 (None: no proposal can be); a
        draft tree only where the row's cache can verify one (`trees`)."""
        cap = min(self.num_draft, self.planner.policy.max_k, self.end - len(self.context) - 1)
        if self.proposer is None or cap <= 0:
            return None
        self.planner.at(len(self.context) - 1)  # (its cache holds all but the last token)
        offered = self.proposer.available(self.context, cap)
        if TREE in offered and not self.proposer.uses_trees and not trees:
            offered = {s: n for s, n in offered.items() if s != TREE}
        policy = self.planner.policy
        if "draft" in offered and isinstance(policy, AdaptiveK) and (
                draft := draft_proposer(self.proposer)) is not None:
            # (at the target's prefill time per token, as the engine last measured it)
            per_token = getattr(self.engine, "prefill_seconds_per_token", 0.0)
            if not auto.catch_up_pays(policy, len(self.context) - len(draft.cached),
                                      self.end - len(self.context), per_token):
                offered = {s: n for s, n in offered.items() if s not in DRAFT_ARMS}
        return offered

    def offer(self) -> tuple[str, RowOffer]:
        """The source this row would propose from and what it offers the batch's policy (a
        shared batch: no trees)."""
        return self.planner.offer(self.available() or {}, self.context)

    def first_draw(self, logits: mx.array) -> mx.array:
        """The row's first token (lazy, shape (1,)), drawn as a plain step draws it."""
        seed_at = None if self.seed is None else (self.seed, len(self.context))  # `step.SeedAt`
        return draw_next(logits[None], [self.sampling], [seed_at])

    def commit(self, tokens: list[int], arm: str = "", source: str = "", drafted: int = 0,
               accepted: int = 0, seconds: float | None = None, observe: bool = True) -> None:
        """Commit a step's tokens (`arm`: the plan's source, `source`: the proposal's); its
        proposer, policies (not for its prefill's token) and stats are told (its draft's rows
        by the batch, `BatchSpeculator`)."""
        context = self.context
        context.extend(tokens)
        if self.proposer is not None:
            self.proposer.update(context, accepted)
            if observe:
                self.planner.observe(arm, drafted, accepted, seconds, context)
        record_step(self.stats, source, drafted, accepted, len(tokens))
        detok = self.detok
        if detok is None:  # a raw row (tests, tools): tokens only
            self.outputs.append(StepOutput("", list(tokens), self.stats))
        elif not detok.done:
            sampling = self.sampling
            logprobs = None if sampling.logprobs is None else sampling.take_logprobs(
                len(context) - len(tokens), len(tokens))
            self.outputs.append(detok.feed(tokens, len(context) >= self.end, logprobs))
        self.wants = (len(context) < self.end and (detok is None or not detok.done)
                      and not self.closed and self.error is None)

    def output(self, produced: dict[BatchRow, StepOutput]) -> StepOutput | None:
        """Its output in what a `step()` produced (None: none this step); raises the error of
        a step or a prefill that failed."""
        if self.error is not None:
            raise self.error
        return produced.get(self)

    def finish(self) -> None:
        """It left its batch (`BatchSpeculator.close`): its proposer is told."""
        self.closed, self.wants = True, False
        if self.proposer is not None:
            self.proposer.finish()  # the answer is in the suffix store for the next request


def record_step(stats: Stats, source: str, drafted: int, accepted: int, emitted: int) -> None:
    """A step's target forward, tokens, and drafted and accepted tokens (by position and by
    source) in a request's `stats`."""
    stats.target_forwards += 1
    stats.generated_tokens += emitted
    if not drafted:
        return
    stats.drafted += drafted
    stats.accepted += accepted
    grow = drafted - len(stats.drafted_by_position)
    if grow > 0:
        stats.drafted_by_position += [0] * grow
        stats.accepted_by_position += [0] * grow
    for i in range(drafted):
        stats.drafted_by_position[i] += 1
    for i in range(accepted):
        stats.accepted_by_position[i] += 1
    stats.drafted_by_source[source] = stats.drafted_by_source.get(source, 0) + drafted
    stats.accepted_by_source[source] = stats.accepted_by_source.get(source, 0) + accepted
