"""Temperature, top-k, top-p and min-p: logits -> the distribution that is sampled and verified.

The target's p and a draft's q go through the same transforms, so the rejection rule in
`verify.py` compares like with like.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")


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
