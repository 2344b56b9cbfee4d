"""Exact verification of a token tree.

Rows are numbered as the tree forward lays them out: row 0 is the root (the last committed
token), row i+1 is node i. The device computes, lazily, the few per-node numbers a walk needs;
the host fetches them in one sync and walks from the root:

* temperature 0: follow the child whose token is the target's argmax, choosing among duplicate
  siblings the one that leads to the longest matching path; the target's argmax at the last node
  reached is the next token.
* temperature > 0, deterministic proposals (n-gram, lookahead): at a node with target
  distribution p, try the children in order; child x is accepted with probability
  r(x) / sum(r), where r is p with the tokens of the children rejected so far removed. If every
  child is rejected, the next token is drawn from p with all children's tokens removed. The
  emitted token at each node is then distributed exactly as p (this is sampling from p by
  sequential "is it this one?" questions), so the output equals the target's.
* temperature > 0 with draft probabilities (SpecInfer, Miao et al. 2023): the children of a node
  must be independent draws from the draft distributions `q_c` given in `draft_probs` (row c:
  the distribution child c was drawn from). Child c is accepted with probability
  min(1, r(x_c) / q_c(x_c)); on rejection r <- normalize(max(0, r - q_c)); if every child is
  rejected the next token is drawn from the final r. Exact for i.i.d. children (not for top-k
  children chosen without replacement - give those as a deterministic proposal instead).

Because the walk stops at a node only after rejecting all its children, the residual the next
token is drawn from is known in advance for every node; it is sampled on the device for all
rows at once, so verification costs exactly one host sync whatever the walk does.
"""

from __future__ import annotations

import mlx.core as mx

from .sampling import sample


class TreeSpec:
    """A proposal tree: tokens, parents (-1: root), which nodes may be accepted."""

    def __init__(self, tokens: list[int], parents: list[int], verify: list[bool] | None = None):
        self.tokens = tokens
        self.parents = parents
        n = len(tokens)
        self.children: list[list[int]] = [[] for _ in range(n + 1)]  # by row
        for i, p in enumerate(parents):
            if not -1 <= p < i:
                raise ValueError(f"parents[{i}] = {p}: tree must be in topological order")
            if verify is None or verify[i]:
                self.children[p + 1].append(i)

    def __len__(self) -> int:
        return len(self.tokens)


# ----------------------------------------------------------------------------- greedy


def walk_greedy(spec: TreeSpec, argmax: list[int]) -> tuple[list[int], int]:
    """(accepted node indices from the root down, next token) given the target's argmax per
    row. Picks the longest path whose every node equals its parent's argmax."""
    n = len(spec)
    tokens, children = spec.tokens, spec.children
    longest = [0] * (n + 1)  # by row: matched depth available below it
    best = [-1] * (n + 1)
    for row in range(n, -1, -1):
        target = argmax[row]
        for c in children[row]:
            if tokens[c] == target and longest[c + 1] + 1 > longest[row]:
                longest[row], best[row] = longest[c + 1] + 1, c
    path, row = [], 0
    while best[row] >= 0:
        path.append(best[row])
        row = best[row] + 1
    return path, argmax[row]


# ----------------------------------------------------------------------------- sampled


def _rows_and_tokens(spec: TreeSpec) -> tuple[list[int], list[int], list[int]]:
    """(parent row, token, node) of every verifiable node."""
    rows, toks, nodes = [], [], []
    for row, kids in enumerate(spec.children):
        for c in kids:
            rows.append(row)
            toks.append(spec.tokens[c])
            nodes.append(c)
    return rows, toks, nodes


def _sample_rows(rows: mx.array, fallback: mx.array, key: mx.array | None) -> mx.array:
    """One draw per row of an unnormalized distribution (`fallback` where it has no mass)."""
    mass = rows.sum(axis=-1, keepdims=True)
    rows = mx.where(mass > 0, rows / mx.maximum(mass, 1e-30), fallback)
    return sample(rows, key)


def _split(key: mx.array | None) -> tuple[mx.array | None, mx.array | None]:
    """Two keys from `key`; None: MLX's global generator for both."""
    return (None, None) if key is None else tuple(mx.random.split(key))


def device_sampled_deterministic(spec: TreeSpec, p: mx.array, key: mx.array | None):
    """Lazy (p of each node's token under its parent, uniforms, per-row residual draws)."""
    n = len(spec)
    u_key, s_key = _split(key)
    rows, toks, nodes = _rows_and_tokens(spec)
    u = mx.random.uniform(shape=(max(n, 1),), key=u_key)
    if not nodes:
        return mx.zeros((max(n, 1),)), u, sample(p, s_key)
    r, t = mx.array(rows), mx.array(toks)
    pc = mx.zeros((n,), p.dtype).at[mx.array(nodes)].add(p[r, t])
    removed = mx.zeros(p.shape, p.dtype).at[r, t].add(1.0)
    residual = mx.where(removed > 0, 0.0, p)
    return pc, u, _sample_rows(residual, p, s_key)


def device_sampled_q(spec: TreeSpec, p: mx.array, q: mx.array, key: mx.array | None):
    """Lazy (acceptance probability of each node, uniforms, per-row final residual draws) for
    the SpecInfer rule; q: (len(spec), vocab), row c = the distribution child c was drawn from."""
    n = len(spec)
    u_key, s_key = _split(key)
    u = mx.random.uniform(shape=(max(n, 1),), key=u_key)
    acc = mx.zeros((max(n, 1),), mx.float32)
    residual = p * 1.0
    rank = 0
    while True:
        pairs = [(row, kids[rank]) for row, kids in enumerate(spec.children) if len(kids) > rank]
        if not pairs:
            break
        rows = mx.array([r for r, _ in pairs])
        kids = mx.array([c for _, c in pairs])
        toks = mx.array([spec.tokens[c] for _, c in pairs])
        cur = residual[rows]
        qk = q[kids].astype(mx.float32)
        ar = mx.arange(len(pairs))
        acc = acc.at[kids].add(mx.minimum(1.0, cur[ar, toks] / mx.maximum(qk[ar, toks], 1e-30)))
        new = mx.maximum(cur - qk, 0.0)
        mass = new.sum(axis=-1, keepdims=True)
        residual[rows] = mx.where(mass > 0, new / mx.maximum(mass, 1e-30), cur)
        rank += 1
    return acc, u, _sample_rows(residual, p, s_key)


def walk_sampled(spec: TreeSpec, node_values: list[float], u: list[float],
                 residual_draws: list[int], deterministic: bool = True) -> tuple[list[int], int]:
    """Host walk for temperature > 0 (see the module docstring). `node_values`: p(token) under
    the parent for deterministic proposals, else the SpecInfer acceptance probability."""
    tokens, children = spec.tokens, spec.children
    path, row = [], 0
    while True:
        accepted = -1
        if deterministic:
            removed: set[int] = set()
            removed_mass = 0.0
            for c in children[row]:
                x = tokens[c]
                if x in removed:
                    continue  # its mass is already gone: acceptance probability 0
                left = 1.0 - removed_mass
                if left > 0 and u[c] * left < node_values[c]:
                    accepted = c
                    break
                removed.add(x)
                removed_mass += node_values[c]
        else:
            for c in children[row]:
                if u[c] < node_values[c]:
                    accepted = c
                    break
        if accepted < 0:
            return path, residual_draws[row]
        path.append(accepted)
        row = accepted + 1
