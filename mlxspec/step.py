"""One decode step for B >= 1 rows, every mode: one target forward over each row's [last
committed token] + proposal, exact verification, one host sync, rollback of what was rejected
(one row: any cache, `caches.rollback`; several: a `RaggedKVCache`, chains only). See
docs/HOW_IT_WORKS.md, "The loop". Invariant: each row's cache holds every committed token but
the last.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from . import caches
from .caches.ragged import RaggedKVCache
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
    draft's probabilities or None. Lazy (num_accepted, next_token)."""
    if sampling.greedy:
        return verify_greedy(logits, draft)
    return verify_sampled(probs_from_logits(logits, sampling), draft, q, key)


def decode_step(model: nn.Module, cache: list, last_tokens: list[int | None],
                proposals: list[Proposal | None], samplings: list[SamplingParams],
                keys: list[mx.array | None], max_accepts: list[int | None],
                sync=None) -> list[StepResult | None]:
    """Row b verifies proposals[b] (None or empty: plain) after last_tokens[b] (None: sits
    out, result None), accepting at most max_accepts[b] draft tokens. `sync` (a sharded
    target) maps the result array to rank 0's before the host sync, so every rank commits the
    same tokens."""
    ragged = isinstance(cache[0], RaggedKVCache)
    if not ragged and len(last_tokens) != 1:
        raise ValueError("several rows need a RaggedKVCache per layer")
    first = proposals[0]
    if not ragged and first is not None and len(first) and first.is_tree:
        from .tree import tree_step

        tokens, n = tree_step(model, cache, last_tokens[0], first, samplings[0], keys[0],
                              max_accept=max_accepts[0], sync=sync)
        return [StepResult(tokens, n, first.depth(), first.source)]

    drafts, qs, sizes = [], [], []
    for prop, cap in zip(proposals, max_accepts):
        k = len(prop) if prop is not None else 0
        if k and prop.is_tree:
            raise ValueError("token trees run one row at a time")
        k = min(k, cap) if cap is not None else k
        sizes.append(k)
        drafts.append(prop.tokens[:k] if k else mx.array([], mx.uint32))
        qs.append(prop.draft_probs[:k] if k and prop.draft_probs is not None else None)
    width = 1 + max(sizes)
    rows = []
    for last, draft, k in zip(last_tokens, drafts, sizes):
        last = 0 if last is None else last
        pad = mx.full((width - 1 - k,), last, mx.uint32)  # never seen: trimmed below
        rows.append(mx.concatenate([mx.array([last], mx.uint32), draft, pad]))
    ckpt = caches.checkpoint(cache) if not ragged and sizes[0] else None
    logits = model(mx.stack(rows), cache=cache)
    # Greedy rows: one argmax over the batch, compared on the host (what `verify_greedy`
    # computes); sampled rows: `verify_chain` each, on its own key.
    argmax = (mx.argmax(logits, axis=-1).astype(mx.uint32)
              if any(s.greedy for s in samplings) else None)
    heads = []
    for b, (draft, q, k) in enumerate(zip(drafts, qs, sizes)):
        if last_tokens[b] is None:
            continue
        if samplings[b].greedy:
            heads.append(mx.concatenate([argmax[b, : k + 1], draft]))
            continue
        n, nxt = verify_chain(logits[b, : k + 1], draft, q, samplings[b], keys[b])
        heads.append(mx.concatenate([mx.stack([n.astype(mx.uint32), nxt.astype(mx.uint32)]),
                                     draft]))
    flat = mx.concatenate(heads)
    if sync is not None:
        flat = sync(flat)
    flat = flat.tolist()  # the one host sync of the step
    results, drop, at = [], [], 0
    for last, prop, k, sampling in zip(last_tokens, proposals, sizes, samplings):
        if last is None:  # a row sitting this step out: everything it was fed goes
            drop.append(width)
            results.append(None)
            continue
        if sampling.greedy:
            target, drafted = flat[at : at + k + 1], flat[at + k + 1 : at + 2 * k + 1]
            at += 2 * k + 1
            n = next((i for i, (t, d) in enumerate(zip(target, drafted)) if t != d), k)
            nxt = target[n]
        else:
            n, nxt, drafted = flat[at], flat[at + 1], flat[at + 2 : at + 2 + k]
            at += 2 + k
        drop.append(width - 1 - n)
        results.append(StepResult(drafted[:n] + [nxt], n, k, prop.source if k else ""))
    if ragged:
        for c in cache:
            c.trim_rows(drop)
    elif n < k:  # one row: its fed tokens were [last] + drafted
        caches.rollback(model, cache, ckpt, [last_tokens[0]] + drafted, 1 + n)
    return results
