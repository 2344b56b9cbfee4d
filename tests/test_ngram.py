"""The incremental n-gram index against a brute-force reference."""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from mlxspec.proposers.ngram import NgramIndex, NgramProposer
from mlxspec.sampling import SamplingParams


def brute_force(context: list[int], num: int, min_n: int, max_n: int) -> list[int]:
    """Tokens after the most recent earlier occurrence of the longest matching suffix."""
    for n in range(min(max_n, len(context) - 1), min_n - 1, -1):
        suffix = context[len(context) - n :]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start : start + n] == suffix:
                return context[start + n : start + n + num]
    return []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=60), st.integers(1, 3),
       st.integers(0, 3), st.integers(1, 8), st.integers(1, 10))
def test_index_matches_brute_force(tokens, min_n, extra, num, split):
    max_n = min_n + extra
    index = NgramIndex(min_n, max_n)
    # Extend in two pieces: incremental updates must equal one-shot indexing.
    index.extend(tokens[:split])
    index.extend(tokens[split:])
    got, _ = index.lookup(tokens[-max_n:], num)
    assert got == brute_force(tokens, num, min_n, max_n)


def test_prediction_is_preferred():
    proposer = NgramProposer(min_ngram=1, max_ngram=3)
    proposer.set_prediction([10, 11, 12, 13, 14])
    proposer.reset([1, 11, 99], SamplingParams())
    proposal = proposer.propose([1, 11, 99, 5, 11], 3, None)
    assert proposal.tokens.tolist() == [12, 13, 14] and proposal.source == "prediction"
    proposer.set_prediction(None)
    proposal = proposer.propose([1, 11, 99, 5, 11], 3, None)
    assert proposal.tokens.tolist() == [99, 5, 11] and proposal.source == "ngram"


def test_proposal_cost_is_independent_of_context_length():
    proposer = NgramProposer(min_ngram=1, max_ngram=4)
    context = [(i * 7919) % 5000 for i in range(32_768)]
    proposer.reset(context, SamplingParams())
    start = time.perf_counter()
    for _ in range(1000):
        proposer.propose(context, 8, None)
    per_proposal = (time.perf_counter() - start) / 1000
    # Generous bound for a loaded CI machine; measured ~10 us here.
    assert per_proposal < 1e-3
