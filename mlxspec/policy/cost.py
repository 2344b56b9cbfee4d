"""What a step costs, and the k that pays most: the one cost model (`StepCost`) and the one
planning rule (`choose_ks`) for a request alone (a batch of one row) and for rows in a batch.
See docs/HOW_IT_WORKS.md, "Several requests".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from operator import mul

import numpy as np

# Prior coefficients of (1, synced, N, N*S/1024, K, F_g), relative to the intercept; N's and
# N*S's as measured for the bundled target's batched forwards on a 2-core CPU. F_g:
# one column per source group whose proposal costs a forward per position (a draft model,
# QuantSpec's 4-bit pass), the last value its prior unless `forward_prior` names the group.
PRIOR = (1.0, 0.3, 0.035, 0.26, 0.01, 0.3)
# the feature values at which the prior counts as `prior_weight` observations
PRIOR_AT = (1.0, 1.0, 8.0, 3.0, 4.0, 2.0)
PROPOSED = 4  # index of K in the features
BASE = 5  # features before the groups' forward columns
# source groups (a source's name up to ':') whose proposals cost no model forward of their own
# (lookahead's window rides in the verifying forward)
FREE_GROUPS = frozenset({"", "ngram", "prediction", "ngram-tree", "suffix", "lookahead"})


def cost_group(source: str) -> str:
    """The group a source's measurements are kept under: its name up to the first ':'."""
    return source.split(":", 1)[0]


def forward_group(source: str) -> str:
    """The group whose forwards a proposal from `source` runs ("" where it runs none)."""
    group = cost_group(source)
    return "" if group in FREE_GROUPS else group


