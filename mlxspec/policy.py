"""The policy: how many tokens to propose per step, and from which source. One cost model of a
step (`StepCost`) and one planning rule (`choose_ks`) for a request alone (a batch of one row)
and for rows in a batch; a request's source and k (`FixedK`, `AdaptiveK`, kept across
processes); a batch's widths (`BatchPolicy`, `RowPolicy`). The decode loop (`batch_step.py`)
only asks and tells them; exactness never depends on them. See docs/HOW_IT_WORKS.md,
"Several requests" and `auto.py` under "Proposers".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from operator import mul
from typing import Protocol

import numpy as np

from .caches.prompt import common_prefix_len
from .errors import MlxspecError
from .proposal import DRAFT_TREE, LOOKUP_DRAFT

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


# -- a request's policy: source and k

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
    trusted_k: int = DEFAULT_NUM_DRAFT  # k proposed before deeper positions are measured
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
        reach = self.reach(source)
        limit = reach if limit is None else min(limit, reach)
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
            if phase == 1 and best_k < min(available[best_source], self.reach(best_source)):
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

    from .proposers.draft import TREE_WIDTH

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


# -- a batch's policy: every row's k

# the acceptance at which a probed arm is judged: a probe is forced only where it could pay
OPTIMISTIC = 0.9


@dataclass
class BatchPolicy:
    """Chooses every row's k for a batched step; its `cost` learns each step's time (the loop
    adds them: `StepCost.add`)."""

    cost: StepCost = field(default_factory=StepCost)
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

    def limit_probes(self, offers: list[tuple[str, RowOffer]], step: int, commit: bool = True,
                     rows: int | None = None, span: int = 0,
                     pipelined: bool = False) -> list[tuple[str, RowOffer]]:
        """Force probes at most once every `probe_gap` steps, and only where the first
        probing row's arm could pay here at `OPTIMISTIC` acceptance (a forced probe widens and
        syncs the whole batch); one not forced stays due. `commit=False`: only asking."""
        probing = [i for i, (_, o) in enumerate(offers) if o.probe]
        if not probing:
            return offers
        unforced = [(source, RowOffer(o.survive, o.group) if o.probe else o)
                    for source, o in offers]
        if step - self.last_probe < self.probe_gap:
            return unforced
        if commit:
            self.last_probe = step
        first = offers[probing[0]][1]
        hopeful = [o for _, o in unforced]
        hopeful[probing[0]] = RowOffer(survival([OPTIMISTIC] * first.cap, first.cap),
                                       first.group)
        ks, _ = choose_ks(self.cost, hopeful, rows=rows, span=span, pipelined=pipelined)
        return offers if ks[probing[0]] else unforced

    def plan_rows(self, rows: list, step: int, commit: bool, slots: int, span: int,
                  pipelined: bool) -> list[tuple[str, int]]:
        """Every row's (source, k) for a batched step; a row kept plain watches its source
        unless a draft's (its tokens cost forwards). `commit=False`: only asking."""
        offers = self.limit_probes([r.offer() for r in rows], step, commit, slots, span,
                                   pipelined)
        ks = self.decide([o for _, o in offers], rows=slots, span=span, pipelined=pipelined)
        for r, (source, offer), k in zip(rows, offers, ks):
            planner = r.planner
            if k and offer.group:
                pass  # a draft runs: the watch of a free source its offer started goes on
            elif k:
                planner.watching = planner.watch_for = None  # measured by the step itself
            elif not offer.group:
                planner.watch(source, offer.cap, r.context)
            else:
                planner.watch_for = None
        return [(source, k) for (source, _), k in zip(offers, ks)]


