"""What the decode loop knows of the target model: the model and its tokenizer, the kind of
cache it decodes on, the prefill's chunk, a sharded target's sync, and what its prefill last
cost per token. The engine hands it down with each request (`Engine.target`): admission,
prefill, the row and the batch take it, never the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import caches
from .caches.ragged import plain_attention
from .proposers.base import Proposer

# A prefill of fewer tokens than this does not say what a token costs (fixed costs dominate).
METERED_MIN = 16


@dataclass
class PrefillMeter:
    """The target's prefill time per token, as last measured: what a draft's catch-up on
    context it has not read is judged by (`proposers/auto.py`)."""

    seconds_per_token: float = 0.0

    def record(self, seconds: float, tokens: int) -> None:
        """A prefill of `tokens` took `seconds` (too short a one says nothing)."""
        if tokens >= METERED_MIN:
            self.seconds_per_token = seconds / tokens


@dataclass(frozen=True)
class Target:
    """The target as the loop sees it. `kv`: "fp", or "hierarchical" (plain decoding on
    QuantSpec's 8-bit view, with its group and buffer sizes); `sync`: a sharded target's
    (rank 0's tokens on every rank), else None."""

    model: object
    tokenizer: object = None
    kv: str = "fp"
    kv_group_size: int = 64
    kv_buffer_size: int | None = None
    prefill_step_size: int = 2048
    sync: object = None
    meter: PrefillMeter = field(default_factory=PrefillMeter)

    def cache_kind(self, proposer: Proposer | None) -> str:
        """The kind of cache a request with `proposer` decodes on (a prompt cache of another
        kind is not reused)."""
        if proposer is not None and proposer.cache_kind != "kv":
            return proposer.cache_kind
        if self.kv == "hierarchical":
            return f"hierarchical-ref:{self.kv_group_size}:{self.kv_buffer_size}"
        return "kv"

    def new_cache(self, proposer: Proposer | None) -> list:
        """A fresh cache of that kind."""
        made = proposer.make_target_cache(self.model) if proposer is not None else None
        if made is not None:
            return made
        if self.kv == "hierarchical":
            from .quant.hierarchical_cache import make_reference_cache

            return make_reference_cache(self.model, self.kv_group_size, self.kv_buffer_size)
        return caches.make_cache(self.model)

    def shareable(self, proposer: Proposer | None) -> bool:
        """Whether a request with `proposer` can share a batch with other requests (decided
        here only): a plain attention cache (a window or a recurrent state has no ragged rows
        yet), a chain proposer on the target's plain cache, an unsharded target. Others decode
        on their own cache."""
        if self.kv != "fp" or self.sync is not None:
            return False
        if proposer is not None and (proposer.uses_trees or proposer.cache_kind != "kv"):
            return False
        return plain_attention(caches.make_cache(self.model))  # (a CacheList layer: no rows)
