"""`mlxspec train`: --smoke alone is a seconds-long check, --help names the program, shows the
defaults and says how to use the result, and the result loads as `-m OUT`."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from mlxspec.recipe.recipe import SMOKE_STEPS, build_parser, smoke_defaults


def test_help_names_mlxspec_train_shows_defaults_and_usage():
    proc = subprocess.run([sys.executable, "-m", "mlxspec.cli.main", "train", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    out = " ".join(proc.stdout.split())  # argparse wraps lines
    assert out.startswith("usage: mlxspec train ")
    assert "python -m mlxspec.recipe" not in out
    assert "(default: 0)" in out  # --seed
    assert "default 55" in out and "default 15" in out
    assert "mlxspec generate -m OUT" in out and "--smoke" in out


def test_smoke_alone_uses_step_counts_not_the_hour_budget():
    args = build_parser().parse_args(["--out", "x", "--smoke"])
    smoke_defaults(args)
    assert args.target_steps == SMOKE_STEPS and args.draft_steps == SMOKE_STEPS
    # Explicit budgets or steps are kept.
    args = build_parser().parse_args(["--out", "x", "--smoke", "--target-minutes", "0.1",
                                      "--draft-steps", "3"])
    smoke_defaults(args)
    assert args.target_steps is None and args.target_minutes == 0.1 and args.draft_steps == 3


@pytest.mark.slow
def test_smoke_alone_finishes_well_under_a_minute_and_loads_as_a_pair(tmp_path):
    out = tmp_path / "pair"
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "mlxspec.cli.main", "train", "--smoke",
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert elapsed < 60, f"--smoke took {elapsed:.0f} s"
    card = json.loads((out / "card.json").read_text())
    assert card["target"]["steps"] == SMOKE_STEPS and card["draft"]["steps"] == SMOKE_STEPS
    assert f"mlxspec generate -m {out}" in proc.stderr
    gen = subprocess.run([sys.executable, "-m", "mlxspec.cli.main", "generate", "-m", str(out),
                          "--mode", "draft", "-p", "def ", "--max-tokens", "4", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert gen.returncode == 0, gen.stderr
    data = json.loads(gen.stdout)
    assert data["mode"] == "draft" and data["model"] == str(out / "target")
