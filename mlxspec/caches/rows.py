"""A step's cache as rows: the one object the decode loop uses, whatever the cache kind.

`Rows` holds the caches of a batch's requests, row b of every layer being slot b. A batch of
one is that request's own cache of any kind (attention, sliding window, recurrent, QuantSpec's
hierarchical, a sharded target's), as it is, no copy: the fastest for one request. A second
request joining moves them into ragged rows (`RaggedKVCache`: plain attention of different
lengths; only such requests share a batch, `Target.shareable`). One interface for both:
`lengths`, `checkpoint` before a forward that may be undone, `trim_rows` after it,
`put_row`/`take_row` to move a request's cache in and out, `keep_rows` and `add_empty_rows`
to resize. `alone`: it holds one request's own cache, not ragged rows (what that means for
the decode loop the batch decides once per change, `BatchSpeculator._settle`).
"""

from __future__ import annotations

from mlx_lm.models.cache import KVCache

from ..errors import MlxspecError
from . import Checkpoint, checkpoint, has_recurrent, offset, rollback
from .ragged import RaggedKVCache


class Rows:
    """The caches of a batch's rows: one request's own layers, or ragged rows of several."""

    def __init__(self, model, layers: list | None = None):
        self.model = model
        self.layers: list = []  # what a forward takes
        # One request's own layers (or none yet), not ragged rows. Read only where a caller
        # acts on the layout itself (the step refuses several rows on one request's cache and
        # runs a tree only there, `step.py`; the draft's rows trim by it, `proposers/draft.py`);
        # the decode loop's regime is decided once from it (`BatchSpeculator._settle`).
        self.alone = True
        self.recurrent = self.plain = False
        if layers is not None:
            self.put_row(0, layers)

    def _own(self, layers: list) -> None:
        self.layers, self.alone = layers, True
        self.recurrent = has_recurrent(layers)  # (a plain step then checkpoints nothing)
        # mlx-lm's plain KV cache in every layer: a trim is exact whatever its length
        self.plain = bool(layers) and all(type(c) is KVCache for c in layers)

    def _to_ragged(self, num_layers: int) -> None:
        """Ragged rows, the request alone (if any) in row 0."""
        own = self.layers
        self.layers = [RaggedKVCache() for _ in range(num_layers)]
        self.alone, self.recurrent, self.plain = False, False, False
        if own:
            for ragged, c in zip(self.layers, own):
                ragged.put_row(0, c)

    @property
    def lengths(self) -> list[int]:
        if not self.alone:
            return self.layers[0].lengths
        # (recurrent layers only: no count of their own)
        return [max(offset(self.layers), 0)] if self.layers else []

    def checkpoint(self) -> Checkpoint | None:
        """What `trim_rows` needs to undo the next forward (None: every layer trims)."""
        return checkpoint(self.layers) if self.recurrent else None

    def trim_rows(self, drop: list[int], fed: list[list[int]] | None = None,
                  ckpt: Checkpoint | None = None) -> None:
        """Remove the last drop[b] tokens of row b; `fed`: the tokens fed since `ckpt` was
        taken (a recurrent state is restored and the kept ones fed again)."""
        if not self.alone:
            for c in self.layers:
                c.trim_rows(drop)
            return
        (n,) = drop
        if self.plain:
            for c in self.layers:
                if c.trim(n) != n:
                    raise MlxspecError(f"cannot roll back {n} tokens of a {c.offset}-token cache")
            return
        tokens = fed[0] if fed is not None else [0] * n
        rollback(self.model, self.layers, ckpt, tokens, len(tokens) - n)

    def put_row(self, b: int, layers: list) -> None:
        """Slot b (empty, or b == the number of slots: a new one) holds what `layers` hold: the
        first request's own layers as they are, a later one's copied into ragged rows."""
        if self.alone and not self.layers and b == 0:
            self._own(layers)
            return
        if self.alone:
            self._to_ragged(len(layers))
        for ragged, c in zip(self.layers, layers):
            ragged.put_row(b, c)

    def take_row(self, b: int) -> list:
        """Row b as a single-request cache, its slot left empty: the request's own layers
        given back (no copy), or a copy of its ragged row."""
        if self.alone:
            layers, self.layers = self.layers, []
            return layers
        return [c.take_row(b) for c in self.layers]

    def keep_rows(self, rows: list[int]) -> None:
        """Only these rows, in this order."""
        if not self.alone:
            for c in self.layers:
                c.keep_rows(rows)

    def add_empty_rows(self, n: int, num_layers: int) -> None:
        """n more empty slots (ragged rows from now on)."""
        if self.alone:
            self._to_ragged(num_layers)
        for c in self.layers:
            c.add_empty_rows(n)

    def evaluate(self) -> list:
        return [c.state for c in self.layers]


def as_rows(model, cache) -> Rows:
    """`cache` as rows: a list of `RaggedKVCache` layers, or one request's cache of any kind."""
    if isinstance(cache, Rows):
        return cache
    rows = Rows(model)
    if cache and isinstance(cache[0], RaggedKVCache):
        rows.layers, rows.alone = list(cache), False
    elif cache:
        rows._own(cache)
    return rows
