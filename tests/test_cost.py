"""`cost.py`: the step's cost model learns measured times and predicts the features' effect
(rows, width, context, proposals, a draft's forwards)."""

import pytest

from mlxspec.cost import StepCost, forward_group


def test_the_fit_learns_a_draft_forwards_price_and_width():
    cost = StepCost()

    def seconds(width, forwards):
        return 0.01 + 0.002 * width + 0.004 * forwards

    for _ in range(30):
        for width, n in ((1, 0), (3, 2), (5, 4), (2, 0), (4, 0)):
            cost.add(1, width, width - 1, {"draft": n} if n else None, seconds(width, n))
    assert cost.time(1, 5, 4, {"draft": 4}) == pytest.approx(seconds(5, 4), rel=0.15)
    assert cost.time(1, 5, 4, {"draft": 4}) > cost.time(1, 5, 4)  # the forwards cost
    assert cost.plain() < cost.time(1, 1)  # a pipelined plain step: no sync


def test_an_outlier_is_capped_at_a_multiple_of_its_estimate():
    cost = StepCost()
    for _ in range(20):
        cost.add(1, 1, 0, None, 0.01)
    cost.add(1, 1, 0, None, 10.0)  # a descheduled process
    assert cost.time(1, 1) < 0.02


def test_sources_that_run_no_model_have_no_forward_group():
    assert forward_group("ngram:4") == "" and forward_group("draft") == "draft"


def test_plain_steps_folded_in_batches_give_the_sums_of_one_at_a_time():
    """Pipelined plain steps wait as running sums and are folded `PENDING_PLAIN` at a time:
    the fit's sums, decayed in order, are those of adding each at once (a draft step between
    them folds the waiting ones first)."""
    import numpy as np

    cost = StepCost()
    steps = [(1 + 2 * (i % 5 == 0), 1, 0, None, 0.010 + 0.0001 * i, 40 + i, False)
             for i in range(37)]  # (a batch of 3 rows now and then)
    steps.insert(20, (1, 3, 2, {"draft": 2}, 0.03, 60, True))
    steps.insert(0, (1, 1, 0, None, 0.02, 39, True))  # (the first step is never held)
    for rows, width, proposed, forwards, seconds, span, synced in steps:
        cost.add(rows, width, proposed, forwards, seconds, span, synced)
    waiting = cost._pending[-1]  # the last few wait for the next fold
    assert 0 < waiting < 16

    # the same steps one at a time (times capped as `add` caps them: none is an outlier here)
    xx, xt, total, d = np.zeros((6, 6)), np.zeros(6), 0.0, cost.decay
    for rows, width, proposed, forwards, seconds, span, synced in steps:
        x = np.array(cost._values(rows, width, proposed, forwards, span, synced))
        xx, xt, total = xx * d + np.outer(x, x), xt * d + x * seconds, total * d + seconds
    cost.fold()
    assert not cost._pending
    np.testing.assert_allclose(cost.xx, xx, rtol=1e-12)
    np.testing.assert_allclose(cost.xt, xt, rtol=1e-12)
    assert cost.seconds == pytest.approx(total, rel=1e-12)
