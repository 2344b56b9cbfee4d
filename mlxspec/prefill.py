"""A request's prompt into its cache, apart from decoding: the longest reusable prefix of
the prompt cache (`reuse`), the rest in chunks (`prefill`), several requests' rests in one
forward (`prefill_group`), and the request's proposer started on it (`start_proposer`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import mlx.core as mx

from . import caches
from .caches.prompt import PromptCache
from .caches.ragged import RaggedKVCache
from .proposers import auto
from .proposers.base import Proposer
from .proposers.draft import draft_proposer

if TYPE_CHECKING:
    from .engine import Engine
    from .request import Request

# A joiner with at most this many prompt tokens left prefills with its round's other joiners
# (`Admission._open_pending`); longer ones by themselves: the model's head runs over
# every position of that forward.
GROUP_PREFILL_MAX = 64
# ... and one with more cached than this on its own cache (the group would copy its prefix)
GROUP_CACHED_MAX = 256


def start_proposer(engine: Engine, req: Request, prefill_seconds: float) -> None:
    """Start the request's proposer on its cached prompt (a draft's prefill counts too).
    `auto`'s draft reads the prompt here too where its policy expects the draft to repay
    that over the request (else at its first proposal, if any): with the target's prefill,
    not as a step's cost, as the `draft` mode's does."""
    start = time.perf_counter()
    if req.proposer is not None:
        req.proposer.reset(req.tokens, req.sampling)
        draft = draft_proposer(req.proposer)
        if draft is not None and auto.catch_up_at_start(
                req.policy, len(req.tokens) - 1 - len(draft.cached), req.max_tokens,
                engine.prefill_seconds_per_token):
            draft.catch_up(req.tokens)
    req.stats.prefill_seconds = prefill_seconds + time.perf_counter() - start


def cache_kind(engine: Engine, proposer: Proposer | None) -> str:
    """The kind of target cache a request with `proposer` runs on (a prompt cache of another
    kind is not reused)."""
    if proposer is not None and proposer.cache_kind != "kv":
        return proposer.cache_kind
    if engine.kv == "hierarchical":
        return f"hierarchical-ref:{engine.kv_group_size}:{engine.kv_buffer_size}"
    return "kv"


def new_cache(engine: Engine, proposer: Proposer | None) -> list:
    """A fresh target cache of that kind."""
    made = proposer.make_target_cache(engine.model) if proposer is not None else None
    if made is not None:
        return made
    if engine.kv == "hierarchical":
        from .quant.hierarchical_cache import make_reference_cache

        return make_reference_cache(engine.model, engine.kv_group_size, engine.kv_buffer_size)
    return caches.make_cache(engine.model)


def reuse(engine: Engine, tokens: list[int], pc: PromptCache, proposer: Proposer | None,
          cache_reuse: int = 0) -> int:
    """Bring `pc` back to its longest reusable prefix of tokens[:-1] (a fresh cache when
    none), extended by chunks reused at shifted positions where `cache_reuse` > 0; how many
    tokens it keeps."""
    kind = cache_kind(engine, proposer)
    keep = pc.reuse_prefix(tokens[:-1], kind, engine.model if cache_reuse else None,
                           cache_reuse)
    if keep == 0:
        pc.cache, pc.kind, pc.checkpoint = new_cache(engine, proposer), kind, None
    pc.tokens = tokens[:keep]
    return keep


def prefill(engine: Engine, tokens: list[int], pc: PromptCache, proposer: Proposer | None,
            limit: int | None = None,
            progress: Callable[[int, int], None] | None = None) -> int:
    """Bring `pc` to hold tokens[:-1], reusing the longest prefix it can, at most `limit`
    new tokens in this call; returns how many tokens were reused."""
    keep = reuse(engine, tokens, pc, proposer)
    target = tokens[:-1]
    todo = target[keep:] if limit is None else target[keep : keep + limit]
    done, start = 0, time.perf_counter()
    try:
        while done < len(todo):
            chunk = todo[done : done + engine.prefill_step_size]
            engine.model(mx.array(chunk, mx.uint32)[None], cache=pc.cache)
            done += len(chunk)
            mx.eval([c.state for c in caches.leaves(pc.cache)])
            pc.tokens = target[: keep + done]
            if progress is not None:
                progress(done, len(todo))
    except BaseException:
        pc.drop()  # state unknown mid-chunk
        raise
    if done >= 16:  # what a draft's catch-up costs is judged from it (`BatchRow.available`)
        engine.prefill_seconds_per_token = (time.perf_counter() - start) / done
    if len(pc.tokens) == len(target):
        pc.remember()
        if proposer is not None:  # a proposer that drafts on the target's own cache
            proposer.bind_cache(pc.cache)
    return keep


def prefill_group(model, group: list) -> list[int]:
    """The group's uncached prompt tokens through the target, right-padded in one forward
    (a row with more than GROUP_CACHED_MAX cached: by itself, on its own cache); returns the
    rows' first tokens, read back with one wait."""
    drawn: dict[int, mx.array] = {}
    rows = []
    for r in group:
        if len(r.pc.tokens) <= GROUP_CACHED_MAX:
            rows.append(r)
            continue
        todo = r.context[len(r.pc.tokens) :]
        logits = model(mx.array(todo, mx.uint32)[None], cache=r.pc.cache)
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
            r.pc.cache = [c.row_view(j) for c in layers]
    return mx.concatenate([drawn[id(r)] for r in group]).tolist()  # the group's one wait
