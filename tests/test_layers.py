"""Who imports whom in the decode loop (docs/HOW_IT_WORKS.md, "Architecture"): no import circle
among the loop's modules, and no arrow from the engine to loading. Imports for type hints only
(`if TYPE_CHECKING:`) do not count; imports inside functions do."""

import ast
from pathlib import Path

import mlxspec

PACKAGE = Path(mlxspec.__file__).parent
LOOP = ["engine", "batch_step", "admission", "row", "request", "prefill", "step", "policy",
        "cost", "choose_k", "planning", "policy_store", "target", "loading"]


def imports(module: str, hints: bool = False) -> set[str]:
    """The mlxspec modules `module` imports at run time (first name under the package);
    `hints`: for type hints too."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    found: set[str] = set()

    def visit(node):
        if (not hints and isinstance(node, ast.If)
                and getattr(node.test, "id", "") == "TYPE_CHECKING"):
            return  # (type hints only)
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(a.name for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def test_the_loop_has_no_import_circle_and_the_engine_does_not_import_loading():
    graph = {m: imports(m) & set(LOOP) for m in LOOP}
    assert "loading" not in graph["engine"]
    assert "engine" in graph["loading"] and "batch_step" in graph["engine"]  # (the check sees)

    def reaches(start: str, goal: str, seen: set) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n}))
                   for n in graph[start])

    circles = [m for m in LOOP if reaches(m, m, {m})]
    assert not circles, {m: sorted(graph[m]) for m in circles}


def test_nothing_below_the_engine_imports_it_even_for_type_hints():
    below = [m for m in LOOP if m not in ("engine", "loading")]
    assert "admission" in imports("batch_step", hints=True)  # (the check sees)
    assert not [m for m in below if "engine" in imports(m, hints=True)]
