"""`caches/rows.py`: a batch's cache as rows: one request's own layers as they are, ragged rows
once a second joins; trimming a row and taking it back out."""

import mlx.core as mx
from conftest import build_model
from mlx_lm.models.cache import make_prompt_cache

from mlxspec import caches
from mlxspec.caches.ragged import RaggedKVCache
from mlxspec.caches.rows import Rows


def prefilled(model, tokens):
    cache = make_prompt_cache(model)
    model(mx.array([tokens]), cache=cache)
    return cache


def test_one_request_keeps_its_own_layers_and_a_second_makes_ragged_rows():
    model, _ = build_model("llama", seed=11)
    own = prefilled(model, [1, 2, 3, 4])
    rows = Rows(model, own)
    assert rows.alone and rows.layers is own and rows.lengths == [4]
    rows.trim_rows([1])
    assert rows.lengths == [3] and caches.offset(own) == 3
    rows.put_row(1, prefilled(model, [5, 6]))
    assert not rows.alone and isinstance(rows.layers[0], RaggedKVCache)
    assert rows.lengths == [3, 2]
    rows.trim_rows([0, 1])
    assert rows.lengths == [3, 1]
    back = rows.take_row(0)
    fresh = prefilled(model, [1, 2, 3])
    assert caches.offset(back) == 3
    assert mx.allclose(back[0].keys[..., :3, :], fresh[0].keys[..., :3, :], atol=1e-5).item()


def test_a_request_alone_is_given_back_as_it_was():
    model, _ = build_model("llama", seed=12)
    own = prefilled(model, [1, 2])
    rows = Rows(model, own)
    assert rows.take_row(0) is own and rows.layers == []
