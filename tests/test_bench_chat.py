"""`mlxspec bench` on a model with its own chat template (not the bundled formats): the
chat-template workloads, the refusal of workloads it lacks, and a run end to end."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from conftest import REPO, build_model, save_model_dir

from mlxspec.bench.workloads import (
    CHAT_WORKLOADS,
    EDIT_INSTRUCTION,
    build_workload,
    check_workloads,
    uses_bundled_formats,
    workloads_for,
)
from mlxspec.cli.main import main
from mlxspec.errors import MlxspecError

# Markers unlike the bundled ChatML, so a prompt that went through the template shows it.
TEMPLATE = ("{% for m in messages %}<|turn|>{{ m['role'] }}: {{ m['content'] }}<|end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|turn|>assistant: {% endif %}")


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    """A tiny random llama whose tokenizer has a non-bundled chat template and no FIM tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("chat-model")
    model, cfg = build_model("llama", seed=7, layers=1, vocab=300, scale=4.0, max_pos=2048)
    cfg["eos_token_id"] = 0
    save_model_dir(model, cfg, d)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|turn|>",
                                                                  "<|end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([(REPO / "tests" / "fixtures" / "tokenizer_corpus.txt").read_text()],
                            trainer)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
        "chat_template": TEMPLATE, "model_max_length": 2048}))
    return d


@pytest.fixture(scope="module")
def tokenizer(chat_model_dir):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    return load_tokenizer(chat_model_dir)


def test_the_rule_picks_the_chat_workloads(tokenizer, model_dirs):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlxspec.models import bundled_model_path

    assert not uses_bundled_formats(tokenizer)
    assert workloads_for(tokenizer) == CHAT_WORKLOADS
    # The bundled model, and a model in its formats (FIM tokens + the same ChatML), keep theirs.
    for path in (bundled_model_path("target"), model_dirs["llama"]):
        assert uses_bundled_formats(load_tokenizer(path))
    assert uses_bundled_formats(None)


def test_chat_prompts_go_through_the_template(tokenizer):
    items = {w: build_workload(w, 2, None, seed=3, tokenizer=tokenizer) for w in CHAT_WORKLOADS}
    for w in ("edit", "rewrite", "quote", "chat", "free"):
        for it in items[w]:
            assert it.prompt.startswith("<|turn|>user: ") and it.prompt.endswith(
                "<|end|>\n<|turn|>assistant: "), it.prompt[-80:]
            assert "<|im_start|>" not in it.prompt
    for it in items["edit"]:
        doc = it.meta["document"]
        assert 40 <= doc.count("\n") <= 80 and doc.count("def ") >= 2
        assert doc.rstrip() in it.prompt and EDIT_INSTRUCTION in it.prompt
        assert it.prediction == doc.rstrip("\n") and it.max_tokens == 256
    assert all(it.temperature == 1.0 for it in items["free"])
    assert all("<|turn|>" not in it.prompt for it in items["completion"])  # plain code
    assert items["quote"][0].max_tokens == 128 and items["completion"][0].max_tokens == 64
    # Deterministic per seed; --max-tokens caps every workload.
    again = build_workload("edit", 2, 48, seed=3, tokenizer=tokenizer)
    assert [i.prompt for i in again] == [i.prompt for i in items["edit"]]
    assert all(i.max_tokens == 48 for i in again)
    mixed = build_workload("mixed", 6, 16, seed=0, tokenizer=tokenizer)
    assert len(mixed) == 6 and all(i.max_tokens == 16 for i in mixed)


def test_a_workload_the_model_lacks_is_refused(tokenizer):
    with pytest.raises(MlxspecError, match=r"fim needs a model with FIM tokens .*; "
                                           r"SmolLM2 has none; it has: edit, rewrite"):
        check_workloads(["edit", "fim"], tokenizer, "SmolLM2")
    with pytest.raises(MlxspecError, match="doc-qa is not a workload of M"):
        check_workloads(["doc-qa"], tokenizer, "M")


@pytest.mark.slow
def test_bench_runs_a_chat_model_end_to_end(chat_model_dir, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(main, [
        "bench", "-m", str(chat_model_dir), "--quick", "--modes", "none,ngram",
        "--workloads", "edit,chat", "--prompts", "1", "--max-tokens", "8", "--audit", "2",
        "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "workloads: edit, chat (the model's chat template)" in result.stderr
    assert "] 2/2" in result.stderr  # the progress bar: a prompt of each workload, two modes
    assert "| edit | 0 | ngram |" in result.stdout and "| chat | 0 | none |" in result.stdout
    assert "audit ngram: 4/4 identical to none (T=0, T=1, seeded)" in result.stdout
    report = json.loads((out / "bench.json").read_text())
    assert report["workloads"] == "the model's chat template"
    assert report["results"]["edit@0"]["max_tokens"] == 8
    fim = CliRunner().invoke(main, ["bench", "-m", str(chat_model_dir), "--workloads", "fim",
                                    "--prompts", "1", "--audit", "0", "--out", str(tmp_path)])
    assert fim.exit_code == 2 and "fim needs a model with FIM tokens" in fim.stderr
