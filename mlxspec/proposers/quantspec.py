"""QuantSpec: self-speculation with a 4-bit-weight draft over a hierarchical INT4/INT8 KV cache.

The draft is the target itself with 4-bit copies of its MLP (or all) projections, reading the
upper (4-bit) plane of the shared KV cache; the target verifies with its own weights and both
planes (~INT8). Both write into the one cache: the draft's k-1 speculative keys/values land in
the full-precision buffer and are trimmed away before the target's verify forward writes its own.

Engine contract: the engine calls `make_target_cache(model)` (or gives the proposer its cache
through `bind_cache`), prefills prompt[:-1] with it, calls `reset`, then per step `propose` ->
one target forward over [last token] + proposal -> trim the rejected -> `update`. The cache
auto-commits (flushes due groups into the packed planes) at the start of every forward except
inside `propose`, where the draft's tokens are speculative; plain one-token steps in between are
fine.

Hybrid models (Gated DeltaNet, short-conv or Mamba layers next to attention layers): only the
attention layers get the hierarchical cache; the recurrent layers keep their `ArraysCache`.
Drafting advances those states, and they cannot be trimmed, so `propose` takes
`caches.checkpoint` (references to the states, no copy) before drafting and `caches.restore`s
them afterwards, trimming the attention layers by the drafted count: the target's verify
forward starts from the committed state. Sliding-window models are refused (their window already
bounds the KV cache), and so are models without attention layers (Mamba: no KV cache).
"""

from __future__ import annotations

import mlx.core as mx

from .. import caches
from ..quant.hierarchical_cache import (
    VIEWS,
    HierarchicalKVCache,
    check_hierarchical_support,
    draft_view,
    hierarchical_layers,
    make_hierarchical_cache,
)
from ..quant.weights import make_draft_model
from ..sampling import SamplingParams, draft_draw
from .base import Proposal, Proposer

__all__ = ["QuantSpecProposer"]


class QuantSpecProposer(Proposer):
    name = "quantspec"
    cheap = False

    def __init__(self, model, group_size: int = 64, buffer_size: int | None = None,
                 weight_bits: int = 4, quantize: str = "mlp", weight_group_size: int = 64,
                 value_group_size: int | None = None, weight_method: str = "rtn",
                 calibration=None, draft_kv: str = "draft"):
        if weight_bits not in (2, 3, 4, 5, 6, 8):
            raise ValueError(f"weight_bits must be one of 2, 3, 4, 5, 6, 8; got {weight_bits}")
        if draft_kv not in VIEWS:
            raise ValueError(f"draft_kv must be one of {VIEWS}, got {draft_kv!r}")
        self.model = model
        # the KV view the draft reads: its 4-bit one, or the target's 8-bit one (an ablation:
        # what the 4-bit weights alone cost in acceptance; the same bytes are stored either way)
        self.draft_kv = draft_kv
        self.group_size = group_size
        self.buffer_size = 2 * group_size if buffer_size is None else buffer_size
        self.value_group_size = value_group_size
        # Validate the model and the cache options now rather than at the first generation.
        check_hierarchical_support(model)
        HierarchicalKVCache(group_size, self.buffer_size, value_group_size)
        self.draft_model, self.weight_info = make_draft_model(
            model, bits=weight_bits, group_size=weight_group_size, quantize=quantize,
            method=weight_method, calibration=calibration)
        # The engine reuses a prompt cache only when its kind matches; the id keeps a cache made
        # for another proposer instance (which this one cannot see) from being reused.
        self.cache_kind = f"hierarchical:{group_size}:{self.buffer_size}:{id(self)}"
        self.cache: list | None = None
        self.sampling = SamplingParams()
        self.drafted = 0
        self.accepted = 0

    # -- engine hooks
    def make_target_cache(self, model) -> list:
        if model is not self.model:
            raise ValueError("QuantSpecProposer was built for another model")
        self.cache = make_hierarchical_cache(model, self.group_size, self.buffer_size,
                                             self.value_group_size, auto_commit=True)
        return self.cache

    def bind_cache(self, cache: list) -> None:
        """Use `cache` (made by `make_target_cache`) as the shared cache from now on."""
        layers = caches.leaves(cache)
        if not hierarchical_layers(cache) or any(
                type(c).__name__ == "KVCache" for c in layers):
            raise TypeError("quantspec needs the cache made by make_target_cache")
        self.cache = cache

    def reset(self, prompt: list[int], sampling: SamplingParams) -> None:
        if self.cache is None:
            raise RuntimeError("quantspec: the target must use make_target_cache(model)")
        self.sampling = sampling

    def propose(self, context: list[int], num_draft: int, seed: int | None,
                source: str | None = None) -> Proposal | None:
        cache = self.cache
        if num_draft <= 0:
            return None
        offset = caches.offset(cache)
        if offset != len(context) - 1:
            raise RuntimeError(f"quantspec: the shared cache holds {offset} tokens, expected "
                               f"{len(context) - 1} (all committed tokens but the last)")
        token = mx.array([[context[-1]]], mx.uint32)
        tokens, probs = [], []
        # Recurrent layers (hybrid models) cannot be trimmed: keep their states (references,
        # no copy) and put them back after drafting, so the verify starts from committed state.
        ckpt = caches.checkpoint(cache)
        with draft_view(cache, self.draft_kv):  # no auto-commit; commits what is due on entry
            for i in range(num_draft):
                logits = self.draft_model(token, cache=cache)[0, -1]
                nxt, q = draft_draw(logits, self.sampling, seed, len(context) + i)
                if q is not None:
                    probs.append(q)
                tokens.append(nxt)
                token = nxt.reshape(1, 1).astype(mx.uint32)
                mx.async_eval(token)
        # The draft wrote the last committed token and the first k-1 drafts: drop them (and
        # restore the recurrent states) so the target's verify forward starts from the
        # committed state and writes its own keys/values at those positions.
        if ckpt is not None:
            restored = caches.restore(cache, ckpt, offset + num_draft, offset)
        else:
            restored = caches.trim_exact(cache, num_draft)
        if not restored:
            raise RuntimeError("quantspec: could not roll back the draft's cache entries")
        self.drafted += num_draft
        return Proposal(tokens=mx.stack(tokens), draft_probs=mx.stack(probs) if probs else None,
                        source=self.name)

    def update(self, context: list[int], num_accepted: int) -> None:
        self.accepted += num_accepted

    # -- reporting
    def stats(self) -> dict:
        info = dict(self.weight_info)
        info.update(group_size=self.group_size, buffer_size=self.buffer_size,
                    drafted=self.drafted, accepted=self.accepted,
                    acceptance=self.accepted / self.drafted if self.drafted else None)
        if self.cache:
            info["kv_bytes"] = sum(c.nbytes for c in hierarchical_layers(self.cache))
        return info
