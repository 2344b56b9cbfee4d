"""The README and the docs/ pages it links: links resolve, commands keep their first place."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(md: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    in_code = False
    for line in md.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        title = line.lstrip("#").strip().lower()
        slug = re.sub(r"[^\w\- ]", "", title).replace(" ", "-")
        out.add(slug)
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    text = page.read_text()
    for target in LINK.findall(text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.name}: broken link {target}"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest.read_text()), f"{page.name}: no heading for {target}"


def test_anchor_slugs_follow_github():
    assert _anchors("# The policy: adaptive k and `auto`\n## Which model a `-m` means\n") == {
        "the-policy-adaptive-k-and-auto", "which-model-a--m-means"}


def test_readme_starts_with_the_three_setup_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    first_block = lines[lines.index("```bash") + 1:lines.index("```")]
    assert [line.split()[0:2] for line in first_block] == [
        ["pip", "install"], ["mlxspec", "generate"], ["python", "-m"]]


def test_readme_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    for page in (ROOT / "docs").glob("*.md"):
        assert f"docs/{page.name}" in readme, f"README does not link docs/{page.name}"


# The manual keeps its shape: a short README, a reference PERFORMANCE.md whose every table has
# the command that produced it right above it, and commands that still run.

HISTORY = re.compile(r"session \d|issue \d|#\d{2}\b|\b[Ii]ssue \d|work round", re.I)
COMMIT = re.compile(r"\b[0-9a-f]{7}\b")


def _tables_without_command(md: str) -> list[int]:
    """Line numbers of tables whose nearest non-blank line above is not a code block's end."""
    lines, missing, in_table, in_code = md.splitlines(), [], False, False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            in_code = not in_code
        starts = line.startswith("|") and not in_table and not in_code
        if starts:
            above = next((x for x in reversed(lines[:i]) if x.strip()), "")
            if above != "```":
                missing.append(i + 1)
        in_table = line.startswith("|")
    return missing


def test_readme_is_a_first_screen():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 120
    assert not HISTORY.search(text), HISTORY.search(text)
    assert not COMMIT.search(text), COMMIT.search(text)


def test_performance_is_a_reference():
    text = (ROOT / "docs" / "PERFORMANCE.md").read_text()
    assert len(text.splitlines()) <= 700
    assert not HISTORY.search(text), HISTORY.search(text)
    assert len(set(COMMIT.findall(text))) <= 3, COMMIT.findall(text)
    assert _tables_without_command(text) == []


def test_table_check_sees_a_table_without_command():
    assert _tables_without_command("```bash\ncmd\n```\n\n| a |\n|---|\n\ntext\n\n| b |\n") == [10]


def _bench_script_commands(md: str) -> list[tuple[str, list[str], str]]:
    """(script, its options, its section's text up to its code block) for each
    `python bench/X.py`."""
    out = []
    for match in re.finditer(r"^```bash\n(.*?)^```", md, re.S | re.M):
        before = md[md.rfind("\n## ", 0, match.start()) + 1:match.start()]
        for script, rest in re.findall(r"python (bench/\w+\.py)([^;#\n]*)", match.group(1)):
            out.append((script, re.findall(r"(?<!\S)(--[\w-]+)", rest), before))
    return out


def test_performance_bench_commands_exist_with_their_options():
    """A script in bench/ lists every option its command uses in --help; a script no longer
    there is named with the checkout that holds it."""
    import subprocess
    import sys

    helps: dict[str, str] = {}
    for script, opts, before in _bench_script_commands((ROOT / "docs" / "PERFORMANCE.md").read_text()):
        if not (ROOT / script).exists():
            assert COMMIT.search(before), f"{script} is not in bench/ and no checkout is named"
            continue
        if script not in helps:
            helps[script] = subprocess.run([sys.executable, script, "--help"], cwd=ROOT,
                                           capture_output=True, text=True, timeout=120,
                                           check=True).stdout
        for opt in opts:
            assert opt in helps[script], f"`{script} --help` does not list {opt}"


def test_performance_mlxspec_commands_parse():
    from mlxspec.cli.main import main

    text = (ROOT / "docs" / "PERFORMANCE.md").read_text()
    import shlex

    for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
        for line in block.splitlines():
            if line.startswith("mlxspec "):
                argv = shlex.split(line.split("  #", 1)[0])
                command = main.get_command(None, argv[1])
                assert command is not None, line
                with command.make_context(argv[1], argv[2:]):
                    pass
