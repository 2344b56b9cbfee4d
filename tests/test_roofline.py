"""The roofline's arithmetic: bytes and flops of a forward, and a run's projected time."""

from __future__ import annotations

import mlx.nn as nn
import pytest
from conftest import build_model
from mlx.utils import tree_flatten

from mlxspec.bench.roofline import ForwardCost, Rates, forward_cost, project_run


def multiplied_weights(model) -> int:
    """Counted independently: every 2-D weight but the embedding table, plus the table when
    the head is tied to it."""
    params = dict(tree_flatten(model.parameters()))
    n = sum(v.size for k, v in params.items() if v.ndim == 2 and "embed_tokens" not in k)
    if model.args.tie_word_embeddings:
        n += params["model.embed_tokens.weight"].size
    return n


@pytest.mark.parametrize("tied", [True, False])
def test_forward_cost_counts_bytes_and_flops(tied):
    model, _ = build_model("llama", seed=3, tie_word_embeddings=tied)
    cost = forward_cost(model)
    params = dict(tree_flatten(model.parameters()))
    floats = sum(v.nbytes for v in params.values())
    if not tied:  # a step reads one row of an untied embedding table
        floats -= params["model.embed_tokens.weight"].nbytes
    assert cost.weight_bytes == floats
    assert cost.flops_per_row == 2 * multiplied_weights(model)
    a = model.args
    head_dim = a.hidden_size // a.num_attention_heads
    assert cost.kv_bytes_per_token == 2 * a.num_hidden_layers * a.num_key_value_heads * \
        head_dim * 4  # float32 keys and values
    assert forward_cost(model, weight_bytes_per_param=2).weight_bytes == floats // 2
    # a 4-bit copy multiplies as many weights, reading far fewer bytes
    nn.quantize(model, group_size=32, bits=4)
    quantized = forward_cost(model)
    assert quantized.flops_per_row == cost.flops_per_row
    assert quantized.weight_bytes < 0.35 * floats


def test_a_run_is_projected_from_its_forwards_width_and_draft_forwards():
    target = ForwardCost(weight_bytes=1000, kv_bytes_per_token=10, flops_per_row=500,
                         attention_flops_per_token=2)
    draft = ForwardCost(weight_bytes=100, kv_bytes_per_token=1, flops_per_row=50,
                        attention_flops_per_token=1)
    rates = Rates(bandwidth=1000.0, flops=100.0)
    plain = {"target_forwards": 10, "drafted": 0, "prompt_tokens": 96}
    # context 96 + 8/2 = 100: one row streams (1000 + 10 x 100) bytes at 1000 B/s
    assert project_run(plain, 8, target, rates) == pytest.approx(10 * 2.0)
    # 4 forwards verifying 3 drafted tokens each: width 4, each further row (500 + 2 x 100)
    # flops at 100 flop/s; and 12 one-row draft forwards of (100 + 100) bytes
    spec = {"target_forwards": 4, "drafted": 12, "prompt_tokens": 96,
            "drafted_by_source": {"draft": 12}}
    want = 4 * (2.0 + 3 * 7.0) + 12 * 0.2
    assert project_run(spec, 8, target, rates, draft) == pytest.approx(want)
    # prompt lookup's tokens cost no draft forward; bytes only ignores the arithmetic
    lookup = dict(spec, drafted_by_source={"ngram": 12})
    assert project_run(lookup, 8, target, rates, draft) == pytest.approx(4 * 23.0)
    assert project_run(lookup, 8, target, rates, draft, bytes_only=True) == pytest.approx(8.0)
    assert project_run({"target_forwards": 0}, 8, target, rates) == 0.0
