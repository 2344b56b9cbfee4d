"""The bundled target + draft pair in models/: loading, tokenizer, chat template, resolution,
and held-out bits per byte against the model card."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import mlxspec  # noqa: F401  (conftest also loads OpenBLAS before mlx.core)
from mlxspec.models import ENV_VAR, bundled_model_path
from mlxspec.recipe import format_chat, heldout_eval_texts
from mlxspec.recipe.corpus import SPECIAL_TOKENS
from mlxspec.recipe.heldout import TEST_EVAL_BYTES

REPO = Path(__file__).resolve().parent.parent
MODELS = REPO / "models"

# The bundled pair ships in the repository: these tests are never skipped. Figures below were
# measured on 2026-12-01 with the commands in their comments, independently of models/card.json
# (which `mlxspec train` writes with the same recipe functions), and are checked against both.
TARGET_PARAMS = 6_393_088
DRAFT_PARAMS = 811_488
# bits_per_byte(target, ..., heldout_eval_texts(TEST_EVAL_BYTES), window=1024), float32
HELDOUT_SUBSET_BITS_PER_BYTE = 1.3023
# mlxspec.load("models", mode="draft", num_draft=4) over card["acceptance"]'s 16 prompts of
# 256 tokens, 64 generated each: stats.accepted / stats.drafted
ENGINE_DRAFT_ACCEPTANCE = 0.2003


def needs_models(test):  # kept as a marker of what needs the shipped pair; never skips
    return test


@pytest.fixture(scope="module")
def pair():
    from mlx_lm import load

    target, ttok = load(str(MODELS / "target"))
    draft, dtok = load(str(MODELS / "draft"))
    return target, ttok, draft, dtok


@pytest.fixture(scope="module")
def card():
    return json.loads((MODELS / "card.json").read_text())


@needs_models
def test_both_load_with_mlx_lm(pair, card):
    from mlx.utils import tree_flatten

    target, ttok, draft, dtok = pair
    for which, model in (("target", target), ("draft", draft)):
        cfg = json.loads((MODELS / which / "config.json").read_text())
        assert cfg["model_type"] == "llama"
        assert cfg["max_position_embeddings"] >= 1024
        eot, im_end = ttok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
        assert cfg["eos_token_id"] == [eot, im_end]
        params = dict(tree_flatten(model.parameters()))
        assert all(str(v.dtype) == "mlx.core.float16" for v in params.values())
        n = sum(v.size for v in params.values())
        assert n == card[which]["params"] == {"target": TARGET_PARAMS, "draft": DRAFT_PARAMS}[which]
    n_target = TARGET_PARAMS
    assert 5e6 <= n_target <= 20e6
    assert card["draft"]["macs_per_token"] < 0.25 * card["target"]["macs_per_token"]
    total = sum(f.stat().st_size for f in MODELS.rglob("*") if f.is_file())
    assert total < 60e6


@needs_models
def test_same_tokenizer(pair):
    _, ttok, _, dtok = pair
    assert ttok.get_vocab() == dtok.get_vocab()
    assert (MODELS / "target" / "tokenizer.json").read_bytes() == (
        MODELS / "draft" / "tokenizer.json").read_bytes()
    vocab = ttok.get_vocab()
    for s in SPECIAL_TOKENS:
        assert s in vocab
        assert ttok.encode(s, add_special_tokens=False) == [vocab[s]]
    assert 4000 <= len(vocab) <= 8192


@needs_models
def test_chat_template_renders(pair):
    _, ttok, _, _ = pair
    msgs = [{"role": "user", "content": "What does `heapq.heappush` do?"}]
    text = ttok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == format_chat(msgs, add_generation_prompt=True)
    assert text == "<|im_start|>user\nWhat does `heapq.heappush` do?<|im_end|>\n<|im_start|>assistant\n"
    ids = ttok.apply_chat_template(msgs, add_generation_prompt=True)
    assert ids[0] == ttok.convert_tokens_to_ids("<|im_start|>")


@needs_models
def test_bundled_model_path(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert bundled_model_path("target") == MODELS / "target"
    assert bundled_model_path("draft") == MODELS / "draft"
    monkeypatch.setenv(ENV_VAR, str(MODELS))
    assert bundled_model_path("draft") == MODELS / "draft"
    monkeypatch.setenv(ENV_VAR, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="python -m mlxspec.recipe"):
        bundled_model_path("target")
    with pytest.raises(ValueError):
        bundled_model_path("other")


@needs_models
def test_heldout_bits_per_byte_matches_card(pair, card):
    import mlx.core as mx

    from mlxspec.recipe.train import bits_per_byte

    target, ttok, _, _ = pair
    target.set_dtype(mx.float32)
    try:
        texts = heldout_eval_texts(TEST_EVAL_BYTES)
        eot = ttok.convert_tokens_to_ids("<|endoftext|>")
        ev = bits_per_byte(target, lambda s: ttok.encode(s, add_special_tokens=False), texts, eot,
                           window=card["target"]["max_position_embeddings"])
    finally:
        target.set_dtype(mx.float16)
    claimed = card["target"]["heldout_test_subset"]["bits_per_byte"]
    assert ev["bytes"] == card["target"]["heldout_test_subset"]["bytes"]
    assert abs(ev["bits_per_byte"] - HELDOUT_SUBSET_BITS_PER_BYTE) < 0.01
    assert abs(claimed - HELDOUT_SUBSET_BITS_PER_BYTE) < 0.01
    assert ev["bits_per_byte"] < 4.0  # a real model, far below 8 bits/byte
    readme = (MODELS / "README.md").read_text()
    assert f"{card['target']['heldout']['bits_per_byte']:.4f}" in readme


@needs_models
def test_mlxspec_load_generates():
    eng = mlxspec.load(str(MODELS / "target"))
    res = eng.generate("def fibonacci(n):", max_tokens=24)
    assert 0 < len(res.tokens) <= 24
    assert isinstance(res.text, str) and res.text
    spec = mlxspec.load(str(MODELS / "target"), mode="draft", draft=str(MODELS / "draft"),
                        num_draft=4)
    res2 = spec.generate("def fibonacci(n):", max_tokens=24)
    assert res2.tokens == res.tokens  # greedy speculative decoding is exact


@needs_models
def test_draft_acceptance_matches_card(pair, card):
    import mlx.core as mx

    from mlxspec.recipe.recipe import acceptance_prompts
    from mlxspec.recipe.train import greedy_acceptance

    target, ttok, draft, _ = pair
    acc = card["acceptance"]
    target.set_dtype(mx.float32)
    draft.set_dtype(mx.float32)
    try:
        texts = heldout_eval_texts(card["eval_bytes"])
        eot = ttok.convert_tokens_to_ids("<|endoftext|>")
        prompts = acceptance_prompts(lambda s: ttok.encode(s, add_special_tokens=False), texts,
                                     eot, n=acc["prompts"], length=acc.get("prompt_tokens", 256))
        got = greedy_acceptance(target, draft, prompts, gen_tokens=acc["gen_tokens"], k=acc["k"])
    finally:
        target.set_dtype(mx.float16)
        draft.set_dtype(mx.float16)
    assert abs(got["agreement"] - acc["agreement"]) < 0.02
    assert abs(got["chain_acceptance"] - acc["chain_acceptance"]) < 0.02
    # ... and the card's figure agrees with the engine's own count, a separate code path
    assert abs(acc["chain_acceptance"] - ENGINE_DRAFT_ACCEPTANCE) < 0.02


@needs_models
def test_engine_draft_acceptance_measured_independently():
    from mlxspec.engine import PromptCache
    from mlxspec.recipe.recipe import acceptance_prompts

    card = json.loads((MODELS / "card.json").read_text())
    engine = mlxspec.load(str(MODELS), mode="draft", num_draft=4)
    tok = engine.tokenizer
    texts = heldout_eval_texts(card["eval_bytes"])
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    prompts = acceptance_prompts(lambda s: tok.encode(s, add_special_tokens=False), texts, eot,
                                 n=16, length=256)
    drafted = accepted = 0
    for p in prompts[:8]:  # half of them: the figure is stable to 0.03 over 8 prompts
        s = engine.generate(list(p), max_tokens=64, prompt_cache=PromptCache()).stats
        drafted, accepted = drafted + s.drafted, accepted + s.accepted
    assert abs(accepted / drafted - ENGINE_DRAFT_ACCEPTANCE) < 0.04


def test_wheel_layout_resolution(tmp_path, monkeypatch):
    """An installed wheel: no models/ next to the package, the pair under <prefix>/share."""
    import sys

    import mlxspec.models as M

    monkeypatch.delenv(ENV_VAR, raising=False)
    fake_pkg = tmp_path / "lib" / "site-packages" / "mlxspec"
    fake_pkg.mkdir(parents=True)
    monkeypatch.setattr(M, "__file__", str(fake_pkg / "models.py"))
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "prefix"))
    for which in ("target", "draft"):
        d = tmp_path / "prefix" / "share" / "mlxspec" / "models" / which
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
        (d / "model.safetensors").write_bytes(b"")
    assert M.bundled_model_path("draft") == tmp_path / "prefix" / "share" / "mlxspec" / "models" / "draft"
