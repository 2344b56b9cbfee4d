"""The corpus split: which standard-library files train the bundled models and which are held out.

The held-out modules never enter training (not as plain source, FIM, chat or edit examples).
Tests and benchmarks draw their prompts from them, and the model card's bits-per-byte figures
are measured on them.
"""

from __future__ import annotations

import ast
import functools
import sysconfig
from pathlib import Path

# Standard-library modules held out of training: varied size and style (parsers, numerics, text
# processing, data formats, small utilities). A name is a module file `NAME.py` or a package
# directory `NAME/`, relative to the stdlib root.
HELDOUT_MODULES: tuple[str, ...] = (
    "argparse",
    "bisect",
    "calendar",
    "colorsys",
    "csv",
    "difflib",
    "fnmatch",
    "fractions",
    "getopt",
    "graphlib",
    "heapq",
    "ipaddress",
    "json",
    "netrc",
    "pprint",
    "queue",
    "sched",
    "shlex",
    "statistics",
    "string",
    "textwrap",
    "uuid",
    "wave",
    "zipapp",
)

# Directory names never used (test suites, third-party packages, byte code, GUI test suites).
EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)
# Top-level stdlib entries skipped: mostly generated tables or data, not code.
EXCLUDED_TOP = frozenset({"encodings", "pydoc_data", "ensurepip", "lib2to3", "turtledemo"})
MAX_FILE_BYTES = 400_000

# The fixed evaluation subsets (bytes of held-out source, in held-out order, cut at a line end).
EVAL_BYTES = 256_000
TEST_EVAL_BYTES = 48_000


def stdlib_dir() -> Path:
    """The standard library of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def _module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root)
    return rel.parts[0][:-3] if len(rel.parts) == 1 else rel.parts[0]


def _is_excluded(path: Path, root: Path) -> bool:
    rel = path.relative_to(root)
    if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]):
        return True
    if rel.parts[0] in EXCLUDED_TOP or rel.parts[0].startswith("config-"):
        return True
    if rel.name.startswith("_sysconfigdata"):
        return True
    return False


def corpus_files(root: Path) -> list[Path]:
    """All usable `.py` files under `root`, in a fixed (sorted) order."""
    return list(_corpus_files(Path(root)))


@functools.lru_cache(maxsize=4)  # a walk of the standard library: ~1 s, asked for often
def _corpus_files(root: Path) -> tuple[Path, ...]:
    out = []
    for p in sorted(root.rglob("*.py")):
        if not p.is_file() or _is_excluded(p, root):
            continue
        try:
            size = p.stat().st_size
        except OSError:
            continue
        if 0 < size <= MAX_FILE_BYTES:
            out.append(p)
    return tuple(out)


def is_heldout(path: Path, root: Path | None = None) -> bool:
    root = Path(root) if root is not None else stdlib_dir()
    try:
        return _module_name(Path(path), root) in HELDOUT_MODULES
    except ValueError:
        return False


def heldout_files(root: Path | None = None) -> list[Path]:
    """The held-out standard-library files (evaluation set), sorted."""
    root = Path(root) if root is not None else stdlib_dir()
    return [p for p in corpus_files(root) if _module_name(p, root) in HELDOUT_MODULES]


def training_files(root: Path | None = None) -> list[Path]:
    """The standard-library files the bundled models train on, sorted (held-out ones excluded)."""
    root = Path(root) if root is not None else stdlib_dir()
    return [p for p in corpus_files(root) if _module_name(p, root) not in HELDOUT_MODULES]


def read_source(path: Path) -> str | None:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def heldout_eval_texts(max_bytes: int = EVAL_BYTES, root: Path | None = None) -> list[str]:
    """The fixed held-out evaluation subset: whole files in held-out order, the last one cut at a
    line end so the total is at most `max_bytes` UTF-8 bytes."""
    texts, total = [], 0
    for p in heldout_files(root):
        text = read_source(p)
        if not text:
            continue
        b = text.encode("utf-8")
        if total + len(b) > max_bytes:
            cut = b[: max_bytes - total]
            nl = cut.rfind(b"\n")
            if nl > 0:
                texts.append(cut[: nl + 1].decode("utf-8", errors="ignore"))
            break
        texts.append(text)
        total += len(b)
    return texts


def extract_functions(source: str) -> list[tuple[str, str]]:
    """(qualified name, source) of every function and method in `source` (decorators excluded)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines(keepends=True)
    out = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                seg = "".join(lines[child.lineno - 1 : child.end_lineno])
                out.append((prefix + child.name, _dedent(seg)))
                visit(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")

    visit(tree, "")
    return out


def _dedent(seg: str) -> str:
    import textwrap

    return textwrap.dedent(seg)


def heldout_functions(
    n: int | None = None, min_lines: int = 4, max_lines: int = 60, root: Path | None = None
) -> list[tuple[str, str, str]]:
    """Up to `n` held-out functions as (module, qualified name, source), in a fixed order that
    interleaves modules (so the first few come from different modules)."""
    root = Path(root) if root is not None else stdlib_dir()
    found = _heldout_functions(root, min_lines, max_lines)
    return list(found if n is None else found[:n])


@functools.lru_cache(maxsize=8)  # every held-out module parsed: ~1 s
def _heldout_functions(root: Path, min_lines: int, max_lines: int
                       ) -> tuple[tuple[str, str, str], ...]:
    per_module: dict[str, list[tuple[str, str, str]]] = {}
    for p in heldout_files(root):
        text = read_source(p)
        if not text:
            continue
        mod = ".".join(p.relative_to(root).with_suffix("").parts)
        for name, src in extract_functions(text):
            nl = src.count("\n")
            if min_lines <= nl <= max_lines and not name.split(".")[-1].startswith("__"):
                per_module.setdefault(mod, []).append((mod, name, src))
    out: list[tuple[str, str, str]] = []
    queues = [per_module[m] for m in sorted(per_module)]
    i = 0
    while any(i < len(q) for q in queues):
        for q in queues:
            if i < len(q):
                out.append(q[i])
        i += 1
    return tuple(out)
