"""Lookahead decoding (Fu et al., arXiv 2402.02057): Jacobi iteration proposes n-grams, one
forward pass both advances the Jacobi window and verifies n-gram candidates.

Parameters: W (window columns), N (n-gram size), G (candidates per step / continuations kept per
key). Everything one step sends to the target is a single token tree under the last committed
token t (at position P), built with `TrieBuilder` so equal prefixes share a node:

* the window: N-1 levels of W Jacobi guesses. Level 0 is a chain t -> L0[0] -> L0[1] -> ...;
  level j > 0, column c hangs under level j-1, column c. So L_j[c] sits at position
  P + 1 + c + j and sees t, L0[0..c] and L1[c] .. L_{j-1}[c]: exactly the lookahead mask of the
  paper (its "diagonal" attention), expressed as ancestors;
* the candidates: up to G continuations (N-1 tokens) of t from the n-gram pool, each a causal
  chain after t.

After the forward (`mlxspec.tree.tree_step`, one host sync), the target's argmax at the last
level's cells is the next Jacobi level. Once the window has all N-1 levels, each column yields an
n-gram (L0[c], L1[c], ..., L_{N-2}[c], new[c]) for the pool; the oldest level is dropped. The
window then slides so each guess keeps its absolute position: by (accepted + 1) - 1 columns when
a level was dropped and a new one added, by accepted + 1 otherwise; columns that slide in are
filled with random tokens from the context.

The n-gram pool maps a first token to at most G continuations, least recently added evicted
first, seeded with the prompt's own n-grams and (`pool_from_output`) the generated text's.

Every node of the tree - candidates and window alike - is a deterministic proposal and may be
accepted: the verification (`mlxspec.tree_verify`) is exact for any fixed tree, greedy or
sampled, and accepting a window path that the target agrees with is free
(`verify_window=False` restricts acceptance to the candidates, as in the paper).
"""

from __future__ import annotations

import random
from collections import OrderedDict

import mlx.core as mx

from ..sampling import SamplingParams
from ..tree import TrieBuilder
from .base import Proposal, Proposer

# Chosen by measurement on the bundled 6.4 M-parameter model on a 2-core CPU (modelled
# throughput over code completion, edit and chat): every extra node costs there, and
# (1, 3, 2) was the best setting with a window (1.26-1.34x modelled vs none); the paper's 7B
# setting (15, 5, 15) verifies ~70 nodes a step and ran at ~0.5x. Raise them where a forward
# over many rows costs about what one row does (GPUs, larger models).
DEFAULT_WINDOW = 1
DEFAULT_NGRAM = 3
DEFAULT_CANDIDATES = 2


