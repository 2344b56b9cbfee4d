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
