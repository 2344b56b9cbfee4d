"""--distributed: two ring ranks on 127.0.0.1 (free ports), random-weight models, hard timeouts
so that a hang fails fast. Token-identical to single-process plain decoding at T=0."""

from __future__ import annotations

import json
import sys

import pytest
from dist_helpers import PROMPT, launch, rank_script, reference

pytestmark = pytest.mark.slow

@pytest.mark.parametrize("family,strategy", [("llama", "tensor"), ("qwen2", "pipeline")])
def test_sharded_modes_match_plain_decoding(tmp_path, model_dirs, family, strategy):
    modes = ["none", "ngram", "draft", "lookahead", "suffix", "auto"] if family == "llama" else [
        "none", "ngram", "lookahead"]
    draft = model_dirs["llama-draft"] if family == "llama" else None
    (r0, o0, e0), (r1, o1, e1) = launch(tmp_path, rank_script(model_dirs[family], draft,
                                                              strategy, 0.0, modes))
    assert r0 == 0 and r1 == 0, e0 + e1 + "\nOUT0:" + o0 + "\nOUT1:" + o1
    ref = reference(model_dirs[family])
    lines = [json.loads(x) for x in o0.splitlines()]
    assert [x["mode"] for x in lines] == modes
    for x in lines:
        assert x["strategy"] == strategy
        assert x["tokens"] == ref, x["mode"]
    assert sum(x["accepted"] for x in lines) > 0  # speculation really happened
    assert [json.loads(x)["tokens"] for x in o1.splitlines()] == [ref] * len(modes)


def test_sampled_run_is_the_same_on_every_rank(tmp_path, model_dirs):
    (r0, o0, e0), (r1, o1, e1) = launch(tmp_path, rank_script(
        model_dirs["llama"], model_dirs["llama-draft"], "auto", 0.8, ["draft", "ngram"]))
    assert r0 == 0 and r1 == 0, e0 + e1
    t0 = [json.loads(x)["tokens"] for x in o0.splitlines()]
    t1 = [json.loads(x)["tokens"] for x in o1.splitlines()]
    assert t0 == t1 and len(t0) == 2 and all(len(t) == 40 for t in t0)


def test_cli_generate_distributed(tmp_path, model_dirs):
    cmd = [sys.executable, "-m", "mlxspec.cli.main", "generate", "--distributed", "-m",
           str(model_dirs["llama"]), "--mode", "ngram", "--max-tokens", "40", "-p", PROMPT,
           "--json"]
    (r0, o0, e0), (r1, o1, e1) = launch(tmp_path, cmd)
    assert r0 == 0 and r1 == 0, e0 + e1
    assert json.loads(o0)["tokens"] == reference(model_dirs["llama"])
    assert o1 == ""  # only rank 0 prints


def test_a_dead_rank_ends_the_other_with_an_error(tmp_path, model_dirs):
    out = launch(tmp_path, rank_script(model_dirs["llama"], None, "auto", 0.0, ["ngram"]),
                 env_extra={"DIST_TEST_DIE": "ngram"})
    (r0, _, _), (r1, _, e1) = out
    assert r0 == 7
    assert r1 == 1 and "error: rank 1: lost another rank" in e1


def test_every_rank_stops_at_rank_0s_end_tokens(tmp_path, model_dirs):
    # chat, edit and serve add the chat template's turn-end tokens on rank 0 only: the
    # followers must stop where rank 0 stops, not run a forward more (a hang)
    ref = reference(model_dirs["llama"])
    stop = next(t for t in ref[5:] if t not in ref[:5])
    cut = ref[:ref.index(stop)]
    (r0, o0, e0), (r1, o1, e1) = launch(
        tmp_path, rank_script(model_dirs["llama"], None, "auto", 0.0, ["none", "ngram"]),
        env_extra={"DIST_TEST_EOS": str(stop)})
    assert r0 == 0 and r1 == 0, e0 + e1
    assert [json.loads(x)["tokens"] for x in o0.splitlines()] == [cut, cut]
    assert [json.loads(x)["tokens"] for x in o1.splitlines()] == [cut, cut]


def test_bad_configurations_are_refused_before_loading(tmp_path, model_dirs):
    from mlxspec.distributed import check_mode, choose_strategy
    from mlxspec.errors import MlxspecError

    cfg = json.loads((model_dirs["llama"] / "config.json").read_text())
    assert choose_strategy(cfg, 2, "auto") == "tensor"
    with pytest.raises(MlxspecError, match="not divisible by 3 ranks"):
        choose_strategy(cfg, 3, "tensor")
    with pytest.raises(MlxspecError, match="no pipeline parallelism"):
        choose_strategy(cfg, 2, "pipeline")
    with pytest.raises(MlxspecError, match="neither tensor- nor pipeline"):
        choose_strategy(dict(cfg, model_type="phi3"), 2, "auto")
    with pytest.raises(MlxspecError, match="quantspec"):
        check_mode("quantspec")


def test_one_process_is_as_today(model_dirs):
    from mlxspec import distributed

    engine = distributed.load(str(model_dirs["llama"]), mode="ngram")
    assert type(engine).__name__ == "Engine" and engine.sync is None
