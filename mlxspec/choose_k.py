"""The k that pays most: expected tokens per second of a step for every width, for one row or
several (`choose_ks`), from each row's survival probabilities (`RowOffer`) and the cost model
(`cost.StepCost`).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from operator import mul

from .cost import PROPOSED, StepCost

# A row alone keeps the default k (`AdaptiveK.trusted_k`) unless another k is expected to beat
# it by this fraction: the estimates at other depths rest on fewer steps, and acceptance moves
# between requests more than they follow (on coder-pair chat, docs/PERFORMANCE.md)
KEEP_DEFAULT = 0.03


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