class RowPolicy:
    """A row's side of the batch's planning: its own policy, a `shadow` AdaptiveK measuring a
    FixedK row's acceptance, and the watch of a source the batch kept plain."""

    def __init__(self, policy: Policy, proposer, cost: StepCost):
        self.policy, self.proposer, self.cost = policy, proposer, cost
        # made at the first offer to a shared batch (`offer`): a row alone plans by its policy
        self.shadow: AdaptiveK | None = None
        # (context length, source, tokens): what a free source kept plain would have proposed
        self.watching: tuple[int, str, list[int]] | None = None
        # (source, k) the last plan kept plain: watched after each watch ends, till the next plan
        self.watch_for: tuple[str, int] | None = None

    def plan(self, available: dict[str, int] | None,
             context: list[int] | None = None) -> tuple[str, int]:
        """The row's own plan, as if alone (asked even when nothing is offered, so that a
        sharded rank's policy agrees with rank 0's). Where it runs a draft model, the free
        source that offered most is watched (`watch`, given the row's `context`): a free
        source never taken keeps its prior for good, and a same-family draft's higher prior
        would keep paying draft forwards for what prompt lookup proposes for nothing."""
        if available is None:
            return "", 0
        source, k = self.policy.plan(available)
        if k and context is not None:
            self._watch_free(available, source, context)
        return source, k

    def _watch_free(self, available: dict[str, int], source: str, context: list[int]) -> None:
        """The row proposes from `source`: where that runs a model, watch the free source that
        offered most; where it is free, its own step measures it."""
        if not isinstance(self.policy, AdaptiveK):
            return
        free = {s: n for s, n in available.items() if n > 0 and not forward_group(s)} if (
            forward_group(source)) else None
        if not free:
            self.watching = self.watch_for = None
            return
        best = max(free, key=free.get)
        self.watch(best, min(free[best], self.policy.max_k), context)

    def offer(self, available: dict[str, int],
              context: list[int] | None = None) -> tuple[str, RowOffer]:
        """The source the row proposes from (its policy's choice) and what it offers the batch.
        A probe is forced (it keeps its own schedule). An adaptive row offering a draft watches a free source meanwhile (`plan`), given its
        `context`."""
        policy, shadow = self.policy, self.shadow
        if not available:
            return "", RowOffer([])
        if shadow is None and not isinstance(policy, AdaptiveK):
            # the shadow prices k with the batch's cost model (`cost`): the one that decides
            shadow = self.shadow = AdaptiveK(max_k=max(policy.max_k, 1), dither=False,
                                             cost=self.cost)
        if shadow is not None:
            source, k = policy.plan(available)
            if not k:
                return "", RowOffer([])
            policy, available = shadow, {source: k}
        source, k = policy.plan(available)
        if k and policy.choose(source, available[source]) == 0:  # a probe
            return source, RowOffer(survival(policy.accept_probs(source), k),
                                    forward_group(source), forced=k, probe=True)
        if not k:  # arms off or t_plain due: its best offer, taken only where it pays
            offered = {s: min(n, policy.reach(s)) for s, n in available.items() if n > 0}
            if not offered:
                return "", RowOffer([])
            source = max(offered, key=lambda s: policy.expected_tokens(s, offered[s]))
        n = min(available[source], policy.reach(source))
        if context is not None and policy is self.policy and forward_group(source):
            self._watch_free(available, source, context)  # (a free one: the batch's to watch)
        return source, RowOffer(survival(policy.accept_probs(source), n), forward_group(source))

    def at(self, span: int) -> None:
        """The row's cached length, for its policies' cost predictions."""
        for policy in (self.policy, self.shadow):
            policy = getattr(policy, "inner", policy)  # (a sharded target's `SyncedPolicy`)
            if isinstance(policy, AdaptiveK):
                policy.span = span

    def observe(self, source: str, drafted: int, accepted: int, seconds: float | None,
                context: list[int]) -> None:
        """A speculative step from `source` (`seconds`: its time, or None), or a plain one
        (drafted 0); `context`: the row's committed tokens after it."""
        for policy in (self.policy, self.shadow):
            if policy is None:
                continue
            if drafted:
                policy.observe(source, drafted, accepted, seconds)
            else:
                policy.observe_plain(1)
        if self.watching is not None:
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
