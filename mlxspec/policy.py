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
# A row alone keeps the default k (`AdaptiveK.trusted_k`) unless another k is expected to beat
# it by this fraction: the estimates at other depths rest on fewer steps, and acceptance moves
# between requests more than they follow (on coder-pair chat, docs/PERFORMANCE.md)
KEEP_DEFAULT = 0.03
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
    since_plain: int = 0  # synced steps measured since the last pipelined plain one
    # the fit, as floats (`time` is asked ~10 times a step); `_stale`: steps added since
    _terms: tuple[float, ...] = ()
    _stale: bool = True
    _unsolved: int = 0  # steps added since the last solve

    def _column(self, group: str) -> int:
        if group not in self.groups:
            self.groups.append(group)
            n = BASE + len(self.groups)
            xx, xt = np.zeros((n, n)), np.zeros(n)
            xx[: n - 1, : n - 1], xt[: n - 1] = self.xx, self.xt
            self.xx, self.xt, self._stale = xx, xt, True
        return BASE + self.groups.index(group)

    def _prior(self) -> np.ndarray:
        forwards = [self.forward_prior.get(g, self.prior[BASE]) for g in self.groups]
        return np.array(list(self.prior[:BASE]) + forwards)

    def coef(self) -> tuple[float, ...]:
        """The fitted coefficients of the features (solved again after steps were added)."""
        if self._stale:
            # the prior in seconds (1 per unit before any step: only ratios matter then)
            scale = self.seconds / self.prior_seconds if self.prior_seconds else 1.0
            prior = scale * self._prior()
            at = list(PRIOR_AT[:BASE]) + [PRIOR_AT[BASE]] * len(self.groups)
            ridge = self.prior_weight * np.square(at)
            coef = np.maximum(np.linalg.solve(self.xx + np.diag(ridge), self.xt + ridge * prior),
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

    def plain(self, span: int = 0) -> float:
        """Seconds of a pipelined plain step of one row."""
        return self.time(1, 1, span=span, synced=False)

    def add(self, rows: int, width: int, proposed: int, forwards: dict[str, int] | None,
            seconds: float, span: int = 0, synced: bool = True) -> None:
        values = self._values(rows, width, proposed, forwards, span, synced)
        if self.prior_seconds:  # a descheduled process or a GC pause is not the model's cost
            # the fit as of the last solve (at most 16 steps old): a plain stretch adds a
            # step every few ms but asks the fit only every few steps
            if not self._terms or self._unsolved >= 16 or len(self._terms) != len(values):
                self.coef()
            estimate = sum([c * x for c, x in zip(self._terms, values)])
            seconds = min(seconds, self.outlier * estimate)
        x, d = np.array(values), self.decay
        self.xx = self.xx * d + np.outer(x, x)
        self.xt = self.xt * d + x * seconds
        self.seconds = self.seconds * d + seconds
        self.prior_seconds = self.prior_seconds * d + float(np.dot(self._prior(), x))
        self.since_plain = self.since_plain + 1 if synced or proposed else 0
        self._stale, self._unsolved = True, self._unsolved + 1

    def restore(self, groups: list[str], xx: np.ndarray, xt: np.ndarray, seconds: float,
                prior_seconds: float) -> None:
        """Start from measurements kept by an earlier process (`policy_store`)."""
        self.groups, self.xx, self.xt = groups, xx, xt
        self.seconds, self.prior_seconds, self.since_plain, self._stale = (
            seconds, prior_seconds, 0, True)


@dataclass
class RowOffer:
    """What one row could propose this step."""

    survive: list[float]  # s_i = P(positions 1..i all accepted), i = 1..cap
    group: str = ""  # `forward_group` of its source: rows of one group share its forwards
    forced: int = 0  # propose at least this many (a probe), at most len(survive)
    probe: bool = False  # forced because the row's own policy probes a switched-off arm


def survival(accept_probs: list[float], cap: int) -> list[float]:
    """P(positions 1..i accepted) for i = 1..cap from per-position acceptance estimates."""
    return list(accumulate(accept_probs[:cap], mul))


def choose_ks(cost: StepCost, offers: list[RowOffer], last_rate: float = 0.0,
              rows: int | None = None, span: int = 0,
              pipelined: bool = False, default: int = 0) -> tuple[list[int], float]:
    """The per-row k maximising expected tokens per second, and that rate, over every width
    from the forced minimum to 1 + the largest cap, rows that cost forwards proposing or not
    (a row alone: `_choose_alone`). Plain Python: asked every step, over a few rows."""
    if not offers:
        return [], 0.0
    if len(offers) == 1 and not rows and not offers[0].forced:
        return _choose_alone(cost, offers[0], span, pipelined, default)
    rows = max(rows or 0, len(offers))
    e = cost.coef()[PROPOSED]

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
                if round_ks is None or rate > round_rate * 1.0001:
                    round_ks, round_rate = ks, rate
        if best_ks is None or round_rate >= best_rate:
            best_ks, best_rate = round_ks, round_rate
    return list(best_ks), best_rate


def _choose_alone(cost: StepCost, offer: RowOffer, span: int, pipelined: bool,
                  default: int) -> tuple[list[int], float]:
    """`choose_ks` for one row by itself: every k in one pass (asked every step a row plans;
    the general rule's exhaustive first round), the default k kept where speculating pays and
    no other k pays `KEEP_DEFAULT` more."""
    group, best_k, kept, default = offer.group, 0, 0.0, min(default, len(offer.survive))
    best_rate = 1.0 / max(cost.time(1, 1, span=span, synced=not pipelined), 1e-12)
    expected = 1.0
    for k, survive in enumerate(offer.survive, 1):
        expected += survive
        t = cost.time(1, 1 + k, k, {group: k} if group else None, span)
        rate = expected / max(t, 1e-12)
        if rate > best_rate * 1.0001:
            best_k, best_rate = k, rate
        if k == default:
            kept = rate
    if best_k and kept >= best_rate * (1.0 - KEEP_DEFAULT):
        return [default], kept
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
        return self.cost.plain(self.span)

    def step_time(self, source: str, k: int) -> float:
        """Predicted seconds of a step proposing k from `source` (0: a pipelined plain one)."""
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
            hit = choose_ks(self.cost, [offer], span=self.span, pipelined=True,
                            default=self.trusted_k)[0][0]
            self._memo[(source, limit)] = hit
        return hit

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
            # A probe costs its time beyond plain decoding; keep that under probe_budget.
            k = self.probe_k
            loss = self.step_time(source, k) / self.plain_time() - self.expected_tokens(source, k)
            loss = max(loss, lost)
            interval = max(interval, min(loss / self.probe_budget, 4 * self.probe_max))
        self.probes[source] = Probe(interval, self.clock + interval)


# -- a batch's policy: every row's k

# the acceptance at which a probed arm is judged: a probe is forced only where it could pay
OPTIMISTIC = 0.9


@dataclass
class BatchPolicy:
    """Chooses every row's k for a batched step; its `cost` learns each step's time (the loop
    adds them: `StepCost.add`)."""

    cost: StepCost = field(default_factory=StepCost)
    rate: float = 0.0  # tokens per second the last decision expected
    probe_gap: int = 64  # batched steps between two steps forced by a row's probe
    last_probe: int = -64  # the step that last forced one

    def decide(self, offers: list[RowOffer], rows: int | None = None, span: int = 0,
               pipelined: bool = False) -> list[int]:
        """Each row's k (0: none); `rows` the forward's batch size if rows sitting out are
        fed too, `span` the longest row's cached length, `pipelined` whether an all-plain step
        would be queued unsynced."""
        ks, self.rate = choose_ks(self.cost, offers, self.rate, rows, span, pipelined)
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
        cap = len(first.survive)
        hopeful[probing[0]] = RowOffer(survival([OPTIMISTIC] * cap, cap), first.group)
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
            if not offer.group and k:  # a free source proposing: its step measures it
                planner.watching = planner.watch_for = None
            elif not offer.group:  # kept plain: what it would have proposed is watched
                planner.watch(source, len(offer.survive), r.context)
            elif not k:  # a draft kept plain (one running: a watch its offer started goes on)
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
            shadow = self.shadow = AdaptiveK(max_k=max(policy.max_k, 1), cost=self.cost)
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
        if self.watching is not None:  # (a source that offered nothing waits for a plan)
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
