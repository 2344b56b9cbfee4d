"""`prefill.py`: a prompt into its prompt cache, reusing its longest prefix, in chunks; a
failed forward leaves no cache to reuse; the meter learns a prefill's time per token."""

import mlx.core as mx
import pytest
from conftest import build_model, make_engine
from mlx_lm.models.cache import make_prompt_cache

from mlxspec import caches
from mlxspec.caches.prompt import PromptCache
from mlxspec.prefill import prefill


@pytest.fixture(scope="module")
def engine():
    target, _ = build_model("llama", seed=10)
    return make_engine(target, prefill_step_size=8)


def test_chunks_then_the_rest_equal_one_prefill_and_a_shared_prefix_is_reused(engine):
    prompt = [(3 * i) % 250 + 1 for i in range(30)]
    pc = PromptCache()
    assert prefill(engine.target, prompt, pc, None, limit=10) == 0
    assert pc.tokens == prompt[:10] and caches.offset(pc.cache) == 10
    assert prefill(engine.target, prompt, pc, None) == 10
    assert pc.tokens == prompt[:-1]
    fresh = make_prompt_cache(engine.model)
    engine.model(mx.array([prompt[:-1]]), cache=fresh)
    assert mx.allclose(pc.cache[0].keys[..., :29, :], fresh[0].keys[..., :29, :],
                       atol=1e-4).item()
    assert engine.prefill_seconds_per_token > 0  # 19 tokens: a measured prefill
    other = prompt[:20] + [7, 7, 7]
    assert prefill(engine.target, other, pc, None) == 20 and pc.tokens == other[:-1]


def test_a_forward_that_fails_mid_prefill_drops_the_cache(engine):
    class Failing:
        def __call__(self, *a, **kw):
            raise RuntimeError("out of memory")

        def __getattr__(self, name):
            return getattr(engine.model, name)

    from dataclasses import replace

    broken = replace(engine.target, model=Failing())
    pc = PromptCache()
    with pytest.raises(RuntimeError, match="out of memory"):
        prefill(broken, list(range(1, 20)), pc, None)
    assert pc.cache is None and pc.tokens == []
