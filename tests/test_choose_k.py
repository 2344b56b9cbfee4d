"""`choose_k.py`: the k that pays most, for a row alone or several rows, from injected costs
and acceptance (no timing)."""

from helpers import offers

from mlxspec.choose_k import RowOffer, choose_ks
from mlxspec.cost import StepCost
from mlxspec.planning import BatchPolicy


def test_batch_policy_steps_plainly_when_proposals_do_not_pay_and_wide_when_they_do():
    """Injected costs and acceptance, no timing: with the prior cost 5 % acceptance makes a
    plain batch (W = 1), 60 % a middle width, 90 % the full width; a long context (attention
    over many keys for every padded position) turns the 60 % batch plain."""
    cost = StepCost()
    ks, _ = choose_ks(cost, offers(0.05, 4))
    assert ks == [0, 0, 0, 0]
    ks, rate = choose_ks(cost, offers(0.9, 4))
    assert ks == [4, 4, 4, 4]
    assert rate > 4 / cost.time(4, 1)  # beats the all-plain step it was compared with
    assert choose_ks(cost, offers(0.6, 4))[0] in ([2, 2, 2, 2], [3, 3, 3, 3])
    assert choose_ks(cost, offers(0.6, 4), span=4000)[0] == [0, 0, 0, 0]
    # an all-plain step queued behind the previous one (pipelined) is cheaper still
    assert cost.time(4, 1, synced=False) < cost.time(4, 1)


def test_a_row_whose_proposal_does_not_pay_proposes_nothing_while_another_speculates():
    cost = StepCost()
    # a draft row at 10 %: its draft forwards do not pay; the n-gram row at 90 % does
    good, bad = offers(0.9, 1)[0], offers(0.1, 1, group="draft")[0]
    assert choose_ks(cost, [good, bad])[0] == [4, 0]
    # draft rows at 90 % draft beside it (the shared draft forwards now pay)
    assert choose_ks(cost, [good] + offers(0.9, 2, group="draft"))[0] == [4, 4, 4]
    # a position below its marginal cost (e * rate) is not proposed even inside the width
    assert choose_ks(cost, [good, offers(0.01, 1)[0]])[0] == [4, 0]
    assert choose_ks(cost, [good, offers(0.5, 1)[0]])[0] == [4, 4]
    pricey = BatchPolicy(StepCost(prior=(1.0, 0.3, 0.05, 0.4, 0.3, 0.3)))  # 30 % per token
    assert pricey.decide([good, offers(0.5, 1)[0]]) == [3, 1]
    # a probe (forced) widens a batch that would step plainly; the others fill the width
    ks, _ = choose_ks(cost, offers(0.05, 3) + [RowOffer([0.4, 0.2], forced=2)])
    assert ks[3] == 2 and max(ks) == 2
    # caps hold: a row never proposes more than it offered
    assert choose_ks(cost, [RowOffer([0.9]), good])[0] == [1, 4]
