"""Per-request policies: the source and k (tokens to propose) per step. `FixedK` always
proposes k; `AdaptiveK` maximises expected tokens per second from measured acceptance and the
engine's one cost model (`cost.py`; formulas, probe schedule: docs/HOW_IT_WORKS.md, `auto.py`
under "Proposers").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from ..errors import MlxspecError
from ..proposal import DRAFT_TREE, LOOKUP_DRAFT
from .cost import PRIOR, RowOffer, StepCost, choose_ks, cost_group, forward_group, survival

DEFAULT_NUM_DRAFT = 4  # k of the fixed-k modes unless num_draft (-k) sets one
AUTO_MAX_K = 8  # auto's cap on k unless num_draft (-k) sets one
MAX_NUM_DRAFT = 64  # the most tokens a step may propose (num_draft, -k)


def check_num_draft(num_draft: int) -> None:
    if not 1 <= num_draft <= MAX_NUM_DRAFT:
        raise MlxspecError(f"num_draft must be between 1 and {MAX_NUM_DRAFT}, got {num_draft}")


class Policy(Protocol):
    """Asked once per step (`plan`), told how it went (`observe`; `observe_plain` per token of
    a plain stretch); per request, or per batch row (where `BatchPolicy` chooses k)."""

    max_k: int

    def plan(self, available: dict[str, int]) -> tuple[str, int]: ...

    def observe(self, source: str, drafted: int, accepted: int,
                seconds: float | None) -> None: ...

    def observe_plain(self, tokens: int) -> None: ...


@dataclass
class FixedK:
    """Always propose `max_k` tokens (fewer near max_tokens), from the first source."""

    max_k: int = 4

    def plan(self, available: dict[str, int]) -> tuple[str, int]:
        for source, n in available.items():
            if n > 0:
                return source, min(n, self.max_k)
        return "", 0

    def observe(self, source: str, drafted: int, accepted: int,
                seconds: float | None) -> None:
        pass

    def observe_plain(self, tokens: int) -> None:
        pass


@dataclass
class SourceEstimate:
    """Decayed counts of (reached, accepted) per draft position."""

    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)


@dataclass
class Probe:
    interval: float
    due: float  # the token clock at which the arm may be probed again


@dataclass
class AdaptiveK:
    """Source and k per step from measured acceptance per arm (`ngram:4`) and the step's cost
    (`cost`, the engine's: shared with every row and batch). Set `span`, the row's cached
    length, before asking."""

    max_k: int = 8
    decay: float = 0.99  # per observation (~100 steps of memory): follows content as it changes
    prior_accept: float = 0.5
    # a draft model costs a forward per token: off (probed at once) until its acceptance is
    # known, unless it is a sizeable model of the target's family (`draft_priors`)
    group_prior_accept: dict[str, float] = field(
        default_factory=lambda: {"draft": 0.2, DRAFT_TREE: 0.2, LOOKUP_DRAFT: 0.2})
    prior_strength: float = 2.0  # pseudo-observations behind the acceptance prior
    plain_every: int = 128  # a plain stretch after this many synced steps without one
    probe_every: int = 16  # tokens between probes of a switched-off arm, at first
    probe_max: int = 256
    probe_budget: float = 0.005
    probe_k: int = 2
    switch_margin: float = 0.0  # a proposal must beat plain decoding by this fraction
    dither: bool = True  # every other step, k +- 1 around the best (flat there; see `plan`)
    # arm -> a variant of it (the draft -> its tree) taken every `explore_every`-th step while
    # the variant has been measured fewer than `explore_until` times: a variant that costs
    # more by its priors would otherwise never be measured
    variants: dict[str, str] = field(default_factory=dict)
    # the draft model's parameters over the target's (`draft_priors`): its catch-up on context
    # it has not read costs about that share of the target's prefill per token
    draft_ratio: float = 0.0
    explore_every: int = 8
    explore_until: float = 8.0
    cost: StepCost = field(default_factory=StepCost)
    span: int = 0  # the row's cached length (what a step's queries attend)
    sources: dict[str, SourceEstimate] = field(default_factory=dict)
    clock: float = 0.0  # tokens decoded under this policy
    probes: dict[str, Probe] = field(default_factory=dict)
    _steps: int = 0  # speculative steps observed
    _memo: dict = field(default_factory=dict)  # (arm, limit) -> k, while the estimates hold
    _memo_at: tuple = (0.0, 0)  # (plain step time, span) the memo was made at

    def accept_probs(self, source: str) -> list[float]:
        """P(accept position i | positions < i accepted), each shrunk towards the one before
        (so positions not tried yet borrow the nearest measured estimate)."""
        est = self.sources.get(source)
        probs, previous = [], self.group_prior_accept.get(cost_group(source), self.prior_accept)
        for i in range(self.max_k):
            reached = est.reached[i] if est and i < len(est.reached) else 0.0
            accepted = est.accepted[i] if est and i < len(est.accepted) else 0.0
            previous = (accepted + previous * self.prior_strength) / (reached + self.prior_strength)
            probs.append(previous)
        return probs

    def expected_tokens(self, source: str, k: int) -> float:
        total, survive = 1.0, 1.0
        for a in self.accept_probs(source)[:k]:
            survive *= a
            total += survive
        return total

    def _plain(self) -> float:
        return self.cost.plain(self.span)

    def step_time(self, source: str, k: int) -> float:
        """Predicted seconds of a step proposing k from `source` (0: a pipelined plain one)."""
        if k == 0:
            return self._plain()
        return self.cost.time(1, 1 + k, k, {forward_group(source): k}, self.span)

    def choose(self, source: str, limit: int | None = None) -> int:
        """The k <= limit with the highest expected tokens per second (0: do not speculate):
        the batch's rule (`choose_ks`) for a row alone."""
        limit = self.max_k if limit is None else min(limit, self.max_k)
        # Kept while the estimates hold: asked every step of a plain stretch, where only the
        # cost moves, a little (a full re-plan per source cost ~35 us a step)
        plain, (memo_plain, memo_span) = self._plain(), self._memo_at
        if abs(plain - memo_plain) > 0.02 * memo_plain or abs(self.span - memo_span) > 256:
            self._memo.clear()
            self._memo_at = (plain, self.span)
        hit = self._memo.get((source, limit))
        if hit is None:
            offer = RowOffer(survival(self.accept_probs(source), limit), forward_group(source))
            hit = choose_ks(self.cost, [offer], margin=self.switch_margin, span=self.span,
                            pipelined=True)[0][0]
            self._memo[(source, limit)] = hit
        return hit

    def catch_up_pays(self, behind: int, remaining: int, prefill_per_token: float) -> bool:
        """Whether a draft model that has not read the last `behind` tokens (auto's draft
        reads a request's prompt at its first proposal) can repay that catch-up, at its
        share of the target's prefill per token, over the `remaining` tokens the request may
        generate: by the time per token the draft is expected to save at its best k (at
        CATCH_UP_ACCEPT until measured; 0 where the estimates keep it off: then only a
        catch-up within PROBE_CATCH_UP of the request's plain time is worth a probe). Before
        any step is measured, a plain step is judged at its lower bound, DECODE_OVER_PREFILL
        times the prefill's time per token. On the coder pair here a 40-token
        fill-in-the-middle answer after 1,400 prompt tokens cannot repay 13 s of catch-up; a
        chat answer can."""
        if not self.draft_ratio or prefill_per_token <= 0:
            return True
        catch_up = behind * prefill_per_token * self.draft_ratio
        plain = self._plain() if self.cost.seconds else DECODE_OVER_PREFILL * prefill_per_token
        if catch_up <= plain:  # a few tokens behind
            return True
        k = self.choose("draft", max(1, remaining - 1))
        if k == 0:
            return catch_up <= remaining * plain * PROBE_CATCH_UP
        if self._measured("draft") < CATCH_UP_MEASURED:  # judged as a draft that pays would
            expected = sum(CATCH_UP_ACCEPT ** i for i in range(k + 1))
        else:
            expected = self.expected_tokens("draft", k)
        saved = plain * (1.0 - self.step_time("draft", k) / self._plain() / expected)
        return catch_up <= remaining * saved

    def catch_up_at_start(self, behind: int, remaining: int, prefill_per_token: float) -> bool:
        """Whether auto's draft should read the prompt with the target's prefill: where
        `catch_up_pays` over the whole request (its first proposal would catch up anyway,
        timed as decoding; the `draft` mode prefills its draft then)."""
        return (self.draft_ratio > 0 and prefill_per_token > 0 and behind > 0
                and self.catch_up_pays(behind, remaining, prefill_per_token))

    def plan(self, available: dict[str, int]) -> tuple[str, int]:
        """The source and k for this step (("", 0): decode plainly). Idempotent: the counters
        move in `observe` / `observe_plain`."""
        if self.cost.since_plain >= self.plain_every:
            return "", 0  # measure the plain rate again
        best_source, best_k, best_rate = "", 0, 0.0
        probe = None
        for source, n in available.items():
            if n <= 0:
                continue
            k = self.choose(source, n)
            if k == 0:
                p = self.probes.get(source)
                if probe is None and (p is None or self.clock >= p.due):
                    probe = (source, min(self.probe_k, n))
                continue
            rate = self.expected_tokens(source, k) / self.step_time(source, k)
            if rate > best_rate:
                best_source, best_k, best_rate = source, k, rate
        if best_k == 0 and probe is not None:
            return probe
        variant = self.variants.get(best_source)
        if (best_k and variant in available and self._steps % self.explore_every
                == self.explore_every - 1 and self._measured(variant) < self.explore_until):
            return variant, min(best_k, available[variant])
        if best_k and self.dither:  # spread k a little, so the cost line has two ends to fit
            phase = self._steps % 4
            if phase == 1 and best_k < min(available[best_source], self.max_k):
                best_k += 1
            elif phase == 3 and best_k > 1:
                best_k -= 1
        return best_source, best_k

    STATE_VERSION = 2

    def snapshot(self) -> dict:
        """What was measured, as JSON-able data for `resume` in a later process (the cost is
        the engine's: `StepCost.snapshot`)."""
        return {"version": self.STATE_VERSION,
                "sources": {a: [e.reached, e.accepted] for a, e in self.sources.items()}}

    def resume(self, state: dict, weight: float = 8.0) -> bool:
        """Start from an earlier `snapshot`, scaled down to at most `weight` observations so
        that this process's measurements soon take over. False, nothing changed, on a bad
        shape."""
        try:
            if state.get("version") != self.STATE_VERSION:
                return False
            sources = {}
            for arm, (reached, accepted) in state["sources"].items():
                reached = [float(x) for x in reached][: self.max_k]
                accepted = [float(x) for x in accepted][: len(reached)]
                count = reached[0] if reached else 0
                scale = min(1.0, weight / count) if count > 0 else 1.0
                sources[str(arm)] = SourceEstimate([x * scale for x in reached],
                                                   [x * scale for x in accepted])
        except (KeyError, TypeError, ValueError, IndexError, AttributeError):
            return False
        self.sources = sources
        self._memo.clear()
        return True

    def observe_plain(self, tokens: int) -> None:
        """`tokens` decoded plainly (their cost is the engine's `StepCost`'s to learn)."""
        self.clock += tokens

    def observe(self, source: str, drafted: int, accepted: int,
                seconds: float | None) -> None:
        """A speculative step; `seconds` for all of it (plan, propose, verify, update), or None.
        The cost model learns the step's cost apart; only a probe's loss is judged here."""
        self.clock += accepted + 1
        if not drafted:
            return  # a synced step that verified nothing
        self._steps += 1
        was_off = self.choose(source) == 0
        self._count(source, drafted, accepted)
        # What this step lost against plain decoding, in tokens: a probe of a draft model
        # also pays its catch-up on the tokens it skipped.
        lost = 0.0 if seconds is None else seconds / self._plain() - (accepted + 1)
        self._memo.clear()
        self._schedule_probe(source, was_off and accepted < drafted, lost if was_off else 0.0)

    def observe_acceptance(self, source: str, drafted: int, accepted: int) -> None:
        """Acceptance without a step: the first `accepted` of `drafted` tokens a deterministic
        source would have proposed were committed (`RowPolicy.watch`; exact at temperature 0,
        the same in expectation above it)."""
        if not drafted:
            return
        self._count(source, drafted, accepted)
        self._memo.clear()
        if self.choose(source) > 0:
            self.probes.pop(source, None)

    def _measured(self, source: str) -> float:
        est = self.sources.get(source)
        return est.reached[0] if est is not None and est.reached else 0.0

    def _count(self, source: str, drafted: int, accepted: int) -> None:
        d = self.decay
        est = self.sources.setdefault(source, SourceEstimate())
        while len(est.reached) < drafted:
            est.reached.append(0.0)
            est.accepted.append(0.0)
        est.reached = [r * d for r in est.reached]
        est.accepted = [a * d for a in est.accepted]
        # Positions 0..accepted were reached; all but the one at `accepted` were accepted.
        for i in range(min(accepted + 1, drafted)):
            est.reached[i] += 1.0
            if i < accepted:
                est.accepted[i] += 1.0

    def _schedule_probe(self, source: str, failed_probe: bool, lost: float = 0.0) -> None:
        """When an arm still off is probed next; `lost`: what this probe cost, in tokens (the
        next one is expected to cost as much)."""
        if self.choose(source) > 0:
            self.probes.pop(source, None)
            return
        p = self.probes.get(source)
        if p is not None and not failed_probe:  # all accepted: look again soon
            interval = self.probe_every
        else:
            interval = min(2 * p.interval, self.probe_max) if p else self.probe_every
            # A probe costs its time beyond plain decoding; keep that under probe_budget.
            k = self.probe_k
            loss = self.step_time(source, k) / self._plain() - self.expected_tokens(source, k)
            loss = max(loss, lost)
            interval = max(interval, min(loss / self.probe_budget, 4 * self.probe_max))
        self.probes[source] = Probe(interval, self.clock + interval)


# A draft of the target's own family with at least this fraction of its parameters starts from
# SAME_FAMILY_ACCEPT per position: Qwen2.5-Coder-0.5B for the 1.5B (0.32 of it) accepts 86-94 %
# of its drafts on code, and 68 % on chat at k = 4 (3.48 tokens per forward: 0.85 per
# position, each given the ones before; docs/PERFORMANCE.md); smaller drafts, such as the
# bundled 0.8 M one for its 6.4 M target, keep the pessimistic prior and are probed.
SAME_FAMILY_MIN_RATIO = 0.2
SAME_FAMILY_ACCEPT = 0.85
# A draft the estimates keep off is probed only where its catch-up costs at most this share of
# the request's plain decoding time (`AdaptiveK.catch_up_pays`)
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
    and (`forward_prior`, for the engine's `StepCost`) a cost per drafted token of the draft's
    share of the target's parameters (a draft
    forward costs about that fraction of a target forward: 0.34 measured for the coder pair,
    0.32 by parameters)."""
    draft = getattr(draft_proposer, "model", None)
    if draft is None:
        return {}
    from mlx.utils import tree_flatten

    def size(model) -> int:
        return sum(v.size for _, v in tree_flatten(model.parameters()))

    from ..proposers.draft import TREE_WIDTH

    ratio = size(draft) / max(size(target), 1)
    # (`forward_prior`: the engine's cost model's, per forward relative to a target step; a
    # tree's forward also has the target verify W rows per depth)
    priors = {"forward_prior": {"draft": ratio, LOOKUP_DRAFT: ratio,
                                DRAFT_TREE: ratio + PRIOR[2] * (TREE_WIDTH - 1)},
              "variants": {"draft": DRAFT_TREE}, "draft_ratio": ratio}
    family = [getattr(getattr(m, "args", None), "model_type", None) for m in (target, draft)]
    if family[0] is not None and family[0] == family[1] and ratio >= SAME_FAMILY_MIN_RATIO:
        priors["group_prior_accept"] = {"draft": SAME_FAMILY_ACCEPT,
                                        DRAFT_TREE: SAME_FAMILY_ACCEPT,
                                        LOOKUP_DRAFT: SAME_FAMILY_ACCEPT}
    return priors


def draft_policy(target, draft_proposer, cost: StepCost | None = None, **kwargs) -> AdaptiveK:
    """`AdaptiveK` on `cost` (the engine's) with `draft_priors`, the draft's forward cost
    prior put in `cost`; `kwargs`: other settings (max_k)."""
    cost = cost or StepCost()
    priors = draft_priors(target, draft_proposer)
    cost.forward_prior.update(priors.pop("forward_prior", {}))
    return AdaptiveK(cost=cost, **priors, **kwargs)
