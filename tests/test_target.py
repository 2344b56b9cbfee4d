"""`target.py`: what the loop knows of the target: its cache kind, fresh caches, whether a
request may share a batch, and the prefill meter."""

from conftest import build_model, make_engine
from families import build as build_family
from mlx_lm.models.cache import KVCache

from mlxspec.target import PrefillMeter


def test_plain_attention_with_a_chain_proposer_shares_a_batch():
    target, _ = build_model("llama", seed=7)
    view = make_engine(target).target
    assert view.shareable(None) and view.cache_kind(None) == "kv"
    assert all(type(c) is KVCache for c in view.new_cache(None))
    lookahead = make_engine(target, "lookahead").proposer  # token trees: on its own cache
    assert not view.shareable(lookahead)
    hierarchical = make_engine(target, kv="hierarchical", kv_group_size=32).target
    assert not hierarchical.shareable(None)
    assert hierarchical.cache_kind(None).startswith("hierarchical-ref:32")


def test_a_sliding_window_model_decodes_on_its_own_cache():
    model = build_family("gemma3_text", seed=0, sliding_window=4)
    assert not make_engine(model).target.shareable(None)


def test_the_meter_keeps_the_last_prefill_long_enough_to_say():
    meter = PrefillMeter()
    meter.record(1.0, 8)  # too short: fixed costs
    assert meter.seconds_per_token == 0.0
    meter.record(2.0, 40)
    assert meter.seconds_per_token == 0.05
