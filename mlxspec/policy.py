"""A request's policy: which source and how many tokens (k) to propose each step. `FixedK`
(the fixed-k modes), `AdaptiveK` (`auto` and `adaptive=True`: measured acceptance per source
and position, priced by the engine's cost model; kept between processes by `policy_store`).
The decode loop only asks (`plan`) and tells (`observe`); exactness never depends on them.
See docs/HOW_IT_WORKS.md, "Proposers".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from .choose_k import RowOffer, choose_ks, survival
from .cost import StepCost, cost_group, forward_group
from .errors import MlxspecError
from .proposal import DRAFT_TREE, LOOKUP_DRAFT

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
    length, and `pipelined`, whether its plain steps are, before asking."""

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
    probe_budget: float = 0.005  # the share of decoding time all probes together may lose
    probe_k: int = 2
    trusted_k: int = DEFAULT_NUM_DRAFT  # k proposed before deeper positions are measured
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
    # whether the row's plain steps are pipelined (a grammar row's are not: its next draw needs
    # the last token read), so what a plain step costs it and whether one measures that cost
    pipelined: bool = True
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

    def reach(self, source: str) -> int:
        """The most tokens worth proposing from `source`: max_k, but for a source that runs a
        model per token at most one position past the deepest one measured lately (and at
        least `trusted_k`). A position never reached borrows the estimate of the one before:
        a step of several of them stakes a forward each on an estimate nothing measured (on
        chat a draft carried to k = 8 from answers that accepted all of k = 4 accepted 1 or 2
        of 8 in the next). A free source's extra positions cost only the verifying width."""
        if not forward_group(source):
            return self.max_k
        est = self.sources.get(source)
        depth = 0
        if est is not None:
            for reached in est.reached:
                if reached < 0.5:
                    break
                depth += 1
        return min(self.max_k, max(self.trusted_k, depth + 1))

    def expected_tokens(self, source: str, k: int) -> float:
        total, survive = 1.0, 1.0
        for a in self.accept_probs(source)[:k]:
            survive *= a
            total += survive
        return total

    def plain_time(self) -> float:
        """Predicted seconds of the row's plain step (synced where it cannot be pipelined)."""
        return self.cost.plain(self.span, self.pipelined)

    def step_time(self, source: str, k: int) -> float:
        """Predicted seconds of a step proposing k from `source` (0: the row's plain one)."""
        if k == 0:
            return self.plain_time()
        return self.cost.time(1, 1 + k, k, {forward_group(source): k}, self.span)

    def choose(self, source: str, limit: int | None = None) -> int:
        """The k <= limit with the highest expected tokens per second (0: do not speculate):
        the batch's rule (`choose_ks`) for a row alone."""
        reach = self.reach(source)
        limit = reach if limit is None else min(limit, reach)
        # Kept while the estimates hold: asked every step of a plain stretch, where only the
        # cost moves, a little (a full re-plan per source cost ~35 us a step)
        plain, (memo_plain, memo_span) = self.plain_time(), self._memo_at
        if abs(plain - memo_plain) > 0.02 * memo_plain or abs(self.span - memo_span) > 256:
            self._memo.clear()
            self._memo_at = (plain, self.span)
        hit = self._memo.get((source, limit))
        if hit is None:
            offer = RowOffer(survival(self.accept_probs(source), limit), forward_group(source))
            hit = choose_ks(self.cost, [offer], span=self.span, pipelined=self.pipelined,
                            default=self.trusted_k)[0][0]
            self._memo[(source, limit)] = hit
        return hit

    def plan(self, available: dict[str, int]) -> tuple[str, int]:
        """The source and k for this step (("", 0): decode plainly). Idempotent: the counters
        move in `observe` / `observe_plain`."""
        if self.pipelined and self.cost.since_plain >= self.plain_every:
            return "", 0  # measure the pipelined plain rate again (a synced row cannot)
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
                == self.explore_every - 1 and self.measured(variant) < self.explore_until):
            return variant, min(best_k, available[variant])
        return best_source, best_k

    def restore(self, sources: dict[str, SourceEstimate]) -> None:
        """Start from estimates kept by an earlier process (`policy_store`)."""
        self.sources = sources
        self._memo.clear()

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
        lost = 0.0 if seconds is None else seconds / self.plain_time() - (accepted + 1)
        self._memo.clear()
        self._schedule_probe(source, was_off and accepted < drafted, lost if was_off else 0.0)

    def observe_acceptance(self, source: str, drafted: int, accepted: int) -> None:
        """Acceptance without a step: the first `accepted` of `drafted` tokens a deterministic
        source would have proposed were committed (`RowPolicy.watch`; exact at temperature 0,
        the same in expectation above it)."""
        self._count(source, drafted, accepted)
        self._memo.clear()
        if self.choose(source) > 0:
            self.probes.pop(source, None)
        else:  # still off: looked at again (a watch or a probe) no sooner than probe_every
            p = self.probes.get(source)
            due = self.clock + self.probe_every
            self.probes[source] = Probe(p.interval, max(p.due, due)) if p else Probe(
                self.probe_every, due)

    def measured(self, source: str) -> float:
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
            # A probe costs its time beyond plain decoding; keep all the arms' probes together
            # under probe_budget (free text offers n-gram arms of every length, the suffix
            # store's and the draft: five arms probed at a budget each cost ~1 % on the
            # bundled model, where a forward is cheap)
            k = self.probe_k
            loss = self.step_time(source, k) / self.plain_time() - self.expected_tokens(source, k)
            loss = max(loss, lost)
            off = len(self.probes) + (source not in self.probes)
            interval = max(interval, min(loss * off / self.probe_budget, 4 * self.probe_max))
        self.probes[source] = Probe(interval, self.clock + interval)
