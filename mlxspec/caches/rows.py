"""A step's cache as rows: the one interface the decode loop uses, whatever the cache kind.

`RowCache` holds one request's cache of any kind (attention, sliding window, recurrent,
QuantSpec's hierarchical, a sharded target's) as a batch of one row; `RaggedRows` holds
several plain-attention rows of different lengths (`RaggedKVCache`). Both have the same
methods, so the step and the scheduler never ask which kind they hold: `lengths`, `checkpoint`
before a forward that may be undone, `trim_rows` after it, `put_row`/`take_row` to move a
request's cache in and out. Only `RaggedRows` can hold several rows (`shared`).
"""

from __future__ import annotations

from mlx_lm.models.cache import KVCache

from . import Checkpoint, checkpoint, has_recurrent, offset, rollback
from .ragged import RaggedKVCache


class RowCache:
    """One request's cache (a list of layer caches, of any kind) as a batch of one row."""

    shared = False

    def __init__(self, model, layers: list):
        self.model, self.layers = model, layers
        self.recurrent = has_recurrent(layers)  # (a plain step then checkpoints nothing)
        # mlx-lm's plain KV cache in every layer: a trim is exact whatever its length
        self.plain = all(type(c) is KVCache for c in layers)

    @property
    def lengths(self) -> list[int]:
        return [max(offset(self.layers), 0)]  # (recurrent layers only: no count of their own)

    def checkpoint(self) -> Checkpoint | None:
        """What `trim_rows` needs to undo the next forward (None: every layer trims)."""
        return checkpoint(self.layers) if self.recurrent else None

    def trim_rows(self, drop: list[int], fed: list[list[int]] | None = None,
                  ckpt: Checkpoint | None = None) -> None:
        """Remove the last drop[0] tokens; `fed`: the tokens fed since `ckpt` was taken (a
        recurrent state is restored and the kept ones fed again)."""
        (n,) = drop
        if self.plain:
            for c in self.layers:
                c.trim(n)
            return
        tokens = fed[0] if fed is not None else [0] * n
        rollback(self.model, self.layers, ckpt, tokens, len(tokens) - n)

    def take_row(self, b: int) -> list:
        """The request's cache, given back (no copy)."""
        layers, self.layers = self.layers, []
        return layers

    def evaluate(self) -> list:
        return [c.state for c in self.layers]


class RaggedRows:
    """Several plain-attention rows of different lengths; row b of every layer is slot b."""

    shared = True
    recurrent = False

    def __init__(self, num_layers: int):
        self.layers = [RaggedKVCache() for _ in range(num_layers)]

    @property
    def lengths(self) -> list[int]:
        return self.layers[0].lengths

    def checkpoint(self) -> None:
        return None  # lowering a row's length undoes anything

    def trim_rows(self, drop: list[int], fed=None, ckpt=None) -> None:
        for c in self.layers:
            c.trim_rows(drop)

    def put_row(self, b: int, layers: list[KVCache]) -> None:
        """Slot b (empty, or b == the number of slots: a new one) holds what `layers` hold."""
        for ragged, c in zip(self.layers, layers):
            ragged.put_row(b, c)

    def take_row(self, b: int) -> list[KVCache]:
        """Row b as a single-request cache (a copy), its slot left empty."""
        return [c.take_row(b) for c in self.layers]

    def keep_rows(self, rows: list[int]) -> None:
        for c in self.layers:
            c.keep_rows(rows)

    def add_empty_rows(self, n: int) -> None:
        for c in self.layers:
            c.add_empty_rows(n)

    def evaluate(self) -> list:
        return [c.state for c in self.layers]


def as_rows(model, cache) -> RowCache | RaggedRows:
    """`cache` as rows: a list of `RaggedKVCache` layers, or one request's cache of any kind."""
    if isinstance(cache, (RowCache, RaggedRows)):
        return cache
    if cache and isinstance(cache[0], RaggedKVCache):
        rows = RaggedRows(0)
        rows.layers = list(cache)
        return rows
    return RowCache(model, cache)
