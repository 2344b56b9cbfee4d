"""Suffix decoding: propose what followed the context's longest suffix in the text of earlier
requests and answers (vLLM's suffix decoding, llama.cpp's ngram-cache), kept in a
`SuffixIndex` (`mlxspec/suffix_store.py`) shared by the requests of a server scope, the turns
of a chat, the edits of one process.

The proposal comes from every stored occurrence of the longest match (up to 32 tokens): their
continuations, counted. The chain follows the most frequent next token while the share of
occurrences that agree with it stays at least `min_prob`, for at most `spec_factor` x the match
length: a long match that always continued the same way offers many tokens, a short or
ambiguous one a few. As a tree (`tree=True`): the most probable nodes first, up to `budget`.

Offers are keyed `suffix:N`, N the match length rounded down to 4, 8, 16 or 32, so that the
policy measures each separately. With `local=True` (mode `suffix`) the current request's own
prompt and answer are a second index and the longer match wins; `auto` leaves that text to
prompt lookup and uses the store alone.

The request's prompt and committed answer go into the store when the next generation starts or
`finish()` is called (the server, `chat` and `edit` call it when an answer ends). A
fill-in-the-middle request (`set_fim`) goes in, and is matched, as the document it edits: the
prefix, then the answer, the text after the cursor left out. An editor's follow-up, whose
prefix now ends with the answer it took as accepted, is then proposed what followed that
answer (what the server decoded ahead, `docs/SERVER.md`), not the answer again.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter

import mlx.core as mx

from ..sampling import SamplingParams
from ..suffix_store import MAX_MATCH, SuffixIndex
from .base import Proposal, Proposer

ARMS = (32, 16, 8, 4)
_OWN = object()  # default store: the proposer's own


def arm(length: int) -> str:
    """The policy arm of a match of `length` tokens."""
    return f"suffix:{next(a for a in ARMS if length >= a)}"


def best_chain(conts: Counter, limit: int, min_prob: float) -> list[int]:
    """The most frequent path through the continuations, while at least `min_prob` of them
    agree with it, at most `limit` tokens."""
    if len(conts) == 1:
        return list(next(iter(conts)))[:limit]
    rows, total = list(conts.items()), sum(conts.values())
    chain: list[int] = []
    for d in range(limit):
        votes: Counter = Counter()
        for r, n in rows:
            if len(r) > d:
                votes[r[d]] += n
        if not votes:
            break
        token, n = votes.most_common(1)[0]
        if n < min_prob * total:
            break
        chain.append(token)
        rows = [(r, m) for r, m in rows if len(r) > d and r[d] == token]
    return chain


def best_tree(conts: Counter, limit: int, min_prob: float,
              budget: int) -> tuple[list[int], list[int]]:
    """(tokens, parents) of the `budget` most probable nodes (probability: the share of
    continuations through the node, at least `min_prob`), `limit` deep, in topological
    order; the most probable path is the first branch."""
    total = sum(conts.values())
    tokens: list[int] = []
    parents: list[int] = []
    heap: list = []
    tick = 0

    def push(parent: int, depth: int, rows: list) -> None:
        nonlocal tick
        groups: dict[int, list] = {}
        for r, n in rows:
            if len(r) > depth:
                groups.setdefault(r[depth], []).append((r, n))
        for token, sub in groups.items():
            n = sum(m for _, m in sub)
            if n >= min_prob * total:
                heapq.heappush(heap, (-n, tick, parent, depth, token, sub))
                tick += 1

    push(-1, 0, list(conts.items()))
    while heap and len(tokens) < budget:
        _, _, parent, depth, token, sub = heapq.heappop(heap)
        tokens.append(token)
        parents.append(parent)
        if depth + 1 < limit:
            push(len(tokens) - 1, depth + 1, sub)
    return tokens, parents


class SuffixProposer(Proposer):
    """Proposals from earlier requests' text (see the module docstring)."""

    name = "suffix"
    adaptive = True  # k within the offer is the policy's (AdaptiveK), as for auto

    def __init__(self, store: SuffixIndex | None = _OWN, local: bool = True,
                 tree: bool = False, budget: int = 16, min_prob: float = 0.1,
                 spec_factor: float = 2.0):
        if budget < 1:
            raise ValueError(f"budget must be >= 1, got {budget}")
        if not 0.0 < min_prob <= 1.0:
            raise ValueError(f"min_prob must be in (0, 1], got {min_prob}")
        self.store = SuffixIndex() if store is _OWN else store
        self.local_enabled, self.uses_trees = local, tree
        self.budget, self.min_prob, self.spec_factor = budget, min_prob, spec_factor
        self.local: SuffixIndex | None = None
        self._local_len = 0
        self._pending: tuple[SuffixIndex | None, list[int]] | None = None
        self._context: list[int] | None = None
        self._found = None  # (len(context), limit, arm, chain, conts, index, positions)
        self.fim: tuple[int, int] | None = None  # the FIM suffix and middle tokens (`set_fim`)
        self._cut: tuple[int, int] | None = None  # prompt[start:end], left out of the document

    # -- the store
    def set_store(self, store: SuffixIndex | None) -> None:
        """Use `store` (None: no store) from the next generation on: the server's scope, or
        the one store a chat or edit process shares across modes."""
        self.store = store

    def set_fim(self, suffix: int | None, middle: int | None) -> None:
        """The model's FIM suffix and middle tokens (None: it has none), from the next
        generation on: a FIM request is kept and matched as the document it edits."""
        self.fim = (suffix, middle) if suffix is not None and middle is not None else None

    def finish(self) -> None:
        """Put the generation's prompt and committed answer into its store (once)."""
        if self._pending is None:
            return
        store, prompt = self._pending
        self._pending = None
        if store is not None:
            context = self._context if self._context is not None else prompt
            if self._cut is not None:
                start, end = self._cut
                context = context[:start] + context[end:]
            store.add(context)

    def _fim_cut(self, prompt: list[int]) -> tuple[int, int] | None:
        """(start, end) of `<SUF> suffix <MID>` in a FIM prompt (its last middle token, the
        last suffix token before it), or None."""
        if self.fim is None:
            return None
        suffix, middle = self.fim
        end = next((i for i in range(len(prompt) - 1, -1, -1) if prompt[i] == middle), None)
        if end is None:
            return None
        start = next((i for i in range(end - 1, -1, -1) if prompt[i] == suffix), None)
        return None if start is None else (start, end + 1)

    def _document_tail(self, context: list[int]) -> list[int]:
        """The last tokens of the document a FIM request edits: its prefix, then its answer."""
        start, end = self._cut
        answer = context[max(end, len(context) - MAX_MATCH - 1) :]
        return context[max(0, start - (MAX_MATCH + 1 - len(answer))) : start] + answer

    # -- the protocol
    def reset(self, prompt: list[int], sampling: SamplingParams) -> None:
        self.finish()
        self._pending = (self.store, list(prompt))
        self._context, self._found = None, None
        self._cut = self._fim_cut(prompt)
        if self.local_enabled:
            self.local = SuffixIndex(budget=1 << 30)
            self.local.open(list(prompt))
            self._local_len = len(prompt)

    def update(self, context: list[int], num_accepted: int) -> None:
        self._context = context
        if self.local is not None and len(context) > self._local_len:
            self.local.extend(context[self._local_len :])
            self._local_len = len(context)

    def _lookup(self, context: list[int], limit: int):
        found = self._found
        if found is not None and found[0] == len(context) and found[1] >= limit:
            return found
        self.update(context, 0)  # the local index catches up on the committed context
        best = None  # (match length, index, positions)
        for index in (self.local, self.store):
            if index is None or not index.docs:
                continue
            tail = self._document_tail(context) if (
                index is self.store and self._cut is not None) else context
            length, positions = index.match(tail)
            if length and (best is None or length > best[0]):
                best = (length, index, positions)
        if best is None:
            self._found = (len(context), limit, "", [], None, None, None)
            return self._found
        length, index, positions = best
        depth = min(limit, max(1, math.ceil(self.spec_factor * length)))
        conts = index.continuations(positions, depth)
        chain = best_chain(conts, depth, self.min_prob) if conts else []
        self._found = (len(context), limit, arm(length), chain, conts, index, positions)
        return self._found

    def available(self, context: list[int], cap: int) -> dict[str, int]:
        if cap <= 0:
            return {}
        _, _, source, chain, *_ = self._lookup(context, cap)
        return {source: len(chain)} if chain else {}

    def propose(self, context: list[int], num_draft: int, seed: int | None,
                source: str | None = None) -> Proposal | None:
        if num_draft < 1:
            return None
        _, _, _, chain, conts, index, positions = self._lookup(context, num_draft)
        if not chain:
            return None
        if index is self.store and positions is not None:
            index.touch(positions)
        if self.uses_trees:
            depth = min(num_draft, len(max(conts, key=len)))
            tokens, parents = best_tree(conts, depth, self.min_prob, self.budget)
            return Proposal(tokens=mx.array(tokens, mx.uint32), parents=parents, source="suffix")
        return Proposal(tokens=mx.array(chain[:num_draft], mx.uint32), source="suffix")

    def peek(self, context: list[int], num_draft: int, source: str) -> list[int] | None:
        if num_draft < 1:
            return None
        chain = self._lookup(context, num_draft)[3]
        return list(chain[:num_draft]) if chain else None

    def stats(self) -> dict:
        store = self.store
        return {"suffix_tokens": store.live if store is not None else 0}

