"""The policies: how many tokens to propose per step, and from which source. `adaptive.py`:
one request's (`FixedK`, `AdaptiveK`, kept across processes); `batch.py`: a batch's widths
(`BatchPolicy`, `RowPolicy`). The decode loop (`batch_step.py`) only asks and tells them.
"""

from .adaptive import (
    AUTO_MAX_K,
    DEFAULT_NUM_DRAFT,
    MAX_NUM_DRAFT,
    AdaptiveK,
    FixedK,
    Policy,
    check_num_draft,
    read_states,
    write_states,
)
from .batch import BatchCost, BatchPolicy, RowOffer, RowPolicy, choose_ks, plan_rows, survival

__all__ = ["AUTO_MAX_K", "DEFAULT_NUM_DRAFT", "MAX_NUM_DRAFT", "AdaptiveK", "BatchCost",
           "BatchPolicy", "FixedK", "Policy", "RowOffer", "RowPolicy", "check_num_draft",
           "choose_ks", "plan_rows", "read_states", "survival", "write_states"]
