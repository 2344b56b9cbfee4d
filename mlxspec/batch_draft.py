"""The draft model for several rows at once: k draft forwards over the batch instead of k per
row, each row's draft cache a row of one `RaggedKVCache` per layer while it is in the batch.
Each row drafts the tokens and probabilities it would alone (up to a batched matmul's
rounding), and its draft cache ends holding the same tokens. See docs/HOW_IT_WORKS.md.
"""

from __future__ import annotations

import mlx.core as mx

from . import caches
from .caches.ragged import RaggedKVCache, plain_attention
from .proposal import Proposal
from .proposers.draft import DraftModelProposer

# pending tokens fed per forward (a row that `auto` kept off the draft for a long stretch)
FEED_CHUNK = 512


def draft_proposer(proposer) -> DraftModelProposer | None:
    """The draft-model proposer behind a row's proposer (`draft` itself, or `auto`'s)."""
    if isinstance(proposer, DraftModelProposer):
        return proposer
    inner = getattr(proposer, "draft", None)
    return inner if isinstance(inner, DraftModelProposer) else None


class BatchDraft:
    """The draft caches of the rows that draft with one draft model."""

    def __init__(self, model):
        self.model = model
        self.members: list[DraftModelProposer] = []
        self.cache: list[RaggedKVCache] | None = None

    @staticmethod
    def joins(proposer: DraftModelProposer) -> bool:
        """Only drafts with plain `KVCache` layers join; others draft one row at a time."""
        return (proposer.cache is not None and plain_attention(proposer.cache)
                and not proposer._fed_drafts)

    def join(self, proposer: DraftModelProposer) -> None:
        if self.cache is None:
            self.cache = [RaggedKVCache() for _ in proposer.cache]
        for ragged, c in zip(self.cache, proposer.cache):
            ragged.add_row(c)
        # Started, not waited for: a queued step may still be running; the copy joins it.
        mx.async_eval([c.state for c in self.cache])
        proposer.cache = None  # held here; given back by `leave`
        self.members.append(proposer)

    def leave(self, proposer: DraftModelProposer, failed: bool = False) -> None:
        """Give the row's draft cache back (a fresh one after a failed step: state unknown)."""
        b = self.members.index(proposer)
        self.members.pop(b)
        layers = [c.remove_row(b) for c in self.cache]
        proposer._fed_drafts, proposer._checkpoint = 0, None
        if failed:
            proposer.cache, proposer.cached = caches.make_cache(self.model), []
        else:
            proposer.cache = layers
        if not self.members:
            self.cache = None

    def _forward(self, tokens: list[mx.array | None]) -> mx.array:
        """Logits (B, width, vocab) of one forward feeding row b tokens[b] (None: sits out);
        the padding is trimmed again at once."""
        sizes = [0 if t is None else t.size for t in tokens]
        width = max(sizes)
        empty = mx.array([], mx.uint32)
        rows = [mx.concatenate([empty if t is None else t.reshape(-1).astype(mx.uint32),
                                mx.zeros((width - n,), mx.uint32)]) for t, n in zip(tokens, sizes)]
        logits = self.model(mx.stack(rows), cache=self.cache)
        drop = [width - s for s in sizes]
        for c in self.cache:
            c.trim_rows(drop)
        return logits

    def propose(self, requests: list[tuple[DraftModelProposer, list[int], int, mx.array | None]],
                ) -> list[Proposal]:
        """Per (member, context, k >= 1, key), the proposal `member.propose(context, k, key)`
        would make."""
        at = {id(p): i for i, p in enumerate(self.members)}
        rows = [at[id(p)] for p, _, _, _ in requests]
        # 1. what each row's draft has not seen yet; the logits after its last one
        pending = {}
        for (p, context, _, _), b in zip(requests, rows):
            if len(p.cached) >= len(context):  # need at least one token to get logits from
                drop = len(p.cached) - len(context) + 1
                for c in self.cache:
                    c.trim_rows([drop if i == b else 0 for i in range(len(self.members))])
                del p.cached[len(p.cached) - drop :]
            pending[b] = context[len(p.cached) :]
        logits = {}
        longest = max(len(t) for t in pending.values())
        for start in range(0, longest, FEED_CHUNK):
            chunk = [pending.get(b, [])[start : start + FEED_CHUNK]
                     for b in range(len(self.members))]
            out = self._forward([mx.array(t, mx.uint32) if t else None for t in chunk])
            for b, t in enumerate(chunk):
                if t and start + len(t) == len(pending[b]):
                    logits[b] = out[b, len(t) - 1]
            if start + FEED_CHUNK < longest:
                mx.eval([c.state for c in self.cache])
        for (p, _, _, _), b in zip(requests, rows):
            p.cached += pending[b]
        # 2. the drafted tokens, k_max - 1 more forwards; row b draws its i-th with its own
        # i-th key, as alone
        keys = [mx.random.split(key, k) if key is not None else [None] * k
                for _, _, k, key in requests]
        tokens = [[] for _ in requests]
        probs = [[] for _ in requests]
        for i in range(max(k for _, _, k, _ in requests)):
            feed = [None] * len(self.members)
            for j, ((p, _, k, _), b) in enumerate(zip(requests, rows)):
                if i >= k:
                    continue
                token, q = p._next(logits[b], keys[j][i])  # the row's own sampling rule
                tokens[j].append(token)
                probs[j].append(q)
                if i + 1 < k:
                    feed[b] = token
            if any(t is not None for t in feed):
                out = self._forward(feed)
                for b, t in enumerate(feed):
                    if t is not None:
                        logits[b] = out[b, 0]
            mx.async_eval([t[-1] for t in tokens if len(t) > i])
        proposals = []
        for (p, _, k, _), toks, qs in zip(requests, tokens, probs):
            # the draft cache now also holds toks[:-1]; their fate is known after verify
            p._fed_drafts = k - 1
            q = None if p.sampling.greedy else mx.stack(qs)
            proposals.append(Proposal(tokens=mx.stack(toks), draft_probs=q, source="draft"))
        return proposals

    def update(self, proposer: DraftModelProposer, context: list[int], num_accepted: int) -> None:
        """After verification: keep the accepted drafted tokens (DraftModelProposer.update)."""
        if not proposer._fed_drafts:
            return
        b = self.members.index(proposer)
        kept = min(num_accepted, proposer._fed_drafts)
        drop = proposer._fed_drafts - kept
        for c in self.cache:
            c.trim_rows([drop if i == b else 0 for i in range(len(self.members))])
        start = len(proposer.cached)
        proposer.cached += context[start : start + kept]
        proposer._fed_drafts = 0
