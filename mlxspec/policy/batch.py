"""The batch's policy: in one batched speculative step (`batch_step.py`), how many tokens each
row proposes. Every row's own policy (`adaptive.py`) still chooses its *source* and keeps
learning its acceptance; this module chooses the widths, because what a proposal costs in a
batch is not what it costs alone: the forward runs over B rows padded to one width
W = 1 + max k, so a row proposing inside the width the batch pays for anyway costs almost
nothing, and one row widening the batch makes every row pay.

The step time is a decayed least-squares fit over the measured batched steps,

    T = a + s*synced + n*N + m*N*S/1024 + e*K + d*D

N = B*W the query rows of the forward (B rows padded to the width W = 1 + max k: a padded
position costs what a row costs), S the keys each query attends (the longest row's length +
W), synced 1 when the host waits for the step (a speculative step, or a plain one that could
not be queued behind the previous), K = sum of the rows' k (verification, bookkeeping) and D
the sequential draft-model forwards (the batched draft runs max k forwards over its rows,
`batch_draft.py`). Plain steps at different batch sizes and context lengths measure n and m,
so the price of width is learned before any wide step is tried: on this CPU a small model's
attention makes N*S the largest term (8 rows at width 3 cost ~2x width 1), on a GPU the weights
dominate and n, m come out near 0. Priors (relative to the intercept, rescaled to the measured
times) start the fit and hold it where the data cannot separate two terms (a ridge towards
the prior).

Row b's expected tokens at k are E_b(k) = 1 + sum_{i<=k} s_b,i, s_b,i = P(positions 1..i
accepted), from its own policy's estimates (`AdaptiveK.accept_probs`; a `FixedK` row: a shadow
estimate of its measured acceptance, starting at AdaptiveK's neutral prior). Each step picks
the width W in 1..1 + max cap, and whether the draft rows draft at all, maximising

    R = sum_b E_b(k_b) / T(B, W, sum k_b, D),   k_b = min(cap_b, W-1, n_b)

n_b the leading positions whose s_b,i beats their marginal cost e*R (R of the last step).
W = 1 is the all-plain batch step; a row whose proposal does not pay at the chosen width (a
draft row when the draft's forwards do not pay, a position below the per-token cost) proposes
nothing. Rows with `forced` tokens (a probe of a switched-off arm on its own schedule, or a
pinned k, see `batch_step.BatchRow.offer`) propose them whatever the rest: the width grows to
fit them, and the other rows fill it for free.

Exactness does not depend on any of this: the policy chooses k only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np

from ..caches.prompt import common_prefix_len
from .adaptive import AdaptiveK, Policy

# prior coefficients of (1, synced, N, N*S/1024, K, D), relative to the intercept: a query
# row 3.5 % plus 26 % per 1024 keys attended (the bundled 6.4 M target's forward on this CPU,
# fitted by `python bench/bench_batch_cost.py`), a synced step's unhidden host work ~30 %, a
# proposed token's own work ~1 %, a draft forward ~30 %
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

    def scale(self) -> float:
        """Seconds per unit of the prior (1.0 before any step: only ratios matter then)."""
        return self.seconds / self.prior_seconds if self.prior_seconds else 1.0

    def coef(self) -> np.ndarray:
        if self._coef is None:
            prior = self.scale() * np.array(self.prior)
            ridge = self.prior_weight * np.square(PRIOR_AT)
            coef = np.linalg.solve(self.xx + np.diag(ridge), self.xt + ridge * prior)
            self._coef = np.maximum(coef, 0.0)  # no term makes a step faster
            self._coef[0] = max(self._coef[0], 0.1 * prior[0])
            self._terms = tuple(float(c) for c in self._coef)
            self._unsolved = 0
        return self._coef

    def time(self, rows: int, width: int, proposed: int = 0, draft_forwards: int = 0,
             span: int = 0, synced: bool = True) -> float:
        """Predicted seconds of a step; `span` the longest row's cached length before it.
        Plain Python: numpy's per-call cost is larger than this arithmetic."""
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
    out, s = [], 1.0
    for a in accept_probs[:cap]:
        s *= a
        out.append(s)
    return out


def row_offer(policy, shadow, available: dict[str, int],
              pinned: bool = False) -> tuple[str, RowOffer]:
    """The source a row would propose from and what it offers the batch (its `available`
    offers, capped already). The row's own policy chooses the source; the batch chooses k.

    - `AdaptiveK`: the source of its plan, capped by what the source offers (the width may
      be paid by other rows). A probe of a switched-off arm is forced, so probes keep their
      own schedule whatever the batch. When it plans nothing (its arms off, or t_plain being
      measured), its best offer by expected tokens, which the batch takes only where it pays
      at the batch's cost.
    - any other policy (`FixedK`): its source and k, with acceptance measured on this row by
      a `shadow` `AdaptiveK` (neutral prior at first) that also schedules its probes as
      above. A `pinned` row (seeded, at temperature > 0) keeps that k: its draws depend on k,
      and a seeded output must not depend on the rest of the batch (at temperature 0 it
      never does, whatever k; unseeded, only its distribution is promised, which no k
      changes).
    """
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
    if not k:
        offered = {s: min(n, policy.max_k) for s, n in available.items() if n > 0}
        if not offered:
            return "", RowOffer([])
        source = max(offered, key=lambda s: policy.expected_tokens(s, offered[s]))
    n = min(available[source], policy.max_k)
    return source, RowOffer(survival(policy.accept_probs(source), n), source == "draft")


