"""Forward passes over token trees, and the one-call tree step the engine uses.

A tree step feeds [last committed token] + the nodes of a proposal tree to the target in one
forward pass. Node i sits at position parent_position + 1 (the root, the last committed token, at
`cache.offset`) and attends to the committed cache plus its own ancestors only. Two small
adapters make stock mlx-lm models do that without forking any architecture:

* positions: every attention module's `rope` is swapped, for the duration of the call, for a
  wrapper that moves the token axis into the batch axis and hands `mx.fast.rope` one offset per
  token (`rope(x.transpose(2, 1, 0, 3), offset=positions).transpose(2, 1, 0, 3)`);
* mask: each layer cache is wrapped in a view whose `make_mask` returns the ancestor mask (mlx-lm
  models build their mask with `create_attention_mask(h, cache[0])`, which asks the cache).

After verification the accepted path's keys and values are gathered into consecutive cache slots
and everything else is dropped (`compact_cache`), so the cache again holds exactly the committed
tokens but the last - the engine's invariant.

`tree_step` is the tree half of `mlxspec.step.decode_step` (forward, exact verification with
one host sync, compaction). Proposal contract: see `mlxspec.proposers.base.Proposal`.

Sliding-window layers (`caches.WindowedKVCache`) get the tree mask restricted to their window;
recurrent layers cannot run a tree (branches would flow through one state) and are refused.

The rope swap mutates the model's attention modules for the duration of one forward: do not run
a tree step and another forward of the same model object concurrently from two threads.
"""

from __future__ import annotations

import weakref

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import caches
from .errors import MlxspecError
from .proposal import Proposal
from .sampling import SamplingParams, keyed_draw, probs_from_logits
from .tree_verify import (
    TreeSpec,
    device_sampled_deterministic,
    device_sampled_q,
    walk_greedy,
    walk_sampled,
)

# ----------------------------------------------------------------------------- tree geometry


def depths(parents: list[int]) -> list[int]:
    """Depth of every node of a tree in topological order (parents[i] == -1: depth 1)."""
    d: list[int] = []
    for i, p in enumerate(parents):
        if p >= i:
            raise ValueError(f"tree not in topological order: parents[{i}] = {p}")
        d.append(1 if p < 0 else d[p] + 1)
    return d


def ancestor_mask(parents: list[int]) -> np.ndarray:
    """(T+1, T+1) bool: row r (0 = root) sees column c iff c is r or an ancestor of r."""
    t = len(parents) + 1
    m = np.zeros((t, t), dtype=bool)
    m[0, 0] = True
    for i, p in enumerate(parents):
        r = i + 1
        m[r] = m[p + 1]
        m[r, r] = True
    return m


class TrieBuilder:
    """Builds a proposal tree by inserting token paths; equal prefixes share nodes, so each
    distinct (parent, token) is one node. Children keep insertion order (verification order)."""

    def __init__(self):
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self._index: dict[tuple[int, int], int] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int) -> int:
        """The node for `token` under `parent` (-1: root), created if new."""
        key = (parent, token)
        node = self._index.get(key)
        if node is None:
            node = self._index[key] = len(self.tokens)
            self.tokens.append(token)
            self.parents.append(parent)
        return node

    def add_path(self, path, parent: int = -1, budget: int | None = None) -> list[int]:
        """Insert a path under `parent`; stop before the tree exceeds `budget` nodes. Returns
        the nodes of the path's tokens that are in the tree."""
        nodes = []
        for token in path:
            existing = self._index.get((parent, token))
            if existing is None and budget is not None and len(self.tokens) >= budget:
                break
            parent = existing if existing is not None else self.add(parent, token)
            nodes.append(parent)
        return nodes


# ----------------------------------------------------------------------------- adapters

_UNSUPPORTED_ROPE = ("DynamicNTKScalingRoPE",)  # derives its base from offset (a scalar)


class _PerTokenRope:
    """Rotates each token at its own position: token axis moved into mx.fast.rope's batch axis."""

    def __init__(self, inner, positions: mx.array):
        self.inner = inner
        self.positions = positions

    def __call__(self, x, offset=0, **kwargs):
        if x.shape[0] != 1:
            raise MlxspecError("tree forward supports batch size 1 only")
        y = self.inner(x.transpose(2, 1, 0, 3), offset=self.positions, **kwargs)
        return y.transpose(2, 1, 0, 3)


