"""The step kernel, for B >= 1 rows and k >= 0 (a plain step is k = 0): one target forward over
each row's [last committed token] + proposal, exact verification, then one host sync and the
rollback of what was rejected. `start_step` builds everything lazily (a driver may start the
next step before reading this one: pipelining), `finish_step` syncs and commits. The cache is
rows (`caches.rows`): one request's cache of any kind, or ragged rows. See
docs/HOW_IT_WORKS.md, "The loop". Invariant: each row's cache holds every committed token but
the last.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from .caches import Checkpoint
from .caches.rows import as_rows
from .proposal import Proposal
from .sampling import SamplingParams, probs_from_logits, sample
from .verify import greedy_accepted, verify_sampled


@dataclass
class StepResult:
    tokens: list[int]  # committed by this step: the accepted draft tokens, then the target's
    accepted: int  # draft tokens accepted (len(tokens) - 1)
    drafted: int  # draft positions verified (a tree: its depth)
    source: str  # the proposal's source, "" for a plain step


@dataclass
class StartedStep:
    """A step whose forward and verification are built (lazily), not read back yet."""

    rows: object  # the cache's rows
    fed: list[int | None]  # each row's last token (None: sat out, its padding trimmed)
    sizes: list[int]  # draft tokens verified per row
    greedy: list[bool]
    sources: list[str]
    width: int
    # A plain step (width 1): (B,) every slot's next token. Else, flat per fed row: greedy
    # argmax[:k+1] + draft; sampled n, next, draft (k = 0: next).
    out: mx.array
    ckpt: Checkpoint | None


def verify_chain(logits: mx.array, draft: mx.array, q: mx.array | None,
                 sampling: SamplingParams, key: mx.array | None) -> tuple[mx.array, mx.array]:
    """The exact rule for a sampled chain: logits (k + 1, vocab) over [last token] + draft
    (k,), q the draft's probabilities or None. Lazy (num_accepted, next_token)."""
    return verify_sampled(probs_from_logits(logits, sampling), draft, q, key)


def draw_next(logits: mx.array, samplings: list[SamplingParams],
              keys: list[mx.array | None]) -> mx.array:
    """Each row's next token from its last logits (B, vocab), lazily: greedy rows one argmax;
    a row with a key draws as `verify_chain` does with it; sampled rows without one draw
    together per sampling setting, from MLX's global generator (exact in distribution)."""
    tokens = mx.argmax(logits, axis=-1).astype(mx.uint32)
    groups: dict[SamplingParams | int, list[int]] = {}
    for b, (s, key) in enumerate(zip(samplings, keys)):
        if not s.greedy:
            groups.setdefault(b if key is not None else s, []).append(b)
    for group, members in groups.items():
        if isinstance(group, int):
            drawn = verify_chain(logits[group : group + 1], mx.array([], mx.uint32), None,
                                 samplings[group], keys[group])[1].reshape(1)
        else:
            drawn = sample(probs_from_logits(logits[mx.array(members, mx.int32)], group), None)
        tokens[mx.array(members, mx.int32)] = drawn.astype(mx.uint32)
    return tokens


