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
# Issue 19 point 3 (mlxspec.load / set_mode("draft") loading the bundled draft, the engine's
# side) is what this example needs; adjust here if the README example changes with it.
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