class _TreeCacheView:
    """A layer cache whose `make_mask` returns the tree's mask; everything else delegates."""

    def __init__(self, inner, mask: mx.array):
        self._inner = inner
        self._mask = mask

    def make_mask(self, n, return_array=False, window_size=None):
        if window_size is not None and not isinstance(self._inner, caches.WindowedKVCache):
            raise MlxspecError("tree forward: a sliding window over a cache that does not "
                               "know it (make caches with mlxspec.caches.make_cache)")
        return self._mask

    def update_and_fetch(self, keys, values):
        return self._inner.update_and_fetch(keys, values)

    def __getattr__(self, name):
        return getattr(self._inner, name)


_SITES: dict[int, tuple[weakref.ref, list]] = {}


def rope_sites(model: nn.Module) -> list[nn.Module]:
    """The modules holding a `rope` (one per attention layer), cached per model."""
    hit = _SITES.get(id(model))
    if hit is not None and hit[0]() is model:
        return hit[1]
    sites = []
    for _, module in model.named_modules():
        rope = module.get("rope") if isinstance(module, dict) else None
        if isinstance(rope, nn.Module):
            if type(rope).__name__ in _UNSUPPORTED_ROPE:
                raise MlxspecError(
                    f"tree forward does not support {type(rope).__name__} (its frequencies "
                    "depend on the sequence length)")
            sites.append(module)
    if not sites:
        raise MlxspecError(f"tree forward: no rotary-embedding attention found in "
                           f"{type(model).__module__}; this architecture is not supported")
    _SITES[id(model)] = (weakref.ref(model), sites)
    return sites


def cache_offset(cache: list) -> int:
    return caches.offset(cache)


def tree_forward(model: nn.Module, cache: list, root: int, tokens: list[int],
                 parents: list[int]) -> mx.array:
    """Logits (T+1, vocab), lazily, for [root] + tokens appended to `cache` as a tree.

    Row 0 is the root (the last committed token, at position cache.offset); row i+1 is node i,
    at position offset + depth(i), attending to the cache and its ancestors. The cache grows by
    T+1 entries in this flat order (see `compact_cache`)."""
    offset = cache_offset(cache)
    dep = np.asarray([0] + depths(parents), dtype=np.int32)
    t = len(dep)
    inputs = mx.array([root] + list(tokens), mx.uint32)[None]
    if all(p == i - 1 for i, p in enumerate(parents)):  # a chain: the model's own causal path
        return model(inputs, cache=cache)[0]
    if caches.has_recurrent(cache):
        caches.check_tree_support(model, cache, "tree")
    anc = mx.array(ancestor_mask(parents))
    mask = mx.concatenate([mx.ones((t, offset), mx.bool_), anc], axis=1) if offset else anc
    positions = mx.array(dep + offset, mx.int32)
    sites = rope_sites(model)
    originals = [s.rope for s in sites]
    dep_arr = mx.array(dep, mx.int32)
    views = [_TreeCacheView(c, c.tree_mask(anc, dep_arr) if isinstance(
        c, caches.WindowedKVCache) else mask) for c in cache]
    try:
        for s, r in zip(sites, originals):
            s.rope = _PerTokenRope(r, positions)
        logits = model(inputs, cache=views)[0]
    finally:
        for s, r in zip(sites, originals):
            s.rope = r
    return logits


# ----------------------------------------------------------------------------- compaction


def _gather_tail(x, start: int, dst: int, src: mx.array, n: int):
    """x[..., start+dst : start+n, :] = x[..., start+src, :] (x an array or a quantized tuple)."""
    if isinstance(x, (tuple, list)):
        return type(x)(_gather_tail(a, start, dst, src, n) for a in x)
    x[..., start + dst : start + n, :] = x[..., src + start, :]
    return x


