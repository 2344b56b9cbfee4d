"""The Python API loads like the CLI: a folder holding target/ and draft/ is a pair, the pair's
draft is loaded when a mode first needs it, and settings that cannot speculate are refused."""

from __future__ import annotations

import pytest
from conftest import REPO

import mlxspec
from mlxspec.errors import MlxspecError


def test_pair_folder_and_draft_loaded_on_demand():
    engine = mlxspec.load(str(REPO / "models"), mode="ngram")
    assert engine.draft_model is None and engine.name.endswith("target")
    engine.set_mode("draft")  # as `mlxspec chat`'s /mode draft does
    assert engine.draft_model is not None
    out = engine.generate("def add(a, b):", max_tokens=8)
    assert out.stats.drafted > 0


def test_auto_loads_the_pairs_draft_as_one_of_its_sources():
    """`auto` (every command's default) proposes from the draft too, so it loads the pair's."""
    engine = mlxspec.load(None)
    assert engine.mode == "none" and engine.draft_model is None
    engine.set_mode("auto")
    assert engine.draft_model is not None and engine.proposer.draft is not None
    assert "draft" in engine.proposer.available([1, 2, 3], 4)


def test_adaptive_without_a_speculative_mode_is_refused():
    with pytest.raises(MlxspecError, match="mode='auto'"):
        mlxspec.load(None, adaptive=True)


def test_a_half_built_pair_folder_is_explained(tmp_path):
    (tmp_path / "target").mkdir()
    with pytest.raises(MlxspecError) as e:
        mlxspec.load(str(tmp_path))
    assert "draft" in str(e.value)


def test_engine_settings_reach_the_engine():
    """kv='hierarchical' selects QuantSpec's reference cache for `none` (it was dropped)."""
    engine = mlxspec.load(None, mode="none", kv="hierarchical", kv_group_size=32)
    assert engine.kv == "hierarchical" and engine.kv_group_size == 32
    out = engine.generate("def f(x):", max_tokens=4)
    from mlxspec.quant.hierarchical_cache import HierarchicalKVCache

    assert isinstance(engine.prompt_cache.cache[0], HierarchicalKVCache) and out.tokens
