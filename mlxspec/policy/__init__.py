"""The policies: how many tokens to propose per step, and from which source. `cost.py`: the
one cost model of a step (`StepCost`) and the rule that picks k from it (`choose_ks`);
`adaptive.py`: one request's source and k (`FixedK`, `AdaptiveK`, kept across processes);
`batch.py`: a batch's widths (`BatchPolicy`, `RowPolicy`). The decode loop (`batch_step.py`)
only asks and tells them.
"""

from .adaptive import (
    AUTO_MAX_K,
    DEFAULT_NUM_DRAFT,
    MAX_NUM_DRAFT,
    AdaptiveK,
    FixedK,
    Policy,
    check_num_draft,
)
from .batch import BatchPolicy, RowPolicy
from .cost import RowOffer, StepCost, choose_ks, forward_group, survival

__all__ = ["AUTO_MAX_K", "DEFAULT_NUM_DRAFT", "MAX_NUM_DRAFT", "AdaptiveK", "BatchPolicy",
           "FixedK", "Policy", "RowOffer", "RowPolicy", "StepCost", "check_num_draft",
           "choose_ks", "forward_group", "survival"]