class NgramPool:
    """First token -> up to `capacity` continuations (tuples), least recently added evicted."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.table: dict[int, OrderedDict] = {}

    def add(self, key: int, continuation: tuple[int, ...]) -> None:
        entries = self.table.get(key)
        if entries is None:
            entries = self.table[key] = OrderedDict()
        if continuation in entries:
            entries.move_to_end(continuation)
            return
        entries[continuation] = None
        if len(entries) > self.capacity:
            entries.popitem(last=False)

    def get(self, key: int) -> list[tuple[int, ...]]:
        """Continuations of `key`, most recently added first."""
        entries = self.table.get(key)
        return list(reversed(entries)) if entries else []

    def add_stream(self, tokens: list[int], n: int, start: int = 0) -> int:
        """Add every n-gram of `tokens` starting at index >= start; returns the next start."""
        stop = len(tokens) - n + 1
        for i in range(start, max(start, stop)):
            self.add(tokens[i], tuple(tokens[i + 1 : i + n]))
        return max(start, stop)


class JacobiWindow:
    """N-1 levels (fewer while filling) of W Jacobi guesses; see the module docstring."""

    def __init__(self, width: int, ngram: int, fill):
        if width < 0 or ngram < 2:
            raise ValueError(f"need window >= 0 and ngram >= 2, got {width}, {ngram}")
        self.width, self.ngram = width, ngram
        self.fill = fill  # fill(count) -> count tokens
        self.levels: list[list[int]] = []

    def reset(self) -> None:
        self.levels = [self.fill(self.width)] if self.width else []

    @property
    def full(self) -> bool:
        return len(self.levels) == self.ngram - 1

    def advance(self, outputs: list[int] | None, committed: int) -> list[tuple[int, tuple]]:
        """After a step that committed `committed` tokens; `outputs` is the target's argmax at
        the last level's cells (None when the window was not in the step's forward). Returns
        the n-grams completed, as (first token, continuation)."""
        if not self.width:
            return []
        grams: list[tuple[int, tuple]] = []
        levels = self.levels
        if outputs is not None:
            if self.full:
                grams = [(levels[0][c], tuple(lv[c] for lv in levels[1:]) + (outputs[c],))
                         for c in range(self.width)]
                levels = levels[1:] + [list(outputs)]
                shift = committed - 1
            else:
                levels = levels + [list(outputs)]
                shift = committed
        else:
            shift = committed
        if shift > 0:
            s = min(shift, self.width)
            levels = [lv[s:] + self.fill(s) for lv in levels]
        self.levels = levels
        return grams


class LookaheadProposer(Proposer):
    """`mode="lookahead"`: Jacobi window + n-gram pool, verified as one tree per step."""

    name = "lookahead"
    uses_trees = True

    def __init__(self, model=None, window: int = DEFAULT_WINDOW, ngram: int = DEFAULT_NGRAM,
                 candidates: int = DEFAULT_CANDIDATES, pool_from_output: bool = True,
                 verify_window: bool = True, seed: int = 0):
        if candidates < 0:
            raise ValueError(f"candidates must be >= 0, got {candidates}")
        self.model = model  # the target is verified by the engine; kept for symmetry
        self.window_size, self.ngram, self.candidates = window, ngram, candidates
        self.pool_from_output = pool_from_output
        self.verify_window = verify_window
        self.seed = seed
        self.rng = random.Random(seed)
        self.context: list[int] = []
        self.window = JacobiWindow(window, ngram, self._fill)
        self.pool = NgramPool(max(candidates, 1))

    # -- state
    def _fill(self, count: int) -> list[int]:
        ctx = self.context
        if not ctx:
            return [0] * count
        return [ctx[self.rng.randrange(len(ctx))] for _ in range(count)]

    def reset(self, prompt: list[int], sampling: SamplingParams) -> None:
        self.rng = random.Random(self.seed)
        self.context = list(prompt)
        self.pool = NgramPool(max(self.candidates, 1))
        self._pool_next = self.pool.add_stream(self.context, self.ngram)
        self.window.reset()
        self._seen = len(prompt)
        self._result = None

    # -- protocol
    def propose(self, context: list[int], num_draft: int, seed: int | None,
                source: str | None = None) -> Proposal | None:
        self.context = context
        depth = min(self.ngram - 1, max(num_draft, 0))
        trie = TrieBuilder()
        on_candidates: set[int] = set()
        if depth and self.candidates:
            for cont in self.pool.get(context[-1])[: self.candidates]:
                on_candidates.update(trie.add_path(cont[:depth]))
        cells: list[list[int]] = []
        for j, level in enumerate(self.window.levels):
            row = []
            for c, token in enumerate(level):
                parent = (row[c - 1] if c else -1) if j == 0 else cells[j - 1][c]
                row.append(trie.add(parent, token))
            cells.append(row)
        self._result = None
        if not len(trie):
            return None
        verify = None
        if not self.verify_window:
            verify = [i in on_candidates for i in range(len(trie))]
        return Proposal(tokens=mx.array(trie.tokens, mx.uint32), parents=trie.parents,
                        source="lookahead", verify=verify,
                        want_argmax=tuple(cells[-1] if cells else ()), on_result=self._on_result)

    def _on_result(self, argmax: list[int], path: list[int]) -> None:
        self._result = argmax if self.window.levels else None

    def update(self, context: list[int], num_accepted: int) -> None:
        self.context = context
        committed = len(context) - self._seen
        self._seen = len(context)
        grams = self.window.advance(self._result, committed)
        self._result = None
        for first, cont in grams:
            self.pool.add(first, cont)
        if self.pool_from_output:
            self._pool_next = self.pool.add_stream(context, self.ngram, self._pool_next)
