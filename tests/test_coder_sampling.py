"""`draft` at temperature 1 keeps the target's distribution on real models (issue 45): at the
positions where target and draft are both uncertain and disagree most, the draft samples its
proposal from q, the project's acceptance rule (`step.verify_sampled`) verifies it against the
target's p, and the emitted tokens are counted: the first must follow p, the bonus after an
accepted proposal p given it (chi-square). The same test must reject a deliberately broken rule
(on a rejection, resampling from p instead of the residual max(0, p - q)).

The real pair (1.5B target, 0.5B draft) is marked `large`; CI runs the 0.5B against its own
4-bit copy (a real draft that disagrees less: the broken rule is checked only where p and q
differ enough to show it)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mlxspec
from mlxspec.gguf import sources
from mlxspec.sampling import SamplingParams, probs_from_logits
from mlxspec.step import _leading_true, verify_sampled

SAMPLING = SamplingParams(temperature=1.0, top_k=3)
RUNS = 3000
PROMPTS = [
    "<|fim_prefix|>def area(shape):\n    if shape.kind == 'circle':\n        return<|fim_suffix|>"
    "\n    raise ValueError(shape.kind)\n<|fim_middle|>",
    "<|im_start|>user\nName a good variable for a counter.<|im_end|>\n<|im_start|>assistant\n",
    "import os\nimport sys\n\n\ndef main(argv):\n    path =",
    "# Utilities for parsing dates\nfrom datetime import",
]


def broken_verify(p, draft, q, key):
    """The rule with one mistake: a rejected proposal is resampled from p, not the residual."""
    accept_key, sample_key = mx.random.split(key)
    p_x = p[0, draft[0]]
    accept = mx.random.uniform(key=accept_key) < mx.minimum(1.0, p_x / q[0, draft[0]])
    n = _leading_true(accept[None])
    return n, mx.random.categorical(mx.log(p[n] + 1e-30), key=sample_key)


def positions(target, draft, tokenizer, keep: int = 2):
    """The prompts where p and q (after the sampling transforms) differ most."""
    scored = []
    for text in PROMPTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        p = probs_from_logits(target(mx.array(ids)[None])[0, -1], SAMPLING)
        q = probs_from_logits(draft(mx.array(ids)[None])[0, -1], SAMPLING)
        scored.append((0.5 * mx.abs(p - q).sum().item(), ids, p, q))
    scored.sort(key=lambda s: -s[0])
    return scored[:keep]


def draw(target, ids, p, q, rule, seed: int) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """Counts of the first emitted token, and of the bonus token per accepted proposal. The
    rule sees p and q (after the sampling transforms, as `step.verify_chain` hands them to
    it) cut to the tokens any of them can emit: the same draws, in microseconds."""
    proposals = mx.random.categorical(mx.log(mx.broadcast_to(q, (RUNS, q.shape[-1])) + 1e-30),
                                      key=mx.random.key(seed)).tolist()
    after = {d: probs_from_logits(target(mx.array(ids + [d])[None])[0, -1], SAMPLING)
             for d in set(proposals)}
    rows = [p, q, *after.values()]
    support = sorted({int(t) for row in rows for t in np.flatnonzero(np.array(row))})
    cut = mx.array(support, mx.int32)
    small_q = q[cut][None]
    first = np.zeros(p.shape[-1])
    bonus: dict[int, np.ndarray] = {}
    keys = mx.random.split(mx.random.key(seed + 1), RUNS)
    for d, key in zip(proposals, keys):
        rows = mx.stack([p[cut], after[d][cut]])
        n, token = rule(rows, mx.array([support.index(d)]), small_q, key)
        n, token = int(n.item()), support[int(token.item())]
        if n == 0:
            first[token] += 1
        else:
            first[d] += 1
            bonus.setdefault(d, np.zeros(p.shape[-1]))[token] += 1
    return first, bonus


def pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    from scipy.stats import chisquare

    support = probs > 0
    assert counts[~support].sum() == 0, "a token outside the target's support was emitted"
    expected = probs[support] / probs[support].sum() * counts.sum()
    return float(chisquare(counts[support], expected).pvalue)


def check_pair(target, draft, tokenizer, min_difference: float):
    checked_broken = False
    for difference, ids, p, q in positions(target, draft, tokenizer):
        first, bonus = draw(target, ids, p, q, verify_sampled, seed=1)
        p_np = np.array(p, dtype=np.float64)
        assert pvalue(first, p_np) > 1e-3, (difference, first)
        for d, counts in bonus.items():
            if counts.sum() >= 200:
                after = probs_from_logits(target(mx.array(ids + [d])[None])[0, -1], SAMPLING)
                assert pvalue(counts, np.array(after, dtype=np.float64)) > 1e-3
        if difference >= min_difference:
            broken, _ = draw(target, ids, p, q, broken_verify, seed=1)
            assert pvalue(broken, p_np) < 1e-6, (difference, broken)
            checked_broken = True
    return checked_broken


@pytest.mark.slow
def test_draft_sampling_is_exact_on_the_real_coder_and_its_4bit_copy(coder_small,
                                                                     coder_small_4bit):
    check_pair(coder_small.model, coder_small_4bit, coder_small.tokenizer, min_difference=0.15)


@pytest.mark.large
def test_draft_sampling_is_exact_on_the_real_pair_and_a_broken_rule_fails():
    for name in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"):
        if sources.named_model_cached(name) is None:
            pytest.skip(f"{name} is not cached (mlxspec models fetch qwen2.5-coder-1.5b)")
    engine = mlxspec.load("qwen2.5-coder-1.5b", mode="none", no_draft=True)
    draft = mlxspec.load("qwen2.5-coder-0.5b", mode="none", no_draft=True).model
    assert check_pair(engine.model, draft, engine.tokenizer, min_difference=0.1)