def compact_cache(cache: list, start: int, keep: list[int], total: int) -> None:
    """The cache holds `start` committed entries followed by `total` tree entries (root first).
    Keep tree entries `keep` (increasing, keep[0] == 0) in consecutive slots from `start`, drop
    the rest. Lazy: no evaluation happens here.

    Caches may implement `compact(start, keep, total)` themselves (e.g. QuantSpec's, whose
    speculative rows live in its full-precision buffer); mlx-lm's `KVCache` and
    `QuantizedKVCache` (per-token codes) are handled here.
    """
    n = len(keep)
    first = 0
    while first < n and keep[first] == first:
        first += 1
    for c in cache:
        if hasattr(c, "compact"):
            c.compact(start, keep, total)
            continue
        if int(c.offset) != start + total:
            raise MlxspecError(f"cache offset {c.offset} != {start} + {total} after a tree step")
        if first < n:
            if getattr(c, "keys", None) is None or not hasattr(c, "values"):
                raise MlxspecError(f"{type(c).__name__} cannot be compacted after a tree step")
            src = mx.array(keep[first:], mx.int32)
            c.keys = _gather_tail(c.keys, start, first, src, n)
            c.values = _gather_tail(c.values, start, first, src, n)
        c.offset = start + n


# ----------------------------------------------------------------------------- the step


def tree_step(model: nn.Module, cache: list, last_token: int, proposal: Proposal,
              sampling: SamplingParams, seed_at: tuple[int, int] | None,
              max_accept: int | None = None, sync=None) -> tuple[list[int], int]:
    """One speculative step over a tree proposal: forward, exact verification (one host sync),
    cache compaction. Returns (new_tokens, num_accepted): the accepted path's tokens followed
    by the target's own next token, and the path's length (new_tokens has num_accepted + 1).

    `max_accept` caps the accepted path (the engine's remaining-token budget). Capping is exact:
    the next token along the accepted path is distributed as the target's next token.
    On return the cache holds the committed tokens but the last, as before the step.
    `sync`: as in `decode_step` (rank 0's verification outputs on every rank). `seed_at`: a
    keyed row's (seed, position of its next token): each tree row draws at its depth's
    position, and the walk is the greedy one over those draws.
    """
    sync = sync or (lambda x: x)
    tokens = proposal.tokens.tolist()
    parents = list(proposal.parents)
    if len(parents) != len(tokens):
        raise ValueError("proposal.parents must have one entry per token")
    spec = TreeSpec(tokens, parents, proposal.verify)
    start = cache_offset(cache)
    logits = tree_forward(model, cache, last_token, tokens, parents)
    want = list(proposal.want_argmax)
    extra_out = []
    if sampling.greedy or seed_at is not None:
        if sampling.greedy:
            amax = mx.argmax(logits, axis=-1)
        else:
            seed, first = seed_at  # row 0 (the last committed token) draws at `first`
            amax = keyed_draw(logits, sampling, seed,
                              [first] + [first + d for d in depths(parents)])
        fetched = sync(amax).tolist()  # the one host sync
        path, next_token = walk_greedy(spec, fetched)
        want_argmax = [fetched[i + 1] for i in want]
    else:
        p = probs_from_logits(logits, sampling)
        if proposal.draft_probs is None:
            outs = device_sampled_deterministic(spec, p, None)
        else:
            outs = device_sampled_q(spec, p, proposal.draft_probs, None)
        if want:
            extra_out = [mx.argmax(logits[mx.array([i + 1 for i in want])], axis=-1)]
        outs, extra_out = [sync(o) for o in outs], [sync(o) for o in extra_out]
        mx.eval(*outs, *extra_out)  # the one host sync
        fetched = [o.tolist() for o in (*outs, *extra_out)]
        path, next_token = walk_sampled(spec, *fetched[: len(outs)],
                                        deterministic=proposal.draft_probs is None)
        want_argmax = fetched[len(outs)] if want else []
    if max_accept is not None and len(path) > max_accept:
        next_token = tokens[path[max_accept]]
        path = path[:max_accept]
    compact_cache(cache, start, [0] + [i + 1 for i in path], len(tokens) + 1)
    if proposal.on_result is not None:
        proposal.on_result(want_argmax, path)
    return [tokens[i] for i in path] + [int(next_token)], len(path)


def first_chain(tree: Proposal) -> Proposal | None:
    """A tree's first path (each node's first verifiable child) as a deterministic chain
    (exact under the one-hot rule whatever chose it); None where the tree wants the target's
    argmax back (lookahead's window) or has no such path."""
    if tree.want_argmax or tree.on_result is not None:
        return None
    tokens = tree.tokens.tolist()
    chain, at = [], -1
    for i, p in enumerate(tree.parents):
        if p == at and (tree.verify is None or tree.verify[i]):
            chain.append(tokens[i])
            at = i
    return Proposal(mx.array(chain, mx.uint32), source=tree.source) if chain else None
