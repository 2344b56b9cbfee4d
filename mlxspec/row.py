"""One request in the decode loop: a row of a `BatchSpeculator`. It holds its request (tokens,
sampling, proposer, policy, prompt cache), what it committed (`context`), its side of the
planning (`RowPolicy`) and the text its steps produced (detokenized as committed). Its life is
one state, changed by its own methods only (admission and the batch ask them):

    opening ──> decoding ──> finished
       │  ^         │
       v  │         └──────> failed   (and from any state: closed, by `leave`)
    prefilling

`opening`: its prompt's rest is prefilled with the round's other joiners at the next step;
`prefilling`: a long prompt, a chunk per step; `decoding`: each step commits its tokens;
`finished`: an end-of-sequence token, a stop string or max_tokens; `failed`: a step or its
prefill raised (`output` raises it); `closed`: it left its batch (`BatchSpeculator.close`),
which gave its cache back to its prompt cache. It holds no reference to the batch.
"""

from __future__ import annotations

import time

import mlx.core as mx

from .cost import StepCost
from .planning import RowOffer, RowPolicy
from .policy import AdaptiveK
from .proposers import auto
from .proposers.draft import DRAFT_ARMS, TREE, draft_proposer
from .request import Request
from .step import draw_next
from .stopstrings import Detokenizer, StepOutput, merged
from .target import Target

OPENING, PREFILLING, DECODING = "opening", "prefilling", "decoding"
FINISHED, FAILED, CLOSED = "finished", "failed", "closed"
LIVE = (OPENING, PREFILLING, DECODING)  # not ended, failed or left


