"""The batch's policy: how many tokens each row of a batched step proposes (its own policy
still picks the source), from a fitted cost of the padded forward. The policy chooses k only:
exactness never depends on it. See docs/HOW_IT_WORKS.md, "Several requests".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from operator import mul

import numpy as np

from ..caches.prompt import common_prefix_len
from .adaptive import AdaptiveK, Policy

# prior coefficients of (1, synced, N, N*S/1024, K, D), relative to the intercept; N's and
# N*S's from the bundled target on this CPU (`bench/bench_batch_cost.py`, at bd76bc7)
PRIOR = (1.0, 0.3, 0.035, 0.26, 0.01, 0.3)
# the feature values at which the prior counts as `prior_weight` observations
PRIOR_AT = (1.0, 1.0, 8.0, 3.0, 4.0, 2.0)
PROPOSED = 4  # index of K in the features
# the acceptance at which a probed arm is judged: a probe is forced only where it could pay
OPTIMISTIC = 0.9


def features(rows: int, width: int, proposed: int, draft_forwards: int, span: int = 0,
             synced: bool = True) -> tuple[float, ...]:
    queries = rows * width
    return (1.0, float(synced), queries, queries * (span + width) / 1024, proposed,
            draft_forwards)


@dataclass
class BatchCost:
    """Decayed least squares for T = coef . features, ridged towards the prior."""

    prior: tuple = PRIOR
    prior_weight: float = 2.0
    decay: float = 0.99  # per step: ~100 steps of memory
    outlier: float = 2.0  # a time above this multiple of its estimate counts as this multiple
    xx: np.ndarray = field(default_factory=lambda: np.zeros((6, 6)))
    xt: np.ndarray = field(default_factory=lambda: np.zeros(6))
    seconds: float = 0.0  # decayed sum of measured times
    prior_seconds: float = 0.0  # decayed sum of the prior's unit-scale predictions for them
    _coef: np.ndarray | None = None
    _terms: tuple[float, ...] = ()  # _coef as floats: `time` is asked ~10 times a step
    _unsolved: int = 0  # steps added since the last solve

    def coef(self) -> np.ndarray:
        if self._coef is None:
            # the prior in seconds (1 per unit before any step: only ratios matter then)
            scale = self.seconds / self.prior_seconds if self.prior_seconds else 1.0
            prior = scale * np.array(self.prior)
            ridge = self.prior_weight * np.square(PRIOR_AT)
            coef = np.linalg.solve(self.xx + np.diag(ridge), self.xt + ridge * prior)
            self._coef = np.maximum(coef, 0.0)  # no term makes a step faster
            self._coef[0] = max(self._coef[0], 0.1 * prior[0])
            self._terms = tuple(float(c) for c in self._coef)
            self._unsolved = 0
        return self._coef

    def time(self, rows: int, width: int, proposed: int = 0, draft_forwards: int = 0,
             span: int = 0, synced: bool = True) -> float:
        """Predicted seconds; `span`: the longest row's cached length. Plain Python: numpy's
        per-call cost is larger than this arithmetic."""
        self.coef()
        x = features(rows, width, proposed, draft_forwards, span, synced)
        return sum(c * v for c, v in zip(self._terms, x))

    def add(self, rows: int, width: int, proposed: int, draft_forwards: int,
            seconds: float, span: int = 0, synced: bool = True) -> None:
        values = features(rows, width, proposed, draft_forwards, span, synced)
        if self.prior_seconds:  # a descheduled process or a GC pause is not the model's cost
            if not self._terms or self._unsolved >= 16:
                self.coef()
            # the fit as of the last solve (at most 16 steps old): a plain stretch adds a
            # step every few ms but asks the fit only every few steps
            estimate = sum(c * v for c, v in zip(self._terms, values))
            seconds = min(seconds, self.outlier * estimate)
        x = np.array(values)
        d = self.decay
        self.xx = self.xx * d + np.outer(x, x)
        self.xt = self.xt * d + x * seconds
        self.seconds = self.seconds * d + seconds
        self.prior_seconds = self.prior_seconds * d + float(np.dot(self.prior, x))
        self._coef = None
        self._unsolved += 1


@dataclass
class RowOffer:
    """What one row could propose this step."""

    survive: list[float]  # s_i = P(positions 1..i all accepted), i = 1..cap
    draft: bool = False  # drafted by the draft model (shares the batch's draft forwards)
    forced: int = 0  # propose at least this many (a probe, a pinned k), capped by cap
    probe: bool = False  # forced because the row's own policy probes a switched-off arm

    @property
    def cap(self) -> int:
        return len(self.survive)


def survival(accept_probs: list[float], cap: int) -> list[float]:
    """P(positions 1..i accepted) for i = 1..cap from per-position acceptance estimates."""
    return list(accumulate(accept_probs[:cap], mul))


@dataclass
class BatchPolicy:
    """Chooses every row's k for a batched step; told each step's shape and time after it."""

    cost: BatchCost = field(default_factory=BatchCost)
    margin: float = 0.0  # a wider step must beat the narrower best by this fraction
    rate: float = 0.0  # tokens per second the last decision expected
    probe_gap: int = 64  # batched steps between two steps forced by a row's probe
    last_probe: int = -64  # the step that last forced one

    def decide(self, offers: list[RowOffer], rows: int | None = None, span: int = 0,
               pipelined: bool = False) -> list[int]:
        """Each row's k (0: none); `rows` the forward's batch size if rows sitting out are
        fed too, `span` the longest row's cached length, `pipelined` whether an all-plain step
        would be queued unsynced."""
        ks, self.rate = choose_ks(self.cost, offers, self.rate, self.margin, rows, span,
                                  pipelined)
        return ks

    def observe(self, rows: int, width: int, proposed: int, draft_forwards: int,
                seconds: float, span: int = 0, synced: bool = True) -> None:
        self.cost.add(rows, width, proposed, draft_forwards, seconds, span, synced)

    def limit_probes(self, offers: list[tuple[str, RowOffer]], step: int, commit: bool = True,
                     rows: int | None = None, span: int = 0,
                     pipelined: bool = False) -> list[tuple[str, RowOffer]]:
        """Force probes at most once every `probe_gap` steps, and only where the first
        probing row's arm could pay here at `OPTIMISTIC` acceptance (a forced probe widens and
        syncs the whole batch); one not forced stays due. `commit=False`: only asking."""
        probing = [i for i, (_, o) in enumerate(offers) if o.probe]
        if not probing:
            return offers
        unforced = [(source, RowOffer(o.survive, o.draft) if o.probe else o)
                    for source, o in offers]
        if step - self.last_probe < self.probe_gap:
            return unforced
        if commit:
            self.last_probe = step
        first = offers[probing[0]][1]
        hopeful = [o for _, o in unforced]
        hopeful[probing[0]] = RowOffer(survival([OPTIMISTIC] * first.cap, first.cap),
                                       first.draft)
        ks, _ = choose_ks(self.cost, hopeful, rows=rows, span=span, pipelined=pipelined)
        return offers if ks[probing[0]] else unforced


def choose_ks(cost: BatchCost, offers: list[RowOffer], last_rate: float = 0.0,
              margin: float = 0.0, rows: int | None = None, span: int = 0,
              pipelined: bool = False) -> tuple[list[int], float]:
    """The per-row k maximising expected tokens per second, and that rate, over every width
    from the forced minimum to 1 + the largest cap, draft rows drafting or not. Plain Python:
    asked every step, over a few rows."""
    if not offers:
        return [], 0.0
    rows = max(rows or 0, len(offers))
    e = float(cost.coef()[PROPOSED])

    def seconds(width: int, proposed: int, draft_forwards: int, synced: bool) -> float:
        return max(cost.time(rows, width, proposed, draft_forwards, span, synced), 1e-12)

    caps = [len(o.survive) for o in offers]
    forced = [min(o.forced, cap) for o, cap in zip(offers, caps)]
    plain = len(offers) / seconds(1, 0, 0, not pipelined)
    # E_b(k) = 1 + s_1 + ... + s_k
    expected = [list(accumulate(o.survive, initial=1.0)) for o in offers]
    if not any(forced) and sum(x[-1] for x in expected) / seconds(2, 0, 0, True) <= plain:
        return [0] * len(offers), plain  # no width can pay: every term only adds time
    widest = 1 + max(caps)
    narrowest = 1 + max(forced)
    has_draft = any(o.draft and cap for o, cap in zip(offers, caps))
    best_ks, best_rate = None, last_rate
    # A position pays when its survival beats its own marginal cost e * R (R the best rate:
    # Dinkelbach's iteration for a ratio, started from the last step's rate; two rounds).
    for _ in range(2 if e > 0 else 1):
        threshold = e * best_rate
        worth = [sum(1 for x in o.survive if x > threshold) for o in offers]  # non-increasing
        round_ks, round_rate, seen = None, 0.0, set()
        for width in range(narrowest, widest + 1):
            for drafting in ((False, True) if has_draft else (False,)):
                ks = tuple(max(min(cap, width - 1, w) if drafting or not o.draft else 0, f)
                           for o, cap, w, f in zip(offers, caps, worth, forced))
                if ks in seen:
                    continue
                seen.add(ks)
                draft_forwards = max((k for o, k in zip(offers, ks) if o.draft), default=0)
                t = seconds(1 + max(ks), sum(ks), draft_forwards, not pipelined or any(ks))
                rate = sum(x[k] for x, k in zip(expected, ks)) / t
                if round_ks is None or rate > round_rate * (1.0 + margin) * 1.0001:
                    round_ks, round_rate = ks, rate
        if best_ks is None or round_rate >= best_rate:
            best_ks, best_rate = round_ks, round_rate
    return list(best_ks), best_rate


class RowPolicy:
    """A row's side of the batch's planning: its own policy, a `shadow` AdaptiveK measuring a
    FixedK row's acceptance, and the watch of a source the batch kept plain."""

    def __init__(self, policy: Policy, proposer, batched: bool):
        self.policy, self.proposer = policy, proposer
        self.shadow = None if not batched or isinstance(policy, AdaptiveK) else \
            AdaptiveK(max_k=max(policy.max_k, 1), dither=False)
        # (context length, source, tokens): what a free source kept plain would have proposed
        self.watching: tuple[int, str, list[int]] | None = None
        # (source, k) the last plan kept plain: watched after each watch ends, till the next plan
        self.watch_for: tuple[str, int] | None = None

    def plan(self, available: dict[str, int] | None) -> tuple[str, int]:
        """The row's own plan, as if alone (asked even when nothing is offered, so that a
        sharded rank's policy agrees with rank 0's)."""
        return ("", 0) if available is None else self.policy.plan(available)

    def offer(self, available: dict[str, int], pinned: bool) -> tuple[str, RowOffer]:
        """The source the row proposes from (its policy's choice) and what it offers the batch.
        A probe is forced (it keeps its own schedule); a `pinned` (seeded, temperature > 0)
        FixedK row keeps its k: its draws depend on k, and must not depend on the batch."""
        policy, shadow = self.policy, self.shadow
        if not available:
            return "", RowOffer([])
        if shadow is not None:
            source, k = policy.plan(available)
            if not k:
                return "", RowOffer([])
            if pinned:
                return source, RowOffer(survival(shadow.accept_probs(source), k),
                                        source == "draft", forced=k)
            policy, available = shadow, {source: k}
        source, k = policy.plan(available)
        if k and policy.choose(source, available[source]) == 0:  # a probe
            return source, RowOffer(survival(policy.accept_probs(source), k), source == "draft",
                                    forced=k, probe=True)
        if not k:  # arms off or t_plain due: its best offer, taken only where it pays
            offered = {s: min(n, policy.max_k) for s, n in available.items() if n > 0}
            if not offered:
                return "", RowOffer([])
            source = max(offered, key=lambda s: policy.expected_tokens(s, offered[s]))
        n = min(available[source], policy.max_k)
        return source, RowOffer(survival(policy.accept_probs(source), n), source == "draft")

    def observe(self, source: str, drafted: int, accepted: int, seconds: float | None,
                context: list[int]) -> None:
        """A speculative step from `source`, or a plain one (drafted 0; seconds None: only
        counted); `context`: the row's committed tokens after it."""
        for policy in [p for p in (self.policy, self.shadow) if p is not None]:
            if drafted:
                policy.observe(source, drafted, accepted, seconds)
            else:
                policy.observe_plain(1, seconds)
        self._check_watch(context)

    def watch(self, source: str, k: int, context: list[int]) -> None:
        """The batch keeps this row plain although `source` offered k tokens: count how many
        of them (`Proposer.peek`) the row then commits, or a source kept off by the batch's
        cost is never measured again and a low estimate keeps it off for good."""
        self.watch_for = (source, k) if k and self.proposer is not None else None
        self._start_watch(context)

    def _start_watch(self, context: list[int]) -> None:
        if self.watching is not None or self.watch_for is None:
            return
        source, k = self.watch_for
        tokens = self.proposer.peek(context, k, source)
        if tokens:
            self.watching = (len(context), source, tokens)

    def _check_watch(self, context: list[int]) -> None:
        if self.watching is None:
            return  # (no lookup per step: a source that offered nothing waits for a plan)
        start, source, tokens = self.watching
        seen = context[start : start + len(tokens)]
        n = common_prefix_len(seen, tokens)
        if n == len(seen) < len(tokens):
            return  # all matched so far, not all seen yet
        self.watching = None
        for policy in (self.policy, self.shadow):
            if isinstance(policy, AdaptiveK):
                policy.observe_acceptance(source, len(tokens), n)
        self._start_watch(context)


def plan_rows(policy: BatchPolicy, rows: list, step: int, commit: bool, slots: int,
              span: int, pipelined: bool) -> list[tuple[str, int]]:
    """Every row's (source, k) for a batched step; a row kept plain watches its source unless
    a draft's (its tokens cost forwards). `commit=False`: only asking."""
    offers = policy.limit_probes([r.offer() for r in rows], step, commit, slots, span,
                                 pipelined)
    ks = policy.decide([o for _, o in offers], rows=slots, span=span, pipelined=pipelined)
    for r, (source, offer), k in zip(rows, offers, ks):
        planner = r.planner
        if k:
            planner.watching = planner.watch_for = None  # measured by the step itself
        elif not offer.draft:
            planner.watch(source, offer.cap, r.context)
        else:
            planner.watch_for = None
    return [(source, k) for (source, _), k in zip(offers, ks)]
