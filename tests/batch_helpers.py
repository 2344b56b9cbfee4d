"""Reading a batch row at a time: a helper for tests."""

from __future__ import annotations

from mlxspec.batch_step import BatchRow
from mlxspec.stopstrings import StepOutput


def next_output(row: BatchRow) -> StepOutput:
    """The row's next output, stepping its batch until there is one (StopIteration once the
    row has ended or left): for reading rows one at a time, in tests and benchmarks. The
    server steps each batch once a round and reads every row (`server/worker.py`)."""
    if row.opening is not None:  # its first token comes from its prefill, not a step
        row.batch._open_pending()
    while not (row.closed or row.finished):
        out = row.read()
        if out is not None:
            return out
        row.batch.step()
    raise StopIteration

