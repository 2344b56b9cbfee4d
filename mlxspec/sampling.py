"""Temperature, top-k, top-p and min-p: logits -> the distribution that is sampled and verified.

The target's p and a draft's q go through the same transforms, so the rejection rule in
`step.py` compares like with like.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import mlx.core as mx


@dataclass(frozen=True)
class SamplingParams:
    """A request's sampling settings (a dict key: rows with equal settings draw together).

    `logit_bias`: ((token id, bias), ...) added to the target's logits before anything is
    drawn or verified (-inf bans a token); `logprobs`: None, or how many top alternatives to
    report with each committed token's log-probability (0: the chosen token's only);
    `post_probs`: report probabilities after the sampling transforms (llama.cpp's
    `post_sampling_probs`) instead of the raw log-softmax; `state`: the request's mutable
    per-request state (`constrain.RequestState`: a grammar's matcher, the log-probabilities
    recorded so far), never compared."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    logit_bias: tuple = ()
    logprobs: int | None = None
    post_probs: bool = False
    state: object = field(default=None, compare=False, hash=False, repr=False)

    # Read several times per step: computed once (the settings are frozen, and a request's
    # state has its grammar from the start), kept in the instance's __dict__.
    @cached_property
    def greedy(self) -> bool:
        """Temperature 0: the argmax."""
        return self.temperature == 0.0

    @cached_property
    def stateful(self) -> bool:
        """A row's next draw needs its previous token read back first (a grammar's mask
        depends on it; log-probabilities are kept by the position of the token drawn, which a
        queued step undone would shift): its plain steps are not pipelined."""
        return getattr(self.state, "constraint", None) is not None or self.logprobs is not None

    @cached_property
    def adjusted(self) -> bool:
        """The step does per-row work on its logits (a bias, a grammar's mask,
        log-probabilities)."""
        return bool(self.logit_bias) or self.stateful

    def take_logprobs(self, first: int, n: int) -> list | None:
        """The log-probabilities (`constrain.TokenLogprob`, None where unknown) of the n
        tokens committed at positions first.. (first: the context's length before them);
        None when the request asked for none. Each is handed out once."""
        if self.logprobs is None or self.state is None:
            return None
        return self.state.take(first, n)

    def validate(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0 (or None), got {self.logprobs}")


def probs_from_logits(logits: mx.array, params: SamplingParams) -> mx.array:
    """Probabilities (float32, same shape) after temperature, top-k, top-p and min-p.

    Works on any leading shape; the last axis is the vocabulary. Not for temperature 0.
    """
    logits = logits.astype(mx.float32) / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        # k-th largest logit per row is the cut-off.
        kth = mx.sort(logits, axis=-1)[..., vocab - params.top_k][..., None]
        logits = mx.where(logits < kth, -mx.inf, logits)
    probs = mx.softmax(logits, axis=-1)
    if params.top_p < 1.0:
        # Keep the smallest set of tokens whose mass reaches top_p (the token that crosses
        # the threshold is kept): a token survives when the mass strictly above it < top_p.
        order = mx.argsort(-probs, axis=-1)
        sorted_probs = mx.take_along_axis(probs, order, axis=-1)
        mass_before = mx.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep_sorted = mass_before < params.top_p
        keep = mx.put_along_axis(mx.zeros_like(keep_sorted), order, keep_sorted, axis=-1)
        probs = mx.where(keep, probs, 0.0)
    if params.min_p > 0.0:
        threshold = params.min_p * probs.max(axis=-1, keepdims=True)
        probs = mx.where(probs >= threshold, probs, 0.0)
    if params.top_p < 1.0 or params.min_p > 0.0:
        probs = probs / probs.sum(axis=-1, keepdims=True)
    return probs


def sample(probs: mx.array, key: mx.array) -> mx.array:
    """One draw per row (the last axis) from probabilities; zeros are never drawn.

    The inverse CDF: token i where cdf[i-1] <= u < cdf[i], u uniform over [0, total). No
    transcendental op per vocabulary entry (a categorical over log(p) takes three: on MLX's
    CPU backend, where exp and log are not vectorised, 0.5 ms each over a batch of 8)."""
    cdf = mx.cumsum(probs.astype(mx.float32), axis=-1)
    u = mx.random.uniform(shape=probs.shape[:-1] + (1,), key=key) * cdf[..., -1:]
    return (cdf <= u).sum(axis=-1).astype(mx.uint32)


# -- Position-keyed draws: a seeded request's randomness depends on its seed and the absolute
# position of the token drawn, nothing else, so that every mode draws what `none` draws.

_M64 = 2**64 - 1


def _mix64(z: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit integers that scatters every input bit."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def position_salts(seed: int, positions: Sequence[int]) -> list[tuple[int, int]]:
    """The 64-bit salt of each position under `seed`, as two 32-bit halves (the device hashes
    them with the vocabulary index)."""
    base = _mix64(seed & _M64)
    out = []
    for pos in positions:
        z = _mix64((base + pos * 0x9E3779B97F4A7C15) & _M64)
        out.append((z & 0xFFFFFFFF, z >> 32))
    return out


def _hash32(x: mx.array) -> mx.array:
    """A bijective 32-bit integer hash with low bias (Wellons' lowbias32)."""
    x = x ^ (x >> 16)
    x = x * mx.array(0x7FEB352D, mx.uint32)
    x = x ^ (x >> 15)
    x = x * mx.array(0x846CA68B, mx.uint32)
    return x ^ (x >> 16)


def position_gumbel(salts: mx.array, vocab: int) -> mx.array:
    """Gumbel(0, 1) noise (..., vocab) for salts (..., 2) uint32: a counter-based generator
    (the vocabulary index hashed with the position's salt), so noise at a position is the same
    whichever step, batch or k it is computed in. 23 bits of uniform per entry."""
    index = mx.arange(vocab, dtype=mx.uint32)
    x = _hash32(index ^ salts[..., :1])
    x = _hash32(x ^ salts[..., 1:])
    # In (0, 1), never 0 or 1, in float32: 23 bits + 0.5 fit its 24-bit significand (with 24,
    # the top value rounded to 1.0: +inf noise for about one vocabulary entry in 2^24, which
    # then won the draw whatever its probability, or made a grammar-masked -inf a NaN).
    u = ((x >> 9).astype(mx.float32) + 0.5) * (2.0**-23)
    return -mx.log(-mx.log(u))


def keyed_logits(logits: mx.array, params: SamplingParams) -> mx.array:
    """log p up to a constant per row (float32): argmax(keyed_logits + Gumbel) is an exact draw
    from `probs_from_logits(logits, params)`. Without top-p no softmax runs (MLX's CPU `exp`
    is ~5x its `log`)."""
    if params.top_p < 1.0:
        return mx.log(probs_from_logits(logits, params))  # filtered tokens: -inf
    x = logits.astype(mx.float32) / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = mx.sort(x, axis=-1)[..., vocab - params.top_k][..., None]
        x = mx.where(x < kth, -mx.inf, x)
    if params.min_p > 0.0:  # p >= min_p * max p, in logits
        floor = x.max(axis=-1, keepdims=True) + math.log(params.min_p)
        x = mx.where(x >= floor, x, -mx.inf)
    return x


def keyed_draw(logits: mx.array, params: SamplingParams, seed: int,
               positions: int | Sequence[int]) -> mx.array:
    """The tokens (T,) uint32 that a request with `seed` draws from logits (T, vocab) at
    `positions` (T absolute positions; an int: T consecutive ones from it): Gumbel-max with
    noise keyed by (seed, position), an exact draw from p. Greedy params: the argmax."""
    if params.greedy:
        return mx.argmax(logits, axis=-1).astype(mx.uint32)
    if isinstance(positions, int):
        positions = range(positions, positions + logits.shape[-2])
    salts = mx.array(position_salts(seed, positions), mx.uint32)
    scores = keyed_logits(logits, params) + position_gumbel(salts, logits.shape[-1])
    return mx.argmax(scores, axis=-1).astype(mx.uint32)


def draft_draw(logits: mx.array, params: SamplingParams, seed: int | None,
               position: int) -> tuple[mx.array, mx.array | None]:
    """A drafter's token at `position` from its logits (vocab,), and its q where the rejection
    rule needs it (sampled without a seed): greedy the argmax, with a seed the target's keyed
    noise over the drafter's own distribution (a deterministic proposal)."""
    if params.greedy:
        return mx.argmax(logits, axis=-1), None
    if seed is not None:
        return keyed_draw(logits[None], params, seed, position)[0], None
    q = probs_from_logits(logits, params)
    return sample(q, None), q