@dataclass
class StepCost:
    """Seconds of one step (proposals, the target's forward over `rows` x `width` queries,
    verification) as coef . features, decayed least squares ridged towards the prior. Shared by
    every row and batch of an engine: a row alone and a batch learn one model."""

    prior: tuple = PRIOR
    forward_prior: dict[str, float] = field(default_factory=dict)  # group -> its F prior
    prior_weight: float = 2.0
    decay: float = 0.99  # per step: ~100 steps of memory
    outlier: float = 2.0  # a time above this multiple of its estimate counts as this multiple
    groups: list[str] = field(default_factory=list)  # the forward columns' groups, in order
    xx: np.ndarray = field(default_factory=lambda: np.zeros((BASE, BASE)))
    xt: np.ndarray = field(default_factory=lambda: np.zeros(BASE))
    seconds: float = 0.0  # decayed sum of measured times
    prior_seconds: float = 0.0  # decayed sum of the prior's unit-scale predictions for them
    plain_weight: float = 0.0  # decayed count of pipelined plain steps measured
    since_plain: int = 0  # synced steps measured since the last pipelined plain one
    _coef: np.ndarray | None = None
    _terms: tuple[float, ...] = ()  # _coef as floats: `time` is asked ~10 times a step
    _unsolved: int = 0  # steps added since the last solve
    _prior_memo: tuple | None = field(default=None, repr=False)  # (key, `_prior()`)

    def _column(self, group: str) -> int:
        if group not in self.groups:
            self.groups.append(group)
            n = BASE + len(self.groups)
            xx, xt = np.zeros((n, n)), np.zeros(n)
            xx[: n - 1, : n - 1], xt[: n - 1] = self.xx, self.xt
            self.xx, self.xt, self._coef = xx, xt, None
        return BASE + self.groups.index(group)

    def _prior(self) -> np.ndarray:
        # (kept while the groups and their priors are the same: asked at every step's `add`)
        key = (len(self.groups), tuple(self.forward_prior.items()))
        memo = self._prior_memo
        if memo is None or memo[0] != key:
            forwards = [self.forward_prior.get(g, self.prior[BASE]) for g in self.groups]
            memo = self._prior_memo = (key, np.array(list(self.prior[:BASE]) + forwards))
        return memo[1]

    def coef(self) -> np.ndarray:
        if self._coef is None:
            # the prior in seconds (1 per unit before any step: only ratios matter then)
            scale = self.seconds / self.prior_seconds if self.prior_seconds else 1.0
            prior = scale * self._prior()
            at = list(PRIOR_AT[:BASE]) + [PRIOR_AT[BASE]] * len(self.groups)
            ridge = self.prior_weight * np.square(at)
            coef = np.linalg.solve(self.xx + np.diag(ridge), self.xt + ridge * prior)
            self._coef = np.maximum(coef, 0.0)  # no term makes a step faster
            self._coef[0] = max(self._coef[0], 0.1 * prior[0])
            self._terms = tuple(float(c) for c in self._coef)
            self._coef_now = self._coef  # (kept past `add`, which invalidates `_coef`)
            self._unsolved = 0
        return self._coef

    def _values(self, rows, width, proposed, forwards, span, synced) -> list[float]:
        queries = rows * width
        values = [1.0, float(synced), queries, queries * (span + width) / 1024, proposed]
        for group, n in (forwards or {}).items():
            if group:
                column = self._column(group)
                values += [0.0] * (column + 1 - len(values))
                values[column] += n
        return values

    def time(self, rows: int, width: int, proposed: int = 0,
             forwards: dict[str, int] | None = None, span: int = 0,
             synced: bool = True) -> float:
        """Predicted seconds; `forwards`: per group, the sequential forwards its proposals ran;
        `span`: the longest row's cached length. Plain Python: numpy's per-call cost is larger
        than this arithmetic."""
        for group in forwards or ():
            if group and group not in self.groups:  # new columns first
                self._values(rows, width, proposed, forwards, span, synced)
                break
        if self._coef is None:
            self.coef()
        c = self._terms
        queries = rows * width
        t = (c[0] + c[1] * synced + c[2] * queries + c[3] * queries * (span + width) / 1024
             + c[PROPOSED] * proposed)
        if forwards:
            for group, n in forwards.items():
                if group:
                    t += c[BASE + self.groups.index(group)] * n
        return t

    def plain(self, span: int = 0) -> float:
        """Seconds of a pipelined plain step of one row."""
        return self.time(1, 1, span=span, synced=False)

    def add(self, rows: int, width: int, proposed: int, forwards: dict[str, int] | None,
            seconds: float, span: int = 0, synced: bool = True) -> None:
        values = self._values(rows, width, proposed, forwards, span, synced)
        values += [0.0] * (BASE + len(self.groups) - len(values))
        if self.prior_seconds:  # a descheduled process or a GC pause is not the model's cost
            # the fit as of the last solve (at most 16 steps old): a plain stretch adds a
            # step every few ms but asks the fit only every few steps
            if not self._terms or self._unsolved >= 16 or len(self._terms) != len(values):
                self._coef = None
                self.coef()
        x = np.array(values)
        if self.prior_seconds:
            seconds = min(seconds, self.outlier * float(self._coef_now @ x))
        d = self.decay
        self.xx = self.xx * d + np.outer(x, x)
        self.xt = self.xt * d + x * seconds
        self.seconds = self.seconds * d + seconds
        self.prior_seconds = self.prior_seconds * d + float(np.dot(self._prior(), x))
        if synced or proposed:
            self.since_plain += 1
        else:
            self.plain_weight = self.plain_weight * d + 1.0
            self.since_plain = 0
        self._coef = None
        self._unsolved += 1

    STATE_VERSION = 1

    def snapshot(self) -> dict:
        """What was measured, as JSON-able data for `resume` in a later process."""
        return {"version": self.STATE_VERSION, "groups": list(self.groups),
                "xx": self.xx.tolist(), "xt": self.xt.tolist(),
                "seconds": [self.seconds, self.prior_seconds, self.plain_weight]}

    def resume(self, state: dict, weight: float = 8.0) -> bool:
        """Start from an earlier `snapshot`, scaled down to at most `weight` steps so that this
        process's measurements soon take over. False, nothing changed, on a bad shape."""
        try:
            if state.get("version") != self.STATE_VERSION:
                return False
            groups = [str(g) for g in state["groups"]]
            xx, xt = np.array(state["xx"], dtype=float), np.array(state["xt"], dtype=float)
            n = BASE + len(groups)
            seconds, prior_seconds, plain_weight = (float(x) for x in state["seconds"])
            if xx.shape != (n, n) or xt.shape != (n,) or not np.isfinite(xx).all():
                return False
        except (KeyError, TypeError, ValueError, AttributeError):
            return False
        scale = min(1.0, weight / xx[0, 0]) if xx[0, 0] > 0 else 1.0
        self.groups, self.xx, self.xt = groups, xx * scale, xt * scale
        self.seconds, self.prior_seconds = seconds * scale, prior_seconds * scale
        self.plain_weight, self.since_plain, self._coef = min(plain_weight, 1.0), 0, None
        return True


