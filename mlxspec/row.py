"""One request in the decode loop: a row of a `BatchSpeculator`. It holds what the request
committed (`context`), its proposer and its side of the planning (`RowPolicy`), its sampling
and seed, and the text its steps produced (detokenized as committed). The batch steps it and
hands it back its tokens (`commit`); closing it gives its cache back to the prompt cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

from .caches.prompt import PromptCache
from .policy import AdaptiveK, Policy, RowOffer, RowPolicy
from .proposers.base import Proposer
from .proposers.draft import DRAFT_ARMS, TREE, draft_proposer
from .sampling import SamplingParams
from .stats import Stats
from .step import draw_next
from .stopstrings import Detokenizer, StepOutput

if TYPE_CHECKING:
    from .batch_step import BatchSpeculator
    from .engine import Engine


class BatchRow:
    """One request in a `BatchSpeculator`: `step()` commits its tokens and returns them."""

    def __init__(self, batch: BatchSpeculator, engine: Engine | None, pc: PromptCache,
                 context: list[int], proposer: Proposer | None, policy: Policy,
                 sampling: SamplingParams, seed: int | None, stats: Stats, end: int,
                 num_draft: int, stops: list[str]):
        self.batch, self.engine, self.pc = batch, engine, pc
        self.context, self.proposer = context, proposer
        self.planner = RowPolicy(policy, proposer, batched=not batch.row_plans,
                                 cost=batch.policy.cost)
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

    @property
    def ended(self) -> bool:
        """It has ended (an end-of-sequence token, a stop string, max_tokens)."""
        return self.detok is not None and self.detok.done

    @property
    def exhausted(self) -> bool:
        return len(self.context) >= self.end

    @property
    def wants(self) -> bool:
        """It has not ended, left or failed."""
        return not (self.closed or self.ended or self.exhausted or self.error is not None)

    @property
    def wants_two(self) -> bool:
        """It wants a token after the next one (a queued step may feed it)."""
        return self.wants and len(self.context) + 2 <= self.end

    def available(self) -> dict[str, int] | None:
        """Its proposer's offer per source, k <= remaining - 1 (None: no proposal can be); a
        draft tree only where the row's cache can verify one."""
        cap = min(self.num_draft, self.planner.policy.max_k, self.end - len(self.context) - 1)
        if self.proposer is None or cap <= 0:
            return None
        self.planner.at(len(self.context) - 1)  # (its cache holds all but the last token)
        offered = self.proposer.available(self.context, cap)
        if TREE in offered and not self.proposer.uses_trees and not self.batch.verifies_trees():
            offered = {s: n for s, n in offered.items() if s != TREE}
        policy, draft = self.planner.policy, draft_proposer(self.proposer)
        if "draft" in offered and isinstance(policy, AdaptiveK) and draft is not None:
            # (at the target's prefill time per token, as the engine last measured it)
            per_token = getattr(self.engine, "prefill_seconds_per_token", 0.0)
            if not policy.catch_up_pays(len(self.context) - len(draft.cached),
                                        self.end - len(self.context), per_token):
                offered = {s: n for s, n in offered.items() if s not in DRAFT_ARMS}
        return offered

    def offer(self) -> tuple[str, RowOffer]:
        """The source this row would propose from and what it offers the batch's policy."""
        return self.planner.offer(self.available() or {}, self.context)

    def seed_at(self, ahead: int = 0) -> tuple[int, int] | None:
        """(seed, position of its next token) for a keyed row, else None (`step.SeedAt`);
        `ahead`: tokens fed to it that are not read back yet."""
        return None if self.seed is None else (self.seed, len(self.context) + ahead)

    def first_draw(self, logits: mx.array) -> mx.array:
        """The row's first token (lazy, shape (1,)), drawn as a plain step draws it."""
        return draw_next(logits[None], [self.sampling], [self.seed_at()])

    def commit(self, tokens: list[int], arm: str = "", source: str = "", drafted: int = 0,
               accepted: int = 0, seconds: float | None = None, observe: bool = True) -> None:
        """Commit a step's tokens (`arm`: the plan's source, `source`: the proposal's); its
        draft, proposer, policies (not for its prefill's token) and stats are told."""
        self.context.extend(tokens)
        if self.draft is not None and source == "draft":
            self.batch.drafts[id(self.draft.model)].update(self.draft, self.context, accepted)
        if self.proposer is not None:
            self.proposer.update(self.context, accepted)
        if observe:
            self.planner.observe(arm, drafted, accepted, seconds, self.context)
        self.stats.record_step(source, drafted, accepted, len(tokens))
        if self.detok is None:  # a raw row (tests, tools): tokens only
            self.outputs.append(StepOutput("", list(tokens), self.stats))
        elif not self.detok.done:
            self.outputs.append(self.detok.feed(tokens, last=self.exhausted))

    def output(self, produced: dict[BatchRow, StepOutput]) -> StepOutput | None:
        """Its output in what a `step()` produced (None: none this step); raises the error of
        a step or a prefill that failed."""
        if self.error is not None:
            raise self.error
        return produced.get(self)

    def close(self) -> None:
        """Leave; the prompt cache gets the row's cache (every committed token but the last)."""
        if self.closed:
            return
        self.closed = True
        self.batch.leave(self)
        if self.proposer is not None:
            self.proposer.finish()  # the answer is in the suffix store for the next request
