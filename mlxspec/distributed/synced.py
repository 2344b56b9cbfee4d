"""Rank 0's plan and proposal on every rank, as fixed-size packets: `SyncedPolicy` and
`SyncedProposer` wrap the engine's own."""

from __future__ import annotations

import mlx.core as mx

from ..proposers.base import Proposal, Proposer
from .group import Coordinator, DistributedFailure

MAX_NODES = 256  # proposal packet capacity (chain tokens or tree nodes)
SOURCE_BYTES = 32  # a source name ("ngram:4", "draft") in the plan packet


def encode_source(source: str) -> list[int]:
    raw = source.encode()[:SOURCE_BYTES]
    return [len(raw)] + list(raw) + [0] * (SOURCE_BYTES - len(raw))


def decode_source(vals: list[int]) -> str:
    n = vals[0]
    return bytes(vals[1:1 + n]).decode(errors="replace")


class SyncedPolicy:
    """Rank 0's plan on every rank. `local`: every rank computes the same plan itself (FixedK
    over a cheap, deterministic proposer: the plan is a function of the committed tokens)."""

    def __init__(self, inner, coord: Coordinator, local: bool):
        self.inner, self.coord, self.local = inner, coord, local

    @property
    def max_k(self) -> int:
        return self.inner.max_k

    def plan(self, available: dict[str, int]) -> tuple[str, int]:
        if self.local:
            return self.inner.plan(available)
        source, k = self.inner.plan(available) if self.coord.leader else ("", 0)
        vals = self.coord.bcast_ints([k] + encode_source(source), 2 + SOURCE_BYTES)
        return decode_source(vals[1:]), vals[0]

    def observe(self, *args, **kwargs) -> None:
        self.inner.observe(*args, **kwargs)

    def observe_plain(self, *args, **kwargs) -> None:
        if hasattr(self.inner, "observe_plain"):
            self.inner.observe_plain(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class SyncedProposer(Proposer):
    """Rank 0 proposes; the proposal reaches every rank as a fixed-size packet
    [n, is_tree, has_verify] + source + tokens + parents + verify flags. With `local` (ngram:
    deterministic from the committed tokens) every rank proposes itself, no packet; the step's
    result sync then checks that the drafts agreed."""

    def __init__(self, inner: Proposer, coord: Coordinator, local: bool):
        self.inner, self.coord, self.local = inner, coord, local
        self.name = inner.name
        self.cheap = inner.cheap
        self.uses_trees = inner.uses_trees
        self.cache_kind = inner.cache_kind
        self.adaptive = getattr(inner, "adaptive", False)

    @property
    def runs_inner(self) -> bool:
        return self.coord.leader or self.local

    def make_target_cache(self, model):
        return self.inner.make_target_cache(model)

    def bind_cache(self, cache: list) -> None:
        self.inner.bind_cache(cache)

    def set_prediction(self, tokens) -> None:
        self.inner.set_prediction(tokens)

    def reset(self, prompt, sampling) -> None:
        if self.runs_inner:  # a draft model prefills on rank 0 only
            self.inner.reset(prompt, sampling)

    def available(self, context, cap):
        if self.runs_inner:
            return self.inner.available(context, cap)
        return {self.name: cap}  # unused: the plan comes from rank 0

    def propose(self, context, num_draft, seed, source=None):
        if self.local:
            p = self.inner.propose(context, num_draft, seed, source=source)
            if not self.coord.leader:
                self._own = p.tokens.tolist() if p is not None and not p.is_tree else None
            return p
        p = None
        if self.coord.leader:
            p = self.inner.propose(context, num_draft, seed, source=source)
            n = len(p) if p is not None else 0
            if n > MAX_NODES:
                raise DistributedFailure(f"a proposal of {n} tokens exceeds the packet "
                                         f"({MAX_NODES}); use a smaller k or tree budget")
            vals = [n, int(p is not None and p.is_tree), int(p is not None and p.verify is not None)]
            vals += encode_source(p.source if p is not None else "")
            if n:
                vals += p.tokens.tolist()
                if p.is_tree:
                    vals += [q + 1 for q in p.parents]
                if p.verify is not None:
                    vals += [int(v) for v in p.verify]
            self.coord.bcast_ints(vals, 3 + 1 + SOURCE_BYTES + 3 * MAX_NODES)
            return p
        vals = self.coord.bcast_ints(None, 3 + 1 + SOURCE_BYTES + 3 * MAX_NODES)
        n, is_tree, has_verify = vals[:3]
        source = decode_source(vals[3:4 + SOURCE_BYTES])
        if n == 0:
            return None
        at = 4 + SOURCE_BYTES
        tokens = vals[at:at + n]
        at += n
        parents = verify = None
        if is_tree:
            parents = [q - 1 for q in vals[at:at + n]]
            at += n
        if has_verify:
            verify = [bool(v) for v in vals[at:at + n]]
        # No draft probabilities here: rank 0's verification result is the one every rank uses.
        return Proposal(tokens=mx.array(tokens, mx.uint32), source=source, parents=parents,
                        verify=verify)

    def update(self, context, num_accepted) -> None:
        own, self._own = getattr(self, "_own", None), None
        if own is not None and num_accepted and (
                own[:num_accepted] != context[-1 - num_accepted:-1]):
            raise DistributedFailure(f"rank {self.coord.rank}: its {self.name} draft differs "
                                     "from rank 0's (a non-deterministic proposer)")
        if self.runs_inner:
            self.inner.update(context, num_accepted)

    def stats(self) -> dict:
        return self.inner.stats()
