"""The README's Python example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)


def test_readme_has_a_python_example():
    blocks = readme_python_blocks()
    assert len(blocks) == 1 and "mlxspec.load" in blocks[0]


@pytest.mark.slow
# The example needs mlxspec.load and set_mode("draft") to load the bundled draft on demand;
# adjust here if the README example changes.
def test_readme_python_example_runs_as_written(capsys):
    from mlxspec.models import bundled_models_available

    assert bundled_models_available(), "the README example runs on the bundled pair"
    code = readme_python_blocks()[0]
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    engine = namespace["engine"]
    assert engine.mode == "draft" and engine.draft_model is not None  # set_mode("draft") took
    result = namespace["result"]
    assert result.tokens and result.text and result.stats.generated_tokens == len(result.tokens)
    assert capsys.readouterr().out  # the streamed pieces were printed


# The README's commands run as written: every `mlxspec` line parses with the CLI's own parser
# (options, their values and ranges, no model loaded), `mlxspec train`'s options are in its
# --help, and the headline table is the one run its command wrote to bench-results/.

def readme_commands(text: str | None = None) -> list[list[str]]:
    """Every command line of the README's bash blocks as argv, trailing comments dropped."""
    import shlex

    text = README.read_text() if text is None else text
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
        for line in block.splitlines():
            line = line.split("  #", 1)[0].strip()
            if line:
                commands.append(shlex.split(line))
    return commands


def parse_mlxspec(argv: list[str]) -> dict:
    """Parse `mlxspec SUBCOMMAND ...` as the CLI would, without running it: its parameters."""
    from mlxspec.cli.main import main

    assert argv[0] == "mlxspec" and len(argv) > 1, argv
    command = main.get_command(None, argv[1])
    assert command is not None, f"no command `mlxspec {argv[1]}`"
    with command.make_context(argv[1], list(argv[2:])) as ctx:
        return dict(ctx.params)


def headline() -> tuple[list[str], list[list[str]]]:
    """The headline section's one command and its table's rows (cells)."""
    text = README.read_text()
    section = text.split("## Headline figures", 1)[1].split("\n## ", 1)[0]
    (command,) = readme_commands(section)
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in section.splitlines() if line.startswith("|")]
    return command, rows


def test_readme_commands_parse():
    commands = [c for c in readme_commands() if c[0] == "mlxspec"]
    assert len(commands) >= 10
    for argv in commands:
        if argv[1] == "train":  # options passed through to the recipe: checked by --help below
            continue
        parse_mlxspec(argv)


def test_readme_parser_refuses_what_the_cli_refuses():
    import click

    with pytest.raises(click.UsageError):
        parse_mlxspec(["mlxspec", "bench", "--prompts", "4", "--no-such-option"])
    with pytest.raises(click.UsageError):
        parse_mlxspec(["mlxspec", "bench", "--prompts", "0"])


def test_readme_train_options_are_in_its_help():
    import subprocess
    import sys

    for argv in readme_commands():
        if argv[:2] != ["mlxspec", "train"]:
            continue
        help_text = subprocess.run(
            [sys.executable, "-m", "mlxspec.cli.main", *argv[1:2], "--help"],
            capture_output=True, text=True, timeout=120, check=True).stdout
        for arg in argv[2:]:
            if arg.startswith("--"):
                assert arg in help_text, f"`mlxspec train --help` does not list {arg}"


def test_readme_headline_command_names_real_modes_and_workloads():
    from mlxspec.bench.run import TREE_OPTIONS
    from mlxspec.bench.workloads import CHAT_WORKLOADS, WORKLOADS
    from mlxspec.proposers import MODES

    command, _ = headline()
    params = parse_mlxspec(command)
    for mode in params["modes"].split(","):
        base, _, variant = mode.partition(":")
        assert base in MODES + ("mlx_lm", "mlx_lm_spec"), mode
        assert not variant or (variant == "tree" and base in TREE_OPTIONS), mode
    for workload in params["workloads"].split(","):
        assert workload in WORKLOADS + CHAT_WORKLOADS, workload


def test_readme_headline_table_is_its_commands_one_run():
    """Every figure of the headline table is in the bench.json that its command wrote."""
    import json

    command, rows = headline()
    params = parse_mlxspec(command)
    run = json.loads((README.parent / params["out_dir"] / "bench.json").read_text())
    assert run["model"] == params["model"]
    assert run["prompts_per_workload"] == params["n_prompts"]
    assert run["max_tokens"] == params["max_tokens"]
    workloads = params["workloads"].split(",")
    modes = params["modes"].split(",")
    results = {key.split("@")[0]: value["modes"] for key, value in run["results"].items()}
    assert sorted(results) == sorted(workloads)
    assert all(sorted(results[w]) == sorted(modes) for w in workloads)

    header, body = rows[0], rows[2:]
    assert len(body) == len(workloads)
    columns = {i: re.findall(r"`([^`]+)`", cell) for i, cell in enumerate(header)}
    for workload, row in zip(workloads, body):  # the table keeps the command's order
        figures = results[workload]
        for i, cell in enumerate(row):
            names = columns[i]
            if not names or i == 0:
                continue
            if "tok/s" in header[i]:
                assert cell == f"{figures[names[0]]['tokens_per_s']:.1f}", (workload, header[i])
            elif "forward" in header[i]:
                want = " · ".join(f"{figures[n]['mean_accepted_length']:.2f}" for n in names)
                assert cell == want, (workload, header[i])
            else:
                want = f"{figures[names[0]]['speedup_median']:.2f}×"
                assert cell.strip("*") == want, (workload, header[i], cell, want)
