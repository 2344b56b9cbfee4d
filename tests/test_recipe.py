"""The training recipe (mlxspec.recipe): corpus formats, held-out split, bad input, and a
seconds-long smoke run that writes a loadable model pair."""

from __future__ import annotations

import ast
import json
import random
import shutil
from pathlib import Path

import pytest

import mlxspec  # noqa: F401  (conftest also loads OpenBLAS before mlx.core)
from mlxspec.recipe import (
    HELDOUT_MODULES,
    format_chat,
    heldout_files,
    heldout_functions,
    make_edit_example,
    training_files,
)
from mlxspec.recipe.corpus import (
    EOT,
    FIM_MIDDLE,
    FIM_PREFIX,
    FIM_SUFFIX,
    build_documents,
    edit_messages,
    make_fim_example,
)
from mlxspec.recipe.heldout import stdlib_dir
from mlxspec.recipe.recipe import RecipeError, main, run_recipe

STDLIB = stdlib_dir()
TINY_FILES = ("bisect.py", "colorsys.py", "keyword.py")


@pytest.fixture
def tiny_corpus(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    for name in TINY_FILES:
        shutil.copy(STDLIB / name, d / name)
    return d


def quiet(_msg):
    pass


# ------------------------------------------------------------------ split and formats


def test_heldout_and_training_are_disjoint():
    held = heldout_files()
    train = training_files()
    assert len(held) >= len(HELDOUT_MODULES)
    assert len(train) > 200
    assert not set(held) & set(train)
    train_modules = {p.relative_to(STDLIB).parts[0].removesuffix(".py") for p in train}
    assert not train_modules & set(HELDOUT_MODULES)
    for p in train:
        parts = p.relative_to(STDLIB).parts
        assert "test" not in parts and "tests" not in parts and "site-packages" not in parts


def test_heldout_functions_and_edit_examples():
    funcs = heldout_functions(12)
    assert len(funcs) == 12
    assert len({m for m, _, _ in funcs}) >= 6  # interleaved across modules
    for mod, _name, src in funcs:
        assert mod.split(".")[0] in HELDOUT_MODULES
        ast.parse(src)
        a = make_edit_example(src, random.Random(1))
        b = make_edit_example(src, random.Random(1))
        assert a == b  # deterministic given the rng
        instruction, edited = a
        assert instruction and edited != src.rstrip("\n") + "\n"
        msgs = edit_messages(src, instruction)
        text = format_chat(msgs, add_generation_prompt=True)
        assert text.startswith("<|im_start|>user\n" + instruction)
        assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_fim_example_format():
    text = (STDLIB / "bisect.py").read_text()
    rng = random.Random(0)
    examples = [ex for ex in (make_fim_example(text, rng) for _ in range(20)) if ex]
    assert len(examples) >= 10  # None only when the cut lands on too little text
    for ex in examples:
        assert ex.startswith(FIM_PREFIX) and ex.endswith(EOT)
        pre, rest = ex[len(FIM_PREFIX):].split(FIM_SUFFIX)
        suf, mid = rest.split(FIM_MIDDLE)
        mid = mid[: -len(EOT)]
        assert mid.strip() and pre + mid + suf in text


def test_documents_are_deterministic(tiny_corpus):
    files = sorted(tiny_corpus.glob("*.py"))
    a, ca = build_documents(files, tiny_corpus, seed=3)
    b, cb = build_documents(files, tiny_corpus, seed=3)
    assert a == b and ca == cb
    assert ca["source"] == len(TINY_FILES) and ca["fim"] >= 1
    assert all(d.endswith(EOT) for d in a)


# ------------------------------------------------------------------ bad input


def test_empty_corpus_is_refused(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(RecipeError, match="no readable, non-empty .py files"):
        run_recipe(tmp_path / "out", 1, 1, corpus_dir=empty, log=quiet)
    rc = main(["--out", str(tmp_path / "out"), "--corpus", str(empty)])
    assert rc == 2
    assert "error:" in capsys.readouterr().err


def test_missing_corpus_is_refused(tmp_path):
    rc = main(["--out", str(tmp_path / "out"), "--corpus", str(tmp_path / "nope")])
    assert rc == 2


def test_small_budget_needs_smoke(tmp_path, tiny_corpus, capsys):
    rc = main(["--out", str(tmp_path / "out"), "--corpus", str(tiny_corpus),
               "--target-minutes", "0.5"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "at least 1 minute" in err and "--smoke" in err
    assert not (tmp_path / "out" / "target").exists()


def test_unwritable_output_is_refused(tmp_path, tiny_corpus):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(RecipeError, match="not writable"):
        run_recipe(blocker / "out", 1, 1, corpus_dir=tiny_corpus, log=quiet)


def test_interrupted_run_leaves_no_model_folder(tmp_path, tiny_corpus, monkeypatch):
    from mlxspec.recipe import train as TR

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(TR, "train", boom)
    monkeypatch.delenv("MLXSPEC_RECIPE_KEEP_TMP", raising=False)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        run_recipe(out, 0.01, 0.01, corpus_dir=tiny_corpus, smoke=True, log=quiet)
    assert list(out.iterdir()) == []


# ------------------------------------------------------------------ smoke run


def test_smoke_run_writes_a_loadable_pair(tmp_path, tiny_corpus):
    import mlx.core as mx
    from mlx_lm import load

    out = tmp_path / "out"
    card = run_recipe(out, 0.02, 0.02, seed=0, corpus_dir=tiny_corpus, smoke=True,
                      target_steps=4, draft_steps=4, log=quiet)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "card.json", "draft", "target"]
    assert json.loads((out / "card.json").read_text())["target"]["steps"] == 4
    assert "bits per byte" in (out / "README.md").read_text()
    assert 0 < card["target"]["heldout"]["bits_per_byte"] < 16
    for which in ("target", "draft"):
        model, tok = load(str(out / which))
        cfg = json.loads((out / which / "config.json").read_text())
        assert cfg["model_type"] == "llama"
        assert cfg["eos_token_id"] == [tok.convert_tokens_to_ids("<|endoftext|>"),
                                       tok.convert_tokens_to_ids("<|im_end|>")]
        logits = model(mx.array([tok.encode("def f(x):")]))
        assert logits.shape[-1] == cfg["vocab_size"]
    # Same seed and step counts: identical weights.
    out2 = tmp_path / "out2"
    run_recipe(out2, 0.02, 0.02, seed=0, corpus_dir=tiny_corpus, smoke=True,
               target_steps=4, draft_steps=4, log=quiet)
    a = mx.load(str(out / "target" / "model.safetensors"))
    b = mx.load(str(out2 / "target" / "model.safetensors"))
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)
    assert Path(out / "target" / "tokenizer.json").read_bytes() == Path(
        out2 / "target" / "tokenizer.json").read_bytes()
