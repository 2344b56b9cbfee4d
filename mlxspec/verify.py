"""Exact acceptance rules, shared by every mode.

`verify_sampled` takes the target's probabilities over [last committed token] + proposal and
returns (num_accepted, next_token) as lazy mx scalars, so the step syncs once; at temperature 0
the step compares the target's argmax with the draft on the host after that sync
(`greedy_accepted`).
The next token is the target's correction at the first rejection, or the bonus token after the
last proposal when all were accepted; every step therefore emits at least one token.
"""

from __future__ import annotations

import mlx.core as mx

from .sampling import sample


def _leading_true(flags: mx.array) -> mx.array:
    """Number of leading True values of a 1-D bool array."""
    if flags.size == 0:
        return mx.array(0, dtype=mx.int32)
    return mx.cumprod(flags.astype(mx.int32)).sum()


def greedy_accepted(target: list[int], draft: list[int]) -> int:
    """Temperature 0: the draft tokens accepted, while each equals the target's argmax
    (`target`: the argmax over [last token] + draft, read back; the next token is
    target[accepted])."""
    for i, d in enumerate(draft):
        if target[i] != d:
            return i
    return len(draft)


def verify_sampled(
    p: mx.array, draft: mx.array, q: mx.array | None, key: mx.array | None
) -> tuple[mx.array, mx.array]:
    """Temperature > 0, exact for any proposal.

    p: (k + 1, vocab) target probabilities; draft: (k,) proposed ids; q: (k, vocab) the draft's
    probabilities, or None for a deterministic proposal (q one-hot at the proposed token);
    key: None draws from MLX's global generator.

    With q (Leviathan et al. / Chen et al.): accept x with probability min(1, p(x)/q(x)); on
    rejection sample from normalize(max(0, p - q)). With q one-hot this becomes: accept x with
    probability p(x); on rejection sample from p with x removed. Bonus from p when all accepted.
    """
    k = draft.size
    # no key: MLX's global generator (a draw that need not be reproducible)
    accept_key, sample_key = mx.random.split(key) if key is not None else (None, None)
    if k == 0:
        return mx.array(0, dtype=mx.int32), sample(p[0], sample_key)
    p_draft = p[:k]
    p_x = mx.take_along_axis(p_draft, draft[:, None], axis=-1)[:, 0]
    if q is None:
        accept_prob = p_x
        residual = mx.where(mx.arange(p.shape[-1])[None, :] == draft[:, None], 0.0, p_draft)
    else:
        q_x = mx.take_along_axis(q, draft[:, None], axis=-1)[:, 0]
        accept_prob = mx.minimum(1.0, p_x / mx.maximum(q_x, 1e-30))
        residual = mx.maximum(p_draft - q, 0.0)
    u = mx.random.uniform(shape=(k,), key=accept_key)
    num_accepted = _leading_true(u < accept_prob)
    rows = mx.concatenate([residual, p[k:]], axis=0)
    row = rows[num_accepted]
    mass = row.sum()
    # A residual of zero mass is only reachable with probability 0 (p == q); fall back to p.
    row = mx.where(mass > 0, row / mx.maximum(mass, 1e-30), p[num_accepted])
    return num_accepted, sample(row, sample_key)
