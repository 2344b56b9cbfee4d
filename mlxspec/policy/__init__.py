"""The policies: how many tokens to propose per step, and from which source.

- `adaptive.py`: one request's (or one row's) policy, `FixedK` or `AdaptiveK` (source and k
  from measured acceptance and step cost), behind the `Policy` protocol; kept across
  processes (`read_states`, `write_states`).
- `batch.py`: the batch's, `BatchPolicy` (every row's k in one batched forward, from a
  measured cost by rows x width x context) and `RowPolicy` (a row's side of it).

A change of policy is a change here; the decode loop (`batch_step.py`) only asks and tells.
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
