"""One decode step, the same for every mode: one target forward over [last committed token] +
proposal (a chain, a tree, or nothing), exact verification (`verify.py`, `tree_verify.py`), one
host sync, and the rollback of whatever was rejected (`caches.rollback`).

Invariant, before and after: the cache holds every committed token but the last.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from . import caches
from .proposal import Proposal
from .sampling import SamplingParams, probs_from_logits
from .verify import verify_greedy, verify_sampled


@dataclass
class StepResult:
    tokens: list[int]  # committed by this step: the accepted draft tokens, then the target's
    accepted: int  # draft tokens accepted (len(tokens) - 1)
    drafted: int  # draft positions verified (a tree: its depth)
    source: str  # the proposal's source, "" for a plain step


def verify_chain(logits: mx.array, draft: mx.array, q: mx.array | None,
                 sampling: SamplingParams, key: mx.array | None) -> tuple[mx.array, mx.array]:
    """The exact rule for a chain: logits (k + 1, vocab) over [last token] + draft (k,), q the
    draft's probabilities or None. Lazy (num_accepted, next_token). Shared by `decode_step` and
    the batched step (`batch_step.py`), which applies it to each row of its forward."""
    if sampling.greedy:
        return verify_greedy(logits, draft)
    return verify_sampled(probs_from_logits(logits, sampling), draft, q, key)


def decode_step(model: nn.Module, cache: list, last_token: int, proposal: Proposal | None,
                sampling: SamplingParams, key: mx.array | None,
                max_accept: int | None = None, sync=None) -> StepResult:
    """Verify `proposal` (None or empty: a plain step) after `last_token`; at most `max_accept`
    draft tokens are accepted (the caller's remaining budget). `sync` (a sharded target,
    `distributed.py`): maps the step's result array to rank 0's, inside the graph, before the
    host sync, so that every rank commits and rolls back the same tokens."""
    if proposal is not None and len(proposal) and proposal.is_tree:
        from .tree import tree_step

        tokens, n = tree_step(model, cache, last_token, proposal, sampling, key,
                              max_accept=max_accept, sync=sync)
        return StepResult(tokens, n, proposal.depth(), proposal.source)

    num_draft = len(proposal) if proposal is not None else 0
    if max_accept is not None:
        num_draft = min(num_draft, max_accept)
    if num_draft:
        draft = proposal.tokens[:num_draft]
        q = proposal.draft_probs[:num_draft] if proposal.draft_probs is not None else None
    else:
        draft, q = mx.array([], mx.uint32), None
    inputs = mx.concatenate([mx.array([last_token], mx.uint32), draft])
    ckpt = caches.checkpoint(cache) if num_draft else None
    logits = model(inputs[None], cache=cache)[0]
    num_accepted, next_token = verify_chain(logits, draft, q, sampling, key)
    head = mx.stack([num_accepted.astype(mx.uint32), next_token.astype(mx.uint32)])
    result = mx.concatenate([head, draft])
    if sync is not None:
        result = sync(result)
    result = result.tolist()  # the one host sync of the step
    n, drafted_tokens = result[0], result[2:]
    if n < num_draft:
        caches.rollback(model, cache, ckpt, [last_token] + drafted_tokens, 1 + n)
    return StepResult(drafted_tokens[:n] + [result[1]], n, num_draft,
                      proposal.source if num_draft else "")
