"""A request's prompt into its cache, apart from decoding: the longest reusable prefix of
the prompt cache (`reuse`), the rest in chunks (`prefill`), several requests' rests in one
forward (`prefill_group`), and the request's proposer started on it (`start_proposer`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import mlx.core as mx

from . import caches
from .caches.prompt import PromptCache
from .caches.ragged import RaggedKVCache
from .proposers import auto
from .proposers.base import Proposer
from .proposers.draft import draft_proposer
from .request import Request
from .target import Target

# A joiner with at most this many prompt tokens left prefills with its round's other joiners
# (`Admission._open_pending`); longer ones by themselves: the model's head runs over
# every position of that forward.
GROUP_PREFILL_MAX = 64
# ... and one with more cached than this on its own cache (the group would copy its prefix)
GROUP_CACHED_MAX = 256


def start_proposer(target: Target, req: Request, prefill_seconds: float, cached: int,
                   shared: bool = False) -> None:
    """Start the request's proposer on its cached prompt (a draft's prefill counts too), and
    count the prefill (`cached`: prompt tokens reused). `auto`'s draft reads the prompt here
    too where its policy expects the draft to repay that over the request (else at its first
    proposal, if any): with the target's prefill, not as a step's cost, as the `draft` mode's
    does. Not for a request joining other rows (`shared`): there a draft's wider step costs
    every row and is rarely taken (grounded requests, 8 clients, the bundled pair: no draft
    proposal in 1,024 tokens), and reading every prompt up front took 1.4 % of the server's
    time."""
    start = time.perf_counter()
    if req.proposer is not None:
        req.proposer.set_prediction(req.prediction)
        req.proposer.reset(req.tokens, req.sampling)
        draft = draft_proposer(req.proposer)
        if draft is not None and not shared and auto.catch_up_at_start(
                req.policy, len(req.tokens) - 1 - len(draft.cached), req.max_tokens,
                target.meter.seconds_per_token):
            draft.catch_up(req.tokens)
    req.stats.prefilled(prefill_seconds + time.perf_counter() - start, cached)


def new_cache(target, proposer: Proposer | None) -> list:
    """A fresh cache for a request with `proposer` (`Target.new_cache`); `target`: a `Target`,
    or what holds one as `.target` (the server checks its engine's at start-up)."""
    return (target if isinstance(target, Target) else target.target).new_cache(proposer)


def reuse(target: Target, tokens: list[int], pc: PromptCache, proposer: Proposer | None,
          cache_reuse: int = 0) -> int:
    """Bring `pc` back to its longest reusable prefix of tokens[:-1] (a fresh cache when
    none), extended by chunks reused at shifted positions where `cache_reuse` > 0; how many
    tokens it keeps."""
    kind = target.cache_kind(proposer)
    keep = pc.reuse_prefix(tokens[:-1], kind, target.model if cache_reuse else None,
                           cache_reuse)
    if keep == 0:
        pc.hold(target.new_cache(proposer), [], kind)
    return keep


def prefill(target: Target, tokens: list[int], pc: PromptCache, proposer: Proposer | None,
            limit: int | None = None,
            progress: Callable[[int, int], None] | None = None) -> int:
    """Bring `pc` to hold tokens[:-1], reusing the longest prefix it can, at most `limit`
    new tokens in this call; returns how many tokens were reused."""
    keep = reuse(target, tokens, pc, proposer)
    goal = tokens[:-1]
    todo = goal[keep:] if limit is None else goal[keep : keep + limit]
    done, start = 0, time.perf_counter()
    try:
        while done < len(todo):
            chunk = todo[done : done + target.prefill_step_size]
            target.model(mx.array(chunk, mx.uint32)[None], cache=pc.cache)
            done += len(chunk)
            mx.eval([c.state for c in caches.leaves(pc.cache)])
            pc.fed(chunk)
            if progress is not None:
                progress(done, len(todo))
    except BaseException:
        pc.drop()  # state unknown mid-chunk
        raise
    # what a draft's catch-up costs is judged from it (`BatchRow.available`)
    target.meter.record(time.perf_counter() - start, done)
    if len(pc.tokens) == len(goal):
        pc.remember()
        if proposer is not None:  # a proposer that drafts on the target's own cache
            proposer.bind_cache(pc.cache)
    return keep


def prefill_group(model, group: list) -> list[int]:
    """The group's uncached prompt tokens through the target, right-padded in one forward
    (a row with more than GROUP_CACHED_MAX cached: by itself, on its own cache), each row's
    prompt cache then holding its whole prompt; returns the rows' first tokens, read back
    with one wait."""
    drawn: dict[int, mx.array] = {}
    rows = []
    for r in group:
        if len(r.pc.tokens) <= GROUP_CACHED_MAX:
            rows.append(r)
            continue
        todo = r.context[len(r.pc.tokens) :]
        logits = model(mx.array(todo, mx.uint32)[None], cache=r.pc.cache)
        r.pc.fed(todo)
        drawn[id(r)] = r.first_draw(logits[0, -1])
    if rows:
        todo = [r.context[len(r.pc.tokens) :] for r in rows]  # never empty: the last token
        width = max(len(t) for t in todo)
        layers = [RaggedKVCache() for _ in rows[0].pc.cache]
        for c in layers:
            c.add_empty_rows(len(rows))
        # the longest cached prefix first: its buffers then fit every row (one allocation)
        for i in sorted(range(len(rows)), key=lambda i: -len(rows[i].pc.tokens)):
            for ragged, c in zip(layers, rows[i].pc.cache):
                ragged.put_row(i, c)
        # padding after a row's own tokens: nothing real attends to it; trimmed at once
        inputs = mx.array([t + t[-1:] * (width - len(t)) for t in todo], mx.uint32)
        logits = model(inputs, cache=layers)
        last = logits[mx.arange(len(rows)), mx.array([len(t) - 1 for t in todo])]
        for c in layers:
            c.trim_rows([width - len(t) for t in todo])
        for j, r in enumerate(rows):
            drawn[id(r)] = r.first_draw(last[j])
            r.pc.hold([c.row_view(j) for c in layers], r.context)
    return mx.concatenate([drawn[id(r)] for r in group]).tolist()  # the group's one wait
