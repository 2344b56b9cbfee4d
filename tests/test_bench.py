"""`mlxspec bench --quick` produces every figure from paired runs, and the audit runs."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from mlxspec.bench.run import summarize
from mlxspec.bench.runners import Run
from mlxspec.bench.workloads import WORKLOADS, build_workload
from mlxspec.cli.main import main
from mlxspec.recipe.heldout import heldout_files, training_files


def test_workloads_come_from_heldout_modules():
    held = {p.name for p in heldout_files()}
    assert held and not held & {p.name for p in training_files()} - {"__init__.py", "__main__.py"}
    for w in WORKLOADS + ("mixed",):
        items = build_workload(w, 7, 16)
        assert len(items) == 7 and all(it.prompt for it in items)
    assert all(it.prediction for it in build_workload("edit", 3))
    assert all(it.temperature == 1.0 for it in build_workload("free", 3))


def test_speedup_is_median_of_paired_ratios():
    runs = {"none": [Run([1] * 10, 1.0, 10), Run([1] * 10, 2.0, 10), Run([1] * 10, 1.0, 10)],
            "ngram": [Run([1] * 10, 0.5, 4, 8, 6), Run([1] * 10, 0.5, 4, 8, 6),
                      Run([1] * 10, 2.0, 10, 4, 0)]}
    s = summarize(runs, weights=1000)
    assert s["ngram"]["speedup_ratios"] == [2.0, 4.0, 0.5]
    assert s["ngram"]["speedup_median"] == 2.0
    assert s["ngram"]["acceptance_rate"] == 12 / 20
    assert s["ngram"]["mean_accepted_length"] == 30 / 18
    assert s["ngram"]["drafted_wasted"] == 8


@pytest.mark.slow
def test_quick_bench_writes_table_json_and_audit(model_dirs, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(main, [
        "bench", "-m", str(model_dirs["llama"]), "--draft-model", str(model_dirs["llama-draft"]),
        "--quick", "--prompts", "2", "--max-tokens", "12", "--workloads", "edit,free",
        "--audit", "3", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "note: --quick runs 2 prompts per workload" in result.stderr
    assert "too noisy to read" in result.stderr
    import importlib.util

    plots = sorted(p.name for p in out.glob("*.png"))
    if importlib.util.find_spec("matplotlib") is None:
        assert not plots and "plots skipped: matplotlib is not installed" in result.stderr
    else:
        assert plots and "plots skipped" not in result.stderr
    report = json.loads((out / "bench.json").read_text())
    assert report["machine_info"]["backend"] == "cpu" and "blas" in report["machine_info"]
    cost = report["verify_cost"]  # what verifying k tokens costs against a plain step
    assert set(cost["ratio"]) == {"1", "5", "9", "17"} and cost["ratio"]["1"] == 1.0
    assert all(s > 0 for s in cost["seconds"].values()) and "verification cost t(w)/t(1)" in \
        result.stderr
    assert set(report["results"]) == {"edit@0", "free@1"}
    for r in report["results"].values():
        assert set(r["modes"]) == {"none", "ngram", "draft", "mlx_lm", "mlx_lm_spec"}
        for f in r["modes"].values():
            assert f["prompts"] == 2 and f["tokens_per_s"] > 0
            assert len(f["speedup_ratios"]) == 2 and f["speedup_median"] is not None
    # the roofline's projection: our modes only (mlx-lm's runs have no step counts), labelled
    assert report["rates"]["bandwidth_gb_s"] > 0 and report["rates"]["gflops"] > 0
    for r in report["results"].values():
        projected = {m for m, f in r["modes"].items() if f.get("projected_tokens_per_s")}
        assert projected == {"none", "ngram", "draft"}
    assert "PROJECTION (not measured)" in (out / "bench.md").read_text()
    assert "| edit | 0 | ngram |" in result.output.split("PROJECTION")[1]
    assert report["audit"]["prompts"] == 3 and report["audit"]["temperatures"] == [0.0, 1.0]
    for m in ("ngram", "draft"):  # greedy and seeded sampled runs alike: token-identical
        assert report["audit"]["modes"][m]["bugs"] == 0
    assert "| edit | 0 | ngram |" in (out / "bench.md").read_text()
    again = CliRunner().invoke(main, ["bench", "--from-json", str(out / "bench.json"),
                                      "--out", str(tmp_path / "again")])
    assert again.exit_code == 0 and "| edit | 0 | ngram |" in again.output
    assert (tmp_path / "again" / "bench.md").read_text() == (out / "bench.md").read_text()


def test_peer_runners_take_a_one_token_prompt(llama_pair):
    from conftest import make_engine

    from mlxspec.bench.runners import EngineRunner, MlxLmRunner, MlxLmSpeculativeRunner

    target, draft = llama_pair
    engine = make_engine(target, "none", draft_model=draft)
    for runner in (EngineRunner(engine, "draft"), MlxLmRunner(engine),
                   MlxLmSpeculativeRunner(engine, 3)):
        run = runner.run([7], 6, 0.0, 0)
        assert len(run.tokens) == 6
    assert MlxLmRunner(engine).run([7], 6, 0.0, 0).tokens == EngineRunner(engine, "none").run(
        [7], 6, 0.0, 0).tokens


def test_default_output_is_the_user_cache_not_the_current_directory(monkeypatch, tmp_path):
    from mlxspec.cli.bench import default_out_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    out = default_out_dir()
    assert out.parent == tmp_path / "cache" / "mlxspec" / "bench"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_out_dir().parent == tmp_path / "home" / ".cache" / "mlxspec" / "bench"


@pytest.mark.parametrize("k_args, fixed_k, auto_cap", [([], 4, 8), (["-k", "6"], 6, 6)])
def test_bench_runs_auto_at_its_own_cap(model_dirs, tmp_path, monkeypatch, k_args, fixed_k,
                                        auto_cap):
    """Without -k the fixed-k modes propose 4 and auto adapts up to 8, as `generate` does (a
    bench that loaded the engine with -k 4 capped auto at 4 and under-reported it)."""
    import mlxspec.bench.run as run

    seen = {}

    def fake_run_workloads(engine, runners, *args, **kwargs):
        for r in runners:
            policy = engine.policy_for(engine.proposer_for(r.mode))
            seen[r.label] = r.num_draft or policy.max_k, policy.max_k
        return {}

    monkeypatch.setattr(run, "run_workloads", fake_run_workloads)
    result = CliRunner().invoke(main, [
        "bench", "-m", str(model_dirs["llama"]), "--modes", "ngram,auto", "--workloads",
        "free", "--audit", "0", "--out", str(tmp_path), *k_args])
    assert result.exit_code == 0, result.output
    assert seen["ngram"][0] == fixed_k and seen["auto"] == (auto_cap, auto_cap)
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["num_draft"] == fixed_k and report["auto_max_k"] == auto_cap