class BatchRow:
    """One request in a `BatchSpeculator`: `step()` commits its tokens and returns them.
    `target` None: a raw row (tests, tools), tokens without text."""

    def __init__(self, request: Request, target: Target | None, cost: StepCost):
        self.request, self.target = request, target
        self.pc, self.proposer, self.stats = request.pc, request.proposer, request.stats
        self.sampling = request.sampling
        self.context = list(request.tokens)
        self.planner = RowPolicy(request.policy, request.proposer, cost=cost)
        # A sampled row with a seed draws by position (`sampling.keyed_draw`): the same tokens
        # whatever is proposed, accepted or batched with it. Without one: MLX's generator.
        self.seed = None if self.sampling.greedy else request.seed
        self.end, self.num_draft = request.end, request.k_cap
        self.shares = request.shares
        self._enter(DECODING if len(self.context) < self.end else FINISHED)
        self.error: BaseException | None = None  # what a failed row's `output` raises
        self.reused = 0  # prompt tokens reused from its prompt cache (`opening`)
        self.prefill_seconds = 0.0  # spent prefilling so far
        self.chunk = 0  # prompt tokens prefilled per step (`prefilling`)
        # What its steps produced since the batch last asked (`take_output`)
        self.outputs: list[StepOutput] = []
        self.detok = (None if target is None
                      else Detokenizer(target.tokenizer, request.stops, self.stats))

    # -- its life
    def opened(self, reused: int, seconds: float, chunk: int = 0) -> None:
        """Checked, `reused` prompt tokens back from its prompt cache in `seconds`: its rest is
        prefilled with the next round (`chunk` > 0: that many tokens a step)."""
        self._enter(PREFILLING if chunk else OPENING)
        self.reused, self.prefill_seconds, self.chunk = reused, seconds, chunk

    def prefilled_part(self, seconds: float) -> None:
        """A chunk of its prompt was prefilled."""
        self.prefill_seconds += seconds

    def joins_round(self) -> None:
        """Its rest fits a round: prefilled with the other joiners at the next step."""
        self._enter(OPENING)

    def started(self, first: int | None = None) -> None:
        """Prefilled, its proposer started: it decodes; with its `first` token where a group's
        forward drew it."""
        self._enter(DECODING)
        if first is not None:
            self.commit([first], observe=False)

    def joined(self) -> None:
        """It joined its batch: decoding starts now."""
        if self.detok is not None:
            self.detok.restart()

    def fail(self, e: BaseException) -> None:
        """Its step or prefill failed: `output` raises `e`."""
        if self.state != CLOSED:
            self._enter(FAILED)
        self.error = e

    def leave(self) -> bool:
        """It left its batch (`BatchSpeculator.close`): its proposer is told; False if it had
        already."""
        if self.state == CLOSED:
            return False
        self._enter(CLOSED)
        if self.proposer is not None:
            self.proposer.finish()  # the answer is in the suffix store for the next request
        return True

    @property
    def wants(self) -> bool:
        """It decodes: the next step commits tokens for it."""
        return self.state == DECODING

    def _enter(self, state: str) -> None:
        self.state = state
        # it has not ended, failed or left (it may still be prefilling): read every step
        self.live = state in LIVE

    @property
    def waiting(self) -> bool:
        """Its prompt is still being prefilled."""
        return self.state in (OPENING, PREFILLING)

    @property
    def ended(self) -> bool:
        """It has ended (an end-of-sequence token, a stop string, max_tokens)."""
        return self.detok is not None and self.detok.done

    # -- a step
    def available(self, trees: bool = False) -> dict[str, int] | None:
        """Its proposer's offer per source, k <= remaining - 1 (None: no proposal can be); a
        draft tree only where the row's cache can verify one (`trees`)."""
        cap = min(self.num_draft, self.planner.policy.max_k, self.end - len(self.context) - 1)
        if self.proposer is None or cap <= 0:
            return None
        # (its cache holds all but the last token; a grammar's plain steps are synced)
        self.planner.at(len(self.context) - 1, not self.sampling.stateful)
        offered = self.proposer.available(self.context, cap)
        if TREE in offered and not self.proposer.uses_trees and not trees:
            offered = {s: n for s, n in offered.items() if s != TREE}
        policy = self.planner.policy
        if "draft" in offered and isinstance(policy, AdaptiveK) and (
                draft := draft_proposer(self.proposer)) is not None:
            # (at the target's prefill time per token, as last measured)
            per_token = self.target.meter.seconds_per_token if self.target else 0.0
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
               accepted: int = 0, seconds: float | None = None, observe: bool = True,
               setup_seconds: float = 0.0) -> None:
        """Commit a step's tokens (`arm`: the plan's source, `source`: the proposal's;
        `setup_seconds`: its proposer's catch-up); its proposer, policies (not for its
        prefill's token) and stats are told."""
        context = self.context
        context.extend(tokens)
        probe = False
        if self.proposer is not None:
            self.proposer.update(context, accepted)
            if observe:
                probe = drafted > 0 and self.planner.probing(arm)  # (asked before it learns)
                self.planner.observe(arm, drafted, accepted, seconds, context)
        detok = self.detok
        if detok is None:  # a raw row: tokens only
            self.stats.record_step(source, drafted, accepted, len(tokens))
            self.outputs.append(StepOutput("", list(tokens), self.stats))
        elif not detok.done:
            sampling = self.sampling
            logprobs = None if sampling.logprobs is None else sampling.take_logprobs(
                len(context) - len(tokens), len(tokens))
            # a step's accepted proposal, then the target's own token(s)
            sources = [source or "target"] * accepted + ["target"] * (len(tokens) - accepted)
            out = detok.feed(tokens, len(context) >= self.end, logprobs, sources)
            # (the peak once per answer: reading it is a call into MLX)
            self.stats.record_step(source, drafted, accepted, len(out.tokens),
                                   time.perf_counter() - detok.start,
                                   mx.get_peak_memory() / 1e9 if detok.done else None,
                                   probe, setup_seconds)
            self.outputs.append(out)
        else:  # (past its end)
            self.stats.record_step(source, drafted, accepted, len(tokens))
        if self.live and (len(context) >= self.end or (detok is not None and detok.done)):
            self._enter(FINISHED)

    def take_output(self) -> StepOutput | None:
        """What its steps produced since the last call, as one output (None: nothing)."""
        outs = self.outputs
        if not outs:
            return None
        self.outputs = []
        return outs[0] if len(outs) == 1 else merged(outs)

    def output(self, produced: dict[BatchRow, StepOutput]) -> StepOutput | None:
        """Its output in what a `step()` produced (None: none this step); raises the error of
        a step or a prefill that failed."""
        if self.error is not None:
            raise self.error
        return produced.get(self)
