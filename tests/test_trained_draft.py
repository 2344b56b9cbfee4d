"""`mlxspec train --draft-for`: the reduced-vocabulary draft (a head over some tokens, the
target's embedding shared) is exact at T = 0 and T = 1, is found by `-m MODEL`, and refuses a
target it was not trained for."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import build_model, make_engine
from exact import PROMPT, exact_distribution, min_pvalue, sample_counts
from families import build

from mlxspec.errors import MlxspecError
from mlxspec.recipe.distill import init_draft
from mlxspec.reduced_draft import ReducedHeadDraft


def perturbed(draft, noise: float, seed: int):
    """The draft with noisy layers (so that it disagrees with the target now and then)."""
    from mlx.utils import tree_flatten, tree_unflatten

    mx.random.seed(seed)
    layers = [(k, v + noise * mx.random.normal(v.shape) * v.std())
              for k, v in tree_flatten(draft.parameters()) if ".layers." in k]
    draft.update(tree_unflatten(layers))
    mx.eval(draft.parameters())
    return draft


def test_reduced_head_is_minus_infinity_off_the_head():
    target, _ = build_model("llama", seed=1, scale=4.0)
    draft = init_draft(target, 1, np.array([3, 5, 200]))
    logits = draft(mx.array([[1, 2, 3]]))
    assert logits.shape == (1, 3, 256)
    finite = np.isfinite(np.array(logits[0, -1]))
    assert sorted(np.flatnonzero(finite).tolist()) == [3, 5, 200]
    assert isinstance(draft, ReducedHeadDraft)


@pytest.mark.parametrize("mode", ["draft", "auto"])
def test_greedy_output_is_identical(mode):
    target, _ = build_model("llama", seed=1, scale=4.0)
    draft = perturbed(init_draft(target, 1, np.arange(0, 256, 2)), 0.3, seed=3)
    prompt = list(range(10, 40))
    ref = make_engine(target, "none").generate(prompt, max_tokens=40, temperature=0.0)
    out = make_engine(target, mode, draft_model=draft, num_draft=4).generate(
        prompt, max_tokens=40, temperature=0.0)
    assert out.tokens == ref.tokens
    if mode == "draft":
        assert out.stats.drafted > 0


def test_sampling_is_exact_with_a_reduced_head():
    """Vocabulary 4, a head of 3: the token left out (the target's likeliest first token) is
    never drafted but keeps its probability."""
    target = build("llama", seed=7, scale=2.5, vocab_size=4)
    exact = exact_distribution(target, PROMPT)
    off = int(np.argmax(exact.sum(axis=(1, 2, 3, 4))))
    draft = perturbed(init_draft(target, 1, np.array([t for t in range(4) if t != off])), 0.5,
                      seed=8)
    engine = make_engine(target, "draft", draft_model=draft, vocab=4, num_draft=4)
    drafted = []
    counts = sample_counts(engine, 300, drafted)
    assert sum(drafted) > 0
    assert counts[off].sum() > 50  # the token off the head is still produced
    assert min_pvalue(counts, exact) > 1e-3


def test_train_draft_for_smoke(model_dirs, tmp_path, monkeypatch, capsys):
    """Train (3 steps) a draft for a random target; `-m` finds it in the cache; exact output;
    a draft trained for another target is refused."""
    from mlxspec.loading import load
    from mlxspec.recipe.distill import main

    monkeypatch.setenv("MLXSPEC_CACHE", str(tmp_path / "cache"))
    target = str(model_dirs["llama"])
    assert main(["--draft-for", "-m", target, "--smoke"]) == 0
    out = capsys.readouterr().out
    assert "[distill] done" in out and "wrote" in out
    found = list((tmp_path / "cache" / "drafts").iterdir())
    assert len(found) == 1
    cfg = json.loads((found[0] / "config.json").read_text())
    assert cfg["mlxspec_draft"]["acceptance"]["accept_at_position"]
    engine = load(target, mode="draft", num_draft=4)
    assert isinstance(engine.draft_model, ReducedHeadDraft)
    ids = engine.tokenizer.encode("def f(x):\n    return", add_special_tokens=False)
    a = engine.generate(ids, max_tokens=24, temperature=0.0, mode="none")
    b = engine.generate(ids, max_tokens=24, temperature=0.0)
    assert a.tokens == b.tokens and b.stats.drafted > 0
    # the same draft with another target of the same tokenizer and shape: refused
    with pytest.raises(MlxspecError, match="another target"):
        load(str(model_dirs["llama-draft"]), mode="draft", draft=str(found[0]))


def test_draft_for_bad_input(model_dirs, tmp_path, capsys):
    from mlxspec.recipe.distill import main

    assert main(["--draft-for"]) == 2
    assert "needs a target" in capsys.readouterr().err
    assert main(["--draft-for", "-m", str(tmp_path / "nope"), "--smoke"]) == 2
    assert "error:" in capsys.readouterr().err
    assert main(["--draft-for", "-m", str(model_dirs["llama"]), "--layers", "9"]) == 2
    assert "--layers" in capsys.readouterr().err


@pytest.mark.slow
def test_smollm2_finds_its_draft_and_stays_exact(smollm2_gguf, tmp_path, monkeypatch):
    """`-m smollm2` finds a draft saved as `mlxspec train --draft-for -m smollm2` saves one
    (here SmolLM2's own first two layers and a 4096-token head, untrained, under a models
    folder's drafts/), loads it onto the target and stays exact."""
    from mlxspec.loading import load
    from mlxspec.reduced_draft import (
        embedding_fingerprint,
        find_trained_draft,
        save_reduced_draft,
        tokenizer_digest,
    )

    monkeypatch.setenv("MLXSPEC_MODELS_DIR", str(tmp_path))
    target = load("smollm2", mode="none")
    args = target.model.args
    draft = init_draft(target.model, 2, np.arange(4096))
    save_reduced_draft(draft, tmp_path / "drafts" / "smollm2", {
        "target": "smollm2", "vocab_size": args.vocab_size, "hidden_size": args.hidden_size,
        "tokenizer": tokenizer_digest(target.tokenizer),
        "embedding_fingerprint": embedding_fingerprint(target.model)})
    assert find_trained_draft("smollm2") == tmp_path / "drafts" / "smollm2"
    engine = load("smollm2", mode="draft", num_draft=4)
    assert isinstance(engine.draft_model, ReducedHeadDraft)
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Why is the sky blue? Answer in two sentences."}],
        add_generation_prompt=True)
    want = engine.generate(prompt, max_tokens=32, mode="none").tokens
    got = engine.generate(prompt, max_tokens=32)
    assert got.tokens == want and got.stats.drafted > 0


def test_batched_rows_with_a_reduced_head_draft_equal_each_request_alone():
    """The server's batched draft runs the reduced-head draft as any draft: the batch test of
    `batch_helpers.joins_and_leaves` with this draft."""
    from batch_helpers import joins_and_leaves as run

    target, _ = build_model("llama", seed=1, scale=4.0)
    draft = perturbed(init_draft(target, 1, np.arange(0, 256, 2)), 0.3, seed=3)
    run((target, draft))