@dataclass
class RowOffer:
    """What one row could propose this step."""

    survive: list[float]  # s_i = P(positions 1..i all accepted), i = 1..cap
    group: str = ""  # `forward_group` of its source: rows of one group share its forwards
    forced: int = 0  # propose at least this many (a probe), capped by cap
    probe: bool = False  # forced because the row's own policy probes a switched-off arm

    @property
    def cap(self) -> int:
        return len(self.survive)


def survival(accept_probs: list[float], cap: int) -> list[float]:
    """P(positions 1..i accepted) for i = 1..cap from per-position acceptance estimates."""
    return list(accumulate(accept_probs[:cap], mul))


def choose_ks(cost: StepCost, offers: list[RowOffer], last_rate: float = 0.0,
              margin: float = 0.0, rows: int | None = None, span: int = 0,
              pipelined: bool = False) -> tuple[list[int], float]:
    """The per-row k maximising expected tokens per second, and that rate, over every width
    from the forced minimum to 1 + the largest cap, rows that cost forwards proposing or not
    (a row alone is one offer). Plain Python: asked every step, over a few rows."""
    if not offers:
        return [], 0.0
    if len(offers) == 1 and not rows and not offers[0].forced:
        return _choose_alone(cost, offers[0], span, pipelined, margin)
    rows = max(rows or 0, len(offers))
    e = float(cost.coef()[PROPOSED])

    def seconds(width: int, proposed: int, forwards: dict | None, synced: bool) -> float:
        return max(cost.time(rows, width, proposed, forwards, span, synced), 1e-12)

    caps = [len(o.survive) for o in offers]
    forced = [min(o.forced, cap) for o, cap in zip(offers, caps)]
    plain = len(offers) / seconds(1, 0, None, not pipelined)
    # E_b(k) = 1 + s_1 + ... + s_k
    expected = [list(accumulate(o.survive, initial=1.0)) for o in offers]
    if not any(forced) and sum([x[-1] for x in expected]) / seconds(2, 0, None, True) <= plain:
        return [0] * len(offers), plain  # no width can pay: every term only adds time
    widest = 1 + max(caps)
    narrowest = 1 + max(forced)
    costly = any(o.group and cap for o, cap in zip(offers, caps))
    best_ks, best_rate = None, last_rate
    # A position pays when its survival beats its own marginal cost e * R (R the best rate:
    # Dinkelbach's iteration for a ratio, started from the last step's rate; two rounds).
    for _ in range(2 if e > 0 else 1):
        threshold = e * best_rate
        worth = [len([x for x in o.survive if x > threshold]) for o in offers]  # non-increasing
        round_ks, round_rate, seen = None, 0.0, set()
        for width in range(narrowest, widest + 1):
            for proposing in ((False, True) if costly else (False,)):
                ks = tuple([max(min(cap, width - 1, w) if proposing or not o.group else 0, f)
                            for o, cap, w, f in zip(offers, caps, worth, forced)])
                if ks in seen:
                    continue
                seen.add(ks)
                forwards: dict[str, int] = {}
                for o, k in zip(offers, ks):
                    if o.group and k:
                        forwards[o.group] = max(forwards.get(o.group, 0), k)
                t = seconds(1 + max(ks), sum(ks), forwards, not pipelined or any(ks))
                rate = sum([x[k] for x, k in zip(expected, ks)]) / t
                if round_ks is None or rate > round_rate * (1.0 + margin) * 1.0001:
                    round_ks, round_rate = ks, rate
        if best_ks is None or round_rate >= best_rate:
            best_ks, best_rate = round_ks, round_rate
    return list(best_ks), best_rate


def _choose_alone(cost: StepCost, offer: RowOffer, span: int, pipelined: bool,
                  margin: float) -> tuple[list[int], float]:
    """`choose_ks` for one row by itself: every k in one pass (asked every step a row plans;
    the same choice as the general rule's exhaustive first round)."""
    group = offer.group
    best_k = 0
    best_rate = 1.0 / max(cost.time(1, 1, span=span, synced=not pipelined), 1e-12)
    expected = 1.0
    for k, survive in enumerate(offer.survive, 1):
        expected += survive
        t = cost.time(1, 1 + k, k, {group: k} if group else None, span)
        rate = expected / max(t, 1e-12)
        if rate > best_rate * (1.0 + margin) * 1.0001:
            best_k, best_rate = k, rate
    return [best_k], best_rate