@dataclass
class BatchPolicy:
    """Chooses every row's k for a batched step (see module docstring); told each step's
    shape and time after it (`observe`)."""

    cost: BatchCost = field(default_factory=BatchCost)
    margin: float = 0.0  # a wider step must beat the narrower best by this fraction
    rate: float = 0.0  # tokens per second the last decision expected
    probe_gap: int = 64  # batched steps between two steps forced by a row's probe
    last_probe: int = -64  # the step that last forced one

    def decide(self, offers: list[RowOffer], rows: int | None = None, span: int = 0,
               pipelined: bool = False) -> list[int]:
        """Each row's k (0: propose nothing); `rows` the forward's batch size when rows that
        sit the step out are fed too (default: the offers), `span` the longest row's cached
        length, `pipelined` whether an all-plain step would be queued unsynced."""
        ks, self.rate = choose_ks(self.cost, offers, self.rate, self.margin, rows, span,
                                  pipelined)
        return ks

    def observe(self, rows: int, width: int, proposed: int, draft_forwards: int,
                seconds: float, span: int = 0, synced: bool = True) -> None:
        self.cost.add(rows, width, proposed, draft_forwards, seconds, span, synced)

    def limit_probes(self, offers: list[tuple[str, RowOffer]], step: int, commit: bool = True,
                     rows: int | None = None, span: int = 0,
                     pipelined: bool = False) -> list[tuple[str, RowOffer]]:
        """A forced probe makes the whole batch take a synced, wider step, and every row has
        its own probe schedule: the batch considers forcing probes once every `probe_gap`
        steps (`step`: the batch's step count), and forces them only where an arm could pay
        here (were the first probing row's arm accepted at `OPTIMISTIC`, the batch would
        give it a k): what cannot pay in a batch this wide is not worth a wide step to
        learn. A probe not forced stays due (the row's policy asks again), and the batch may
        still take it where it pays. `commit=False`: only asking."""
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
    """The per-row k maximising expected tokens per second of the batched step, and that
    rate. Candidates: every width W from the forced minimum to 1 + the largest cap, with the
    draft rows drafting or not; a step with a proposal is synced, an all-plain one is not
    when `pipelined`. Asked every step: plain Python over a few rows."""
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
                ks = []
                for o, cap, w, f in zip(offers, caps, worth, forced):
                    k = min(cap, width - 1, w) if drafting or not o.draft else 0
                    ks.append(max(k, f))
                shape = tuple(ks)
                if shape in seen:
                    continue
                seen.add(shape)
                draft_forwards = max((k for o, k in zip(offers, ks) if o.draft), default=0)
                t = seconds(1 + max(ks), sum(ks), draft_forwards, not pipelined or any(ks))
                rate = sum(x[k] for x, k in zip(expected, ks)) / t
                if round_ks is None or rate > round_rate * (1.0 + margin) * 1.0001:
                    round_ks, round_rate = ks, rate
        if best_ks is None or round_rate >= best_rate:
            best_ks, best_rate = round_ks, round_rate
    return best_ks, best_rate


class RowPolicy:
    """A row's side of the batch's planning: its own policy (the source, and k when alone), a
    `shadow` AdaptiveK measuring a FixedK row's acceptance for the batch's policy, and the
    watch of a source the batch kept plain (`watch`)."""

    def __init__(self, policy: Policy, proposer, batched: bool):
        self.policy, self.proposer = policy, proposer
        self.shadow = None if not batched or isinstance(policy, AdaptiveK) else \
            AdaptiveK(max_k=max(policy.max_k, 1), dither=False)
        # (context length, source, tokens): what a free source would have proposed when the
        # batch kept the row plain, compared with what the row commits next
        self.watching: tuple[int, str, list[int]] | None = None
        # (source, k) the batch's last plan kept plain for this row: watched again after each
        # watch ends, until the next plan (in a plain stretch the batch plans every few steps)
        self.watch_for: tuple[str, int] | None = None

    def plan(self, available: dict[str, int] | None) -> tuple[str, int]:
        """What the row's own policy proposes, as if it were alone (asked even when nothing is
        offered: a sharded rank's policy agrees with rank 0's in every plan)."""
        return ("", 0) if available is None else self.policy.plan(available)

    def offer(self, available: dict[str, int], pinned: bool) -> tuple[str, RowOffer]:
        return row_offer(self.policy, self.shadow, available, pinned)

    def observe(self, source: str, drafted: int, accepted: int, seconds: float | None,
                context: list[int]) -> None:
        """A speculative step from `source` (the plan's arm, `ngram:4`), or a plain one
        (drafted 0; seconds None: not the steady-state cost of a plain token, only counted);
        `context` the row's committed tokens after it."""
        for policy in (self.policy, self.shadow):
            if policy is None:
                continue
            if drafted:
                policy.observe(source, drafted, accepted, seconds)
            else:
                policy.observe_plain(1, seconds)
        self._check_watch(context)

    def watch(self, source: str, k: int, context: list[int]) -> None:
        """The batch keeps this row plain although `source` offered k tokens: when they cost
        nothing to make (`Proposer.peek`), remember them and, as the row commits tokens,
        count how many would have been accepted (`AdaptiveK.observe_acceptance`). Without
        this a source kept off by the batch's cost is never measured again, and an estimate
        too low to pay keeps it off for good."""
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
    """Every row's (source, k) for a batched step: the rows' offers (`BatchRow.offer`), the
    forced probes the batch allows now, the widths `policy` chooses; a row kept plain
    watches its source (`RowPolicy.watch`), a draft's excepted (its tokens cost forwards).
    `commit=False`: only asking (a forced probe allowed now is not counted as taken)."""
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
