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
