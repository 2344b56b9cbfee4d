"""What a step costs: one model of a step's seconds (`StepCost`), from the rows and width of
its target forward, the tokens proposed and the forwards its proposals ran, fitted to the
measured steps. One per engine: a request alone and a batch learn the same model. See
docs/HOW_IT_WORKS.md, "Several requests".
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
# Pipelined plain steps are folded into the fit this many at a time: a plain step of a small
# model takes a few ms, and folding each at once (numpy's outer product, then a solve at the
# next plan) cost ~0.3 ms of it: auto 0.90x `none` on the bundled model's free text.
PENDING_PLAIN = 16
FREE_GROUPS = frozenset({"", "ngram", "prediction", "ngram-tree", "suffix", "lookahead"})


def cost_group(source: str) -> str:
    """The group a source's measurements are kept under: its name up to the first ':'."""
    return source.split(":", 1)[0]


def forward_group(source: str) -> str:
    """The group whose forwards a proposal from `source` runs ("" where it runs none)."""
    group = cost_group(source)
    return "" if group in FREE_GROUPS else group


def solve(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """x with a x = b for the fit's small system (a few columns), by Gaussian elimination with
    partial pivoting in Python: numpy's LAPACK and BLAS calls wake their own OpenBLAS
    threads, which then spin beside the model's forward (MLX's OpenBLAS) on the same cores:
    a plain step 5-10 % slower on a 2-core CPU."""
    n = len(b)
    rows = [list(map(float, r)) + [float(v)] for r, v in zip(a.tolist(), b.tolist())]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
        rows[col], rows[pivot] = rows[pivot], rows[col]
        head = rows[col]
        if head[col] == 0.0:
            raise np.linalg.LinAlgError("singular matrix")
        for r in range(col + 1, n):
            f = rows[r][col] / head[col]
            if f:
                row = rows[r]
                for c in range(col, n + 1):
                    row[c] -= f * head[c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        row = rows[r]
        x[r] = (row[n] - sum(row[c] * x[c] for c in range(r + 1, n))) / row[r]
    return np.array(x)


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
    since_plain: int = 0  # synced steps measured since the last pipelined plain one
    # the fit, as floats (`time` is asked ~10 times a step); `_stale`: steps added since
    _terms: tuple[float, ...] = ()
    _stale: bool = True
    _unsolved: int = 0  # steps added since the last solve
    # pipelined plain steps measured, not yet in the fit: decayed sums of their features'
    # products and times, and their count (`_add_plain`)
    _pending: list = field(default_factory=list)

    def _column(self, group: str) -> int:
        if group not in self.groups:
            self.groups.append(group)
            n = BASE + len(self.groups)
            xx, xt = np.zeros((n, n)), np.zeros(n)
            xx[: n - 1, : n - 1], xt[: n - 1] = self.xx, self.xt
            self.xx, self.xt, self._stale = xx, xt, True
        return BASE + self.groups.index(group)

    def _prior(self) -> np.ndarray:
        forwards = []  # (loops, not comprehensions, here and in `add`: asked every step)
        for g in self.groups:
            forwards.append(self.forward_prior.get(g, self.prior[BASE]))
        return np.array(list(self.prior[:BASE]) + forwards)

    def coef(self) -> tuple[float, ...]:
        """The fitted coefficients of the features (solved again after steps were added)."""
        if self._stale:
            # the prior in seconds (1 per unit before any step: only ratios matter then)
            scale = self.seconds / self.prior_seconds if self.prior_seconds else 1.0
            prior = scale * self._prior()
            at = list(PRIOR_AT[:BASE]) + [PRIOR_AT[BASE]] * len(self.groups)
            ridge = self.prior_weight * np.square(at)
            coef = np.maximum(solve(self.xx + np.diag(ridge), self.xt + ridge * prior),
                              0.0)  # no term makes a step faster
            coef[0] = max(coef[0], 0.1 * prior[0])
            self._terms, self._stale, self._unsolved = tuple(coef.tolist()), False, 0
        return self._terms

    def _values(self, rows, width, proposed, forwards, span, synced) -> list[float]:
        queries = rows * width
        values = [1.0, float(synced), queries, queries * (span + width) / 1024, proposed]
        for group, n in (forwards or {}).items():
            if group:
                column = self._column(group)
                values += [0.0] * (column + 1 - len(values))
                values[column] += n
        return values + [0.0] * (BASE + len(self.groups) - len(values))

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
        c = self.coef() if self._stale else self._terms
        queries = rows * width
        t = (c[0] + c[1] * synced + c[2] * queries + c[3] * queries * (span + width) / 1024
             + c[PROPOSED] * proposed)
        if forwards:
            for group, n in forwards.items():
                if group:
                    t += c[BASE + self.groups.index(group)] * n
        return t

    def plain(self, span: int = 0, pipelined: bool = True) -> float:
        """Seconds of a plain step of one row, pipelined (no sync) or not."""
        return self.time(1, 1, span=span, synced=not pipelined)

    def add(self, rows: int, width: int, proposed: int, forwards: dict[str, int] | None,
            seconds: float, span: int = 0, synced: bool = True) -> None:
        if not synced and not proposed and self.prior_seconds and self._terms:
            self._add_plain(rows, seconds, span)
            return
        values = self._values(rows, width, proposed, forwards, span, synced)
        if self.prior_seconds:  # a descheduled process or a GC pause is not the model's cost
            # the fit as of the last solve (at most 16 steps old): a plain stretch adds a
            # step every few ms but asks the fit only every few steps
            if not self._terms or self._unsolved >= 16 or len(self._terms) != len(values):
                self.coef()
            estimate = sum(map(mul, self._terms, values))
            seconds = min(seconds, self.outlier * estimate)
        self.fold()
        x, d = np.array(values), self.decay
        self.xx = self.xx * d + np.outer(x, x)
        self.xt = self.xt * d + x * seconds
        self.seconds = self.seconds * d + seconds
        self.prior_seconds = self.prior_seconds * d + float((self._prior() * x).sum())
        self.since_plain = self.since_plain + 1 if synced or proposed else 0
        self._stale, self._unsolved = True, self._unsolved + 1

    def _add_plain(self, rows: int, seconds: float, span: int) -> None:
        """A pipelined plain step (features 1, Q = rows, G = Q (span + 1) / 1024, the rest
        0): its products go into decayed running sums, folded into the fit `PENDING_PLAIN`
        steps at a time (`fold`): exactly what adding each step at once would give, for a
        few float operations a step (a plain step of a small model takes a few ms, all of it
        on the host on MLX's CPU backend)."""
        if self._unsolved >= 16:
            self.coef()
        c, q = self._terms, float(rows)
        g = q * (span + 1) / 1024
        seconds = min(seconds, self.outlier * (c[0] + c[2] * q + c[3] * g))
        sums, d = self._pending, self.decay
        if not sums:
            sums.extend([0.0] * 10)
        for i, v in enumerate((1.0, q, g, q * q, q * g, g * g, seconds, q * seconds,
                               g * seconds)):
            sums[i] = sums[i] * d + v
        sums[9] += 1  # steps
        self.since_plain = 0
        if sums[9] >= PENDING_PLAIN:
            self.fold()

    def fold(self) -> None:
        """Fold the pending plain steps' sums into the fit's (`_add_plain`)."""
        sums = self._pending
        if not sums:
            return
        self._pending = []
        w, q, g, qq, qg, gg, t, qt, gt, n = sums
        scale = self.decay ** n
        xx, xt = self.xx * scale, self.xt * scale
        # the features' indices: 0 (one), 2 (Q), 3 (G)
        for (i, j), v in (((0, 0), w), ((0, 2), q), ((0, 3), g), ((2, 2), qq), ((2, 3), qg),
                          ((3, 3), gg)):
            xx[i, j] += v
            if i != j:
                xx[j, i] += v
        xt[0] += t
        xt[2] += qt
        xt[3] += gt
        prior = self._prior()
        self.xx, self.xt = xx, xt
        self.seconds = self.seconds * scale + t
        self.prior_seconds = (self.prior_seconds * scale
                              + float(prior[0] * w + prior[2] * q + prior[3] * g))
        self._stale, self._unsolved = True, self._unsolved + int(n)

    def restore(self, groups: list[str], xx: np.ndarray, xt: np.ndarray, seconds: float,
                prior_seconds: float) -> None:
        """Start from measurements kept by an earlier process (`policy_store`)."""
        self.groups, self.xx, self.xt, self._pending = groups, xx, xt, []
        self.seconds, self.prior_seconds, self.since_plain, self._stale = (
            seconds, prior_seconds, 0, True)
