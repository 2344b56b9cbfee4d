"""A batch's planning: every row's k for one batched step (`BatchPolicy`, by `choose_k`'s
rule over the rows' offers) and a row's side of it (`RowPolicy`: its own policy's offer, a
shadow estimate of a fixed-k row, the watch of a source the batch kept plain). See
docs/HOW_IT_WORKS.md, "Several requests".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .caches.prompt import common_prefix_len
from .choose_k import RowOffer, choose_ks, survival
from .cost import StepCost, forward_group
from .policy import AdaptiveK, Policy

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
            r.planner.decided(source, offer, k, r.context)
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
            if self._watches_instead(source, available, context):
                return "", 0
            self._watch_free(available, source, context)
        return source, k

    def _watches_instead(self, source: str, available: dict[str, int],
                         context: list[int]) -> bool:
        """A probe of a free source (prompt lookup, the suffix store) is watched instead
        (`watch`): what it would have proposed, checked against the tokens committed, measures
        it as a probe would, for no wider forward and no plain stretch ended (on the bundled
        model, free text: the n-gram arms' probes were 1 % of the time, and the stretches
        they ended, each a synced step, 2 %). A draft model's probe is taken."""
        policy = self.policy
        if not isinstance(policy, AdaptiveK) or forward_group(source) or (
                policy.choose(source, available[source]) > 0):
            return False
        if self.watching is None:  # one look; the next when its probe is due again
            self.watch(source, min(available[source], policy.max_k), context)
            self.watch_for = None
        return True

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

    def decided(self, source: str, offer: RowOffer, k: int, context: list[int]) -> None:
        """The batch gave this row's offer from `source` k tokens: a free source proposing is
        measured by its step; one kept plain is watched; a draft kept plain (one running: a
        watch its offer started goes on) is not."""
        if not offer.group and k:
            self.watching = self.watch_for = None
        elif not offer.group:
            self.watch(source, len(offer.survive), context)
        elif not k:
            self.watch_for = None

    def at(self, span: int, pipelined: bool = True) -> None:
        """The row's cached length and whether its plain steps are pipelined, for its
        policies' cost predictions."""
        for policy in (self.policy, self.shadow):
            policy = getattr(policy, "inner", policy)  # (a sharded target's `SyncedPolicy`)
            if isinstance(policy, AdaptiveK):
                policy.span, policy.pipelined = span, pipelined

    def probing(self, source: str) -> bool:
        """Whether a proposal from `source` now is a probe: its arm is switched off (what the
        offer and `AdaptiveK.plan` force it for), as the deciding policy sees it."""
        policy = self.shadow or self.policy
        return isinstance(policy, AdaptiveK) and policy.choose(source) == 0

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
