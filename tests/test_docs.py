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
