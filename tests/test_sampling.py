"""`sampling.py`: the settings checked, and the keyed draw a function of (seed, position)
only (its exactness in distribution: `test_step.py`, `test_exact_sampling.py`)."""

import mlx.core as mx
import pytest

from mlxspec.sampling import SamplingParams, keyed_draw, probs_from_logits


@pytest.mark.parametrize("kw,message", [({"temperature": -0.5}, "temperature"),
                                        ({"top_p": 0.0}, "top_p"), ({"top_k": -1}, "top_k"),
                                        ({"min_p": 1.0}, "min_p")])
def test_bad_settings_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kw).validate()


def test_a_keyed_draw_depends_on_the_seed_and_position_only():
    logits = mx.random.normal((3, 50), key=mx.random.key(0))
    s = SamplingParams(temperature=1.0)
    once = keyed_draw(logits, s, 7, 10).tolist()
    assert keyed_draw(logits, s, 7, 10).tolist() == once
    assert keyed_draw(logits[1:], s, 7, 11).tolist() == once[1:]  # by absolute position
    assert len({tuple(keyed_draw(logits, s, seed, 10).tolist()) for seed in range(8)}) > 1


def test_top_k_leaves_k_tokens():
    probs = probs_from_logits(mx.arange(10, dtype=mx.float32)[None],
                              SamplingParams(temperature=1.0, top_k=3))
    assert (probs[0] > 0).sum().item() == 3 and abs(probs.sum().item() - 1) < 1e-5


def test_keyed_noise_is_finite_at_every_hash_value():
    """The noise's uniform never rounds to 0 or 1 in float32, even at the hash's extremes: an
    infinite noise would win a draw whatever the token's probability (about one vocabulary
    entry in 2^24 did, so ~1 % of a 150k-vocabulary model's seeded tokens), or turn a
    grammar's -inf into NaN. Searched over positions until the largest hash value appears."""
    import numpy as np

    from mlxspec.sampling import position_gumbel, position_salts

    vocab = 1 << 16
    top = 0
    for start in range(0, 4096, 256):
        noise = position_gumbel(mx.array(position_salts(3, range(start, start + 256)),
                                         mx.uint32), vocab)
        got = np.array(noise)
        assert np.isfinite(got).all()
        top = max(top, got.max())
    assert top > 15.0  # the extreme was reached (-log(-log(1 - 2**-24)) is 16.6)


def test_a_keyed_draw_never_leaves_a_masked_distribution():
    """One allowed token (a grammar's forced byte): every seed and position draws it."""
    logits = mx.where(mx.arange(1 << 15) == 123, 0.0, -mx.inf)[None].astype(mx.float32)
    logits = mx.repeat(logits, 64, axis=0)
    s = SamplingParams(temperature=1.0)
    for seed in range(16):
        assert set(keyed_draw(logits, s, seed, 0).tolist()) == {123}