def start_step(model: nn.Module, cache, last_tokens: list[int | None],
               proposals: list[Proposal | None], samplings: list[SamplingParams],
               keys: list[mx.array | None], max_accepts: list[int | None] | None = None,
               sync=None, inputs: mx.array | None = None) -> StartedStep:
    """Row b verifies proposals[b] (None or empty: plain) after last_tokens[b] (None: sits
    out), accepting at most max_accepts[b] draft tokens. `inputs`: a plain step's (B,) last
    tokens already on the device (a pipelined step feeds the previous one's, unread). `sync`
    (a sharded target) maps the result to rank 0's, so every rank commits the same tokens."""
    rows = as_rows(model, cache)
    if not rows.shared and len(last_tokens) != 1:
        raise ValueError("several rows need ragged rows (`caches.rows.RaggedRows`)")
    max_accepts = max_accepts or [None] * len(last_tokens)
    drafts, qs, sizes = [], [], []
    for prop, cap in zip(proposals, max_accepts):
        k = len(prop) if prop is not None else 0
        if k and prop.is_tree:
            raise ValueError("token trees run one row at a time, on its own cache")
        k = min(k, cap) if cap is not None else k
        sizes.append(k)
        drafts.append(prop.tokens[:k] if k else mx.array([], mx.uint32))
        qs.append(prop.draft_probs[:k] if k and prop.draft_probs is not None else None)
    width = 1 + max(sizes)
    if inputs is None:
        heads = [mx.array([0 if last is None else last], mx.uint32) for last in last_tokens]
        inputs = mx.stack([mx.concatenate([h, d, mx.repeat(h, width - 1 - k)])  # pad: trimmed
                           for h, d, k in zip(heads, drafts, sizes)])
    ckpt = rows.checkpoint()
    logits = model(inputs.reshape(len(last_tokens), width), cache=rows.layers)
    if None in last_tokens:  # a row sitting out: everything it was fed goes at once
        rows.trim_rows([width if last is None else 0 for last in last_tokens])
    if width == 1:  # plain: every slot's next token, read back by slot
        out = draw_next(logits[:, 0], samplings, keys)
    else:
        # greedy rows: one argmax over the batch, compared with the draft on the host
        argmax = (mx.argmax(logits, axis=-1).astype(mx.uint32)
                  if any(s.greedy for s in samplings) else None)
        outs = []
        for b, (draft, q, k) in enumerate(zip(drafts, qs, sizes)):
            if last_tokens[b] is None:
                continue
            if samplings[b].greedy:
                outs.append(mx.concatenate([argmax[b, : k + 1], draft]))
            elif not k:
                outs.append(draw_next(logits[b : b + 1, 0], samplings[b : b + 1], keys[b : b + 1]))
            else:
                n, t = verify_chain(logits[b, : k + 1], draft, q, samplings[b], keys[b])
                outs.append(mx.concatenate([mx.stack([n, t]).astype(mx.uint32), draft]))
        out = mx.concatenate(outs)
    if sync is not None:
        out = sync(out)
    sources = [prop.source if k else "" for prop, k in zip(proposals, sizes)]
    return StartedStep(rows, list(last_tokens), sizes, [s.greedy for s in samplings],
                       sources, width, out, ckpt)


def finish_step(step: StartedStep) -> list[StepResult | None]:
    """Read the step back (the one host sync) and roll back what was rejected."""
    flat = step.out.tolist()
    if step.width == 1:
        return [None if last is None else StepResult([t], 0, 0, "")
                for last, t in zip(step.fed, flat)]
    results, drop, fed_rows, at = [], [], [], 0
    for last, k, greedy, source in zip(step.fed, step.sizes, step.greedy, step.sources):
        if last is None:
            results.append(None)
            drop.append(0)  # (trimmed when the step started)
            fed_rows.append([])
            continue
        if not k and not greedy:
            n, nxt, drafted = 0, flat[at], []
            at += 1
        elif greedy:
            target, drafted = flat[at : at + k + 1], flat[at + k + 1 : at + 2 * k + 1]
            at += 2 * k + 1
            n = greedy_accepted(target, drafted)
            nxt = target[n]
        else:
            n, nxt, drafted = flat[at], flat[at + 1], flat[at + 2 : at + 2 + k]
            at += 2 + k
        drop.append(step.width - 1 - n)
        fed_rows.append([last] + drafted + [last] * (step.width - 1 - k))
        results.append(StepResult(drafted[:n] + [nxt], n, k, source))
    if any(drop):
        step.rows.trim_rows(drop, fed_rows, step.ckpt)
    return results


def decode_step(model: nn.Module, cache, last_tokens: list[int | None],
                proposals: list[Proposal | None], samplings: list[SamplingParams],
                keys: list[mx.array | None], max_accepts: list[int | None],
                sync=None) -> list[StepResult | None]:
    """One whole step (`start_step` then `finish_step`); a token tree on one row's own cache
    runs the tree step (`tree.py`)."""
    first = proposals[0]
    if len(last_tokens) == 1 and first is not None and len(first) and first.is_tree:
        from .tree import tree_step

        rows = as_rows(model, cache)
        if rows.shared:
            raise ValueError("token trees run one row at a time, on its own cache")
        tokens, n = tree_step(model, rows.layers, last_tokens[0], first, samplings[0], keys[0],
                              max_accept=max_accepts[0], sync=sync)
        return [StepResult(tokens, n, first.depth(), first.source)]
    return finish_step(start_step(model, cache, last_tokens, proposals, samplings, keys,
                                  max_accepts, sync))
