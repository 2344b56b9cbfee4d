"""How many tokens to propose per step, and from which source: one object per engine, asked
once per step (`plan`), told the outcome after (`observe`).

`FixedK` always proposes k. `AdaptiveK` keeps, per proposal source, running estimates of the
acceptance probability at each draft position and of the step time as a function of k, and picks
the k that maximises expected tokens per second:

    E(k) = 1 + sum_{i=1..k} prod_{j<=i} a_j        (tokens a step emits)
    T(k) = t_plain + k * slope_source               (seconds a step takes)
    k*   = argmax_k E(k) / T(k),  k = 0 meaning "do not speculate"

Costs differ by orders of magnitude between backends (a verify of k tokens is nearly free on a
GPU, linear in k on a CPU without a good BLAS), so both are measured, never assumed.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FixedK:
    """Always propose `num_draft` tokens (fewer near max_tokens), from the first source that
    has any."""

    num_draft: int = 4

    @property
    def max_k(self) -> int:
        return self.num_draft

    def plan(self, available: dict[str, int]) -> tuple[str, int]:
        for source, n in available.items():
            if n > 0:
                return source, min(n, self.num_draft)
        return "", 0

    def observe(self, source: str, drafted: int, accepted: int, seconds: float) -> None:
        pass


@dataclass
class SourceEstimate:
    """Decayed counts of (reached, accepted) per draft position and of the marginal step time."""

    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    slope_sum: float = 0.0  # decayed sum of (step time - plain step time) / k
    slope_weight: float = 0.0


@dataclass
class AdaptiveK:
    """Choose k per step from measured acceptance and cost (see module docstring)."""

    max_k: int = 8
    decay: float = 0.99  # per observation (~100 steps of memory): follows content as it changes
    prior_accept: float = 0.5
    prior_strength: float = 2.0  # pseudo-observations behind the prior
    prior_slope: float = 0.05  # marginal cost of one more token, as a fraction of a plain step
    sources: dict[str, SourceEstimate] = field(default_factory=dict)
    plain_time: float = 0.0  # decayed mean seconds of a step that verifies nothing
    plain_weight: float = 0.0
    probe_every: int = 16  # while a source is switched off, try it again this often (in steps)
    probe_k: int = 2
    plain_every: int = 64  # measure a plain step this often: every cost is relative to it
    _off_steps: dict[str, int] = field(default_factory=dict)
    _since_plain: int = 0
    _offered: list[str] = field(default_factory=list)

    # -- estimates
    def accept_probs(self, source: str) -> list[float]:
        """P(accept position i | positions < i accepted). Each position is shrunk towards the
        one before it, so positions not tried yet borrow the nearest measured estimate."""
        est = self.sources.get(source)
        probs, previous = [], self.prior_accept
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

    def step_time(self, source: str, k: int) -> float:
        plain = self.plain_time if self.plain_weight else 1.0
        est = self.sources.get(source)
        if est and est.slope_weight:
            slope = est.slope_sum / est.slope_weight
        else:
            slope = self.prior_slope * plain
        return plain + k * max(slope, 0.0)

    # -- decisions
    def choose(self, source: str, limit: int | None = None) -> int:
        """The k <= limit with the highest expected tokens per second (0: do not speculate)."""
        best_k, best = 0, 1.0 / self.step_time(source, 0)
        for k in range(1, min(self.max_k, self.max_k if limit is None else limit) + 1):
            rate = self.expected_tokens(source, k) / self.step_time(source, k)
            if rate > best * 1.0001:
                best_k, best = k, rate
        return best_k

    def plan(self, available: dict[str, int]) -> tuple[str, int]:
        """The source and k for this step (("", 0): a plain step). Idempotent: the counters
        move in `observe`. A source switched off is probed every `probe_every` steps it was
        offered, so that its estimates follow content that has become predictable again."""
        self._offered = [s for s, n in available.items() if n > 0]
        if self.plain_weight < 1.0 or self._since_plain >= self.plain_every:
            return "", 0  # (re)measure the plain step first
        best_source, best_k, best_rate = "", 0, 0.0
        for source in self._offered:
            n = available[source]
            k = self.choose(source, n)
            if k == 0:
                if self._off_steps.get(source, 0) >= self.probe_every:
                    return source, min(self.probe_k, n)
                continue
            rate = self.expected_rate(source, k)
            if rate > best_rate:
                best_source, best_k, best_rate = source, k, rate
        return best_source, best_k

    def expected_rate(self, source: str, k: int) -> float:
        return self.expected_tokens(source, k) / self.step_time(source, k)

    # -- learning
    def observe(self, source: str, drafted: int, accepted: int, seconds: float) -> None:
        d = self.decay
        self._since_plain = 0 if not drafted else self._since_plain + 1
        for offered in self._offered:  # counts toward the next probe of a switched-off source
            self._off_steps[offered] = 0 if (drafted and offered == source) else (
                self._off_steps.get(offered, 0) + 1)
        self._offered = []
        if not drafted:
            self.plain_time = (self.plain_time * self.plain_weight * d + seconds) / (
                self.plain_weight * d + 1.0)
            self.plain_weight = self.plain_weight * d + 1.0
            return
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
        if self.plain_weight:
            est.slope_sum = est.slope_sum * d + (seconds - self.plain_time) / drafted
            est.slope_weight = est.slope_weight * d + 1.0
