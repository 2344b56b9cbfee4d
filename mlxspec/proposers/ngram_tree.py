"""Prompt lookup as a tree: when earlier occurrences of the context's suffix continue
differently, propose all of them (up to a node budget) and let one tree forward check them.

The chain proposer (`ngram.py`) follows the most recent occurrence of the longest matching
n-gram only. Here every n-gram keeps its `max_positions` most recent continuation positions, and
the proposal is the trie of their continuations: the longest n first, most recent occurrence
first (so the chain proposal is always the tree's first branch), then shorter n-grams while the
budget lasts. Verification is `tree_verify`'s, through `mlxspec.tree.tree_step`.
"""

from __future__ import annotations

import mlx.core as mx

from ..sampling import SamplingParams
from ..tree import TrieBuilder
from .base import Proposal, Proposer
from .ngram import NgramIndex


class MultiNgramIndex:
    """An `NgramIndex` (the token stream and most recent positions) plus, for every n-gram,
    its `max_positions` most recent continuation positions (oldest first)."""

    def __init__(self, min_n: int = 1, max_n: int = 4, max_positions: int = 8):
        self.index = NgramIndex(min_n, max_n)
        self.max_positions = max_positions
        self.positions: dict[tuple[int, ...], list[int]] = {}

    @property
    def tokens(self) -> list[int]:
        return self.index.tokens

    def extend(self, new_tokens: list[int]) -> None:
        tokens = self.index.tokens
        first = len(tokens)
        self.index.extend(new_tokens)
        table, keep = self.positions, self.max_positions
        lo, hi = self.index.min_n, self.index.max_n
        for end in range(first, len(tokens)):
            for n in range(lo, min(hi, end) + 1):
                key = tuple(tokens[end - n : end])
                lst = table.get(key)
                if lst is None:
                    table[key] = [end]
                else:
                    lst.append(end)
                    if len(lst) > keep:
                        del lst[0]

    def continuations(self, suffix: list[int], depth: int, min_n: int | None = None):
        """Continuations (up to `depth` tokens) of the n-grams ending `suffix`, longest n first,
        most recent first."""
        tokens = self.index.tokens
        lo = max(self.index.min_n, min_n or 1)
        for n in range(min(self.index.max_n, len(suffix)), lo - 1, -1):
            for pos in reversed(self.positions.get(tuple(suffix[len(suffix) - n :]), ())):
                cont = tokens[pos : pos + depth]
                if cont:
                    yield n, cont


class TreeNgramProposer(Proposer):
    """N-gram lookup proposing a tree of up to `budget` nodes, `num_draft` deep."""

    name = "ngram-tree"
    uses_trees = True

    def __init__(self, min_ngram: int = 1, max_ngram: int = 4, budget: int = 16,
                 max_positions: int = 8, shorter: bool = True):
        if budget < 1:
            raise ValueError(f"budget must be >= 1, got {budget}")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.budget, self.max_positions, self.shorter = budget, max_positions, shorter
        self.index = MultiNgramIndex(min_ngram, max_ngram, max_positions)
        self.prediction: MultiNgramIndex | None = None

    def set_prediction(self, tokens: list[int] | None) -> None:
        self.prediction = None
        if tokens:
            self.prediction = MultiNgramIndex(self.min_ngram, self.max_ngram, self.max_positions)
            self.prediction.extend(list(tokens))

    def reset(self, prompt: list[int], sampling: SamplingParams) -> None:
        self.index = MultiNgramIndex(self.min_ngram, self.max_ngram, self.max_positions)
        self.index.extend(list(prompt))

    def available(self, context: list[int], cap: int) -> dict[str, int]:
        self._catch_up(context)
        tail = context[-self.max_ngram :]
        sources = [self.prediction, self.index] if self.prediction is not None else [self.index]
        found = any(next(iter(s.continuations(tail, 1)), None) for s in sources) if cap else False
        return {"ngram-tree": cap} if found else {}

    def propose(self, context: list[int], num_draft: int, seed: int | None,
                source: str | None = None) -> Proposal | None:
        self._catch_up(context)
        if num_draft < 1:
            return None
        tail = context[-self.max_ngram :]
        trie = TrieBuilder()
        sources = [self.prediction, self.index] if self.prediction is not None else [self.index]
        longest = None
        for index in sources:
            for n, cont in index.continuations(tail, num_draft):
                if longest is None:
                    longest = n
                elif not self.shorter and n < longest:
                    break
                trie.add_path(cont, budget=self.budget)
                if len(trie) >= self.budget:
                    break
            if len(trie) >= self.budget:
                break
        if not len(trie):
            return None
        return Proposal(tokens=mx.array(trie.tokens, mx.uint32), parents=trie.parents,
                        source="ngram-tree")

    def update(self, context: list[int], num_accepted: int) -> None:
        self._catch_up(context)

    def _catch_up(self, context: list[int]) -> None:
        if len(context) > len(self.index.tokens):
            self.index.extend(context[len(self.index.tokens) :])
