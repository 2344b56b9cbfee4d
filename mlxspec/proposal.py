"""What a proposer hands the step: the type every layer shares (proposers, the step, trees)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

# Sources of the draft model's (`proposers/draft.py`), arms of the policy: its token tree, and
# prompt lookup's chain continued by it.
DRAFT_TREE, LOOKUP_DRAFT = "draft-tree", "lookup+draft"


@dataclass
class Proposal:
    """Tokens proposed for the target to verify in one forward pass.

    `tokens` (1-D uint32 array, possibly lazy; a proposer may give a list: the loop makes it
    an array, `BatchSpeculator._propose`) is a chain unless `parents` is given: then a tree in
    topological order, parents[i] the index of node i's parent (-1: the last committed token).
    `draft_probs` is q per token after the same sampling transforms as p, (len, vocab); None
    means a deterministic proposal (q one-hot).

    `setup_seconds`: time the proposer spent before proposing that is not what a step of
    this source costs (a draft model catching up on context it skipped): not charged to it.

    Tree-only fields: `verify[i]` False for nodes that may not be accepted; `want_argmax` node
    indices whose target argmax the proposer wants back (lookahead's Jacobi window), handed to
    `on_result(argmax, path)` once after verification, with the accepted node indices.
    """

    tokens: mx.array
    draft_probs: mx.array | None = None
    source: str = ""
    parents: list[int] | None = None
    verify: list[bool] | None = None
    want_argmax: tuple[int, ...] = ()
    on_result: Callable[[list[int], list[int]], None] | None = None
    setup_seconds: float = 0.0

    def __len__(self) -> int:
        return int(self.tokens.size)

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    def depth(self) -> int:
        """Draft positions along the longest path (a chain: its length)."""
        if self.parents is None:
            return len(self)
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return max(d, default=0)
