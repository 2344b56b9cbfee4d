"""Benchmark workloads, drawn from the bundled model's held-out standard-library modules
(never from training files).

Two sets, chosen by the model's tokenizer (`uses_bundled_formats`):

- the bundled formats (`WORKLOADS`): the bundled model and any model `mlxspec train` writes,
  whose tokenizer holds the bundled FIM tokens and whose chat template renders exactly as
  `recipe.corpus.format_chat` does. Prompts are written in those formats directly.
- chat-template workloads (`CHAT_WORKLOADS`) for every other model (e.g. SmolLM2-Instruct):
  prompts go through the model's own chat template (`chat_session.render_chat`), the tasks are
  ones a real instruction model performs (copy a file with comments added, rewrite, quote),
  `completion` is plain code, and `fim` exists only when the tokenizer has the FIM tokens:
  there it is what an editor sends (`third_party_fim`), a cursor in a real source file of an
  installed third-party package, with another file of that package as repo-level context.
"""

from __future__ import annotations

import ast
import random
import textwrap
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from ..errors import MlxspecError
from ..recipe.corpus import (
    FIM_MIDDLE,
    FIM_PREFIX,
    FIM_SUFFIX,
    edit_messages,
    format_chat,
    format_fim,
    make_edit_example,
)
from ..recipe.heldout import heldout_files, heldout_functions, read_source

WORKLOADS = ("completion", "fim", "edit", "doc-qa", "chat", "free")
CHAT_WORKLOADS = ("edit", "rewrite", "quote", "chat", "free", "completion")
# Without --max-tokens: long enough for a real model to copy most of a 40-80 line file.
CHAT_MAX_TOKENS = {"edit": 256, "rewrite": 256, "quote": 128, "chat": 128, "free": 128,
                   "completion": 64, "fim": 64, "agent": 256}
# Run only when named (not in a model's default set nor in 'mixed'): recorded agent sessions,
# `agent_items`.
EXTRA_WORKLOADS = ("agent",)
AGENT_SESSIONS = Path(__file__).resolve().parent / "agent_sessions"
TURN_KINDS = ("tool_call", "edit", "answer")
DEFAULT_MAX_TOKENS = 64
FIM_TOKENS = (FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE)
EDIT_INSTRUCTION = "Add a comment above each function. Return the whole file."
REWRITE_INSTRUCTION = "Rewrite this code with the same names, and return all of it."
QUOTE_INSTRUCTION = ("Quote the lines that define functions, exactly as they appear in the "
                     "document, one per line.")
CHAT_QUESTION = "What does this function do, and when would I use it? Answer in a few sentences."
FREE_QUESTIONS = (
    "What makes a good name for a variable?",
    "Write a short poem about debugging.",
    "Why do programmers write tests?",
    "Describe your ideal workspace.",
    "What should a beginner learn first about computers?",
    "Tell me a short story about a lighthouse keeper.",
    "What are the pros and cons of working from home?",
    "Explain recursion to a child.",
)


@dataclass
class Item:
    workload: str
    prompt: str
    max_tokens: int
    temperature: float = 0.0
    prediction: str | None = None
    meta: dict = field(default_factory=dict)
    tokens: list[int] | None = None  # the prompt's ids where set (else the engine encodes it)
    grammar: tuple | None = None  # (kind, text): the answer held to it (`Engine.request`)


def _completion(n: int, rng: random.Random, max_tokens: int) -> list[Item]:
    items = []
    texts = [t for t in (read_source(p) for p in heldout_files()) if t and t.count("\n") > 40]
    for i in range(n):
        lines = texts[i % len(texts)].splitlines(keepends=True)
        cut = rng.randint(20, min(len(lines) - 10, 60))
        start = max(0, cut - 40)
        items.append(Item("completion", "".join(lines[start:cut]), max_tokens))
    return items


def _fim(functions, rng, max_tokens) -> list[Item]:
    items = []
    for _, _, src in functions:
        lines = src.splitlines(keepends=True)
        a = rng.randint(1, max(1, len(lines) - 3))
        b = min(len(lines), a + rng.randint(1, 4))
        prompt = format_fim("".join(lines[:a]), "".join(lines[b:]))
        items.append(Item("fim", prompt, max_tokens, meta={"middle": "".join(lines[a:b])}))
    return items


def _edit(functions, rng, max_tokens) -> list[Item]:
    items = []
    for _, _, src in functions:
        instruction, edited = make_edit_example(src, rng)
        prompt = format_chat(edit_messages(src, instruction), add_generation_prompt=True)
        items.append(Item("edit", prompt, max_tokens, prediction=src.rstrip("\n"),
                          meta={"expected": edited}))
    return items


def _doc_qa(functions, rng, max_tokens) -> list[Item]:
    items = []
    for mod, name, src in functions:
        question = f"{src.rstrip()}\n\nShow me the source of `{mod}.{name}`."
        prompt = format_chat([{"role": "user", "content": question}], add_generation_prompt=True)
        items.append(Item("doc-qa", prompt, max_tokens))
    return items


def _chat(functions, rng, max_tokens) -> list[Item]:
    return [Item("chat", format_chat([{"role": "user", "content": f"What does `{mod}.{name}` do?"}],
                                     add_generation_prompt=True), max_tokens)
            for mod, name, _ in functions]


def _free(n, rng, max_tokens) -> list[Item]:
    starts = ["def ", "import ", "class ", "# ", "for ", "if __name__", "return ", "@"]
    return [Item("free", starts[i % len(starts)], max_tokens, temperature=1.0) for i in range(n)]


REPO_TOKENS = ("<|repo_name|>", "<|file_sep|>")  # Qwen2.5-Coder's repository-level format


def third_party_files(min_lines: int = 120) -> list[tuple[str, list]]:
    """Installed third-party packages (site-packages; not mlxspec, nor MLX which it builds on)
    with their Python files of at least `min_lines` lines, sorted: sources nobody here wrote."""
    import sysconfig
    from pathlib import Path

    root = Path(sysconfig.get_paths()["purelib"])
    skip = {"mlxspec", "mlx", "mlx_lm", "pip", "setuptools", "_distutils_hack"}
    found = []
    for pkg in sorted(p for p in root.iterdir() if (p / "__init__.py").is_file()):
        if pkg.name in skip or pkg.name.startswith("_"):
            continue
        files = []
        for f in sorted(pkg.glob("*.py")):
            try:
                text = f.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if text.count("\n") >= min_lines:
                files.append((f"{pkg.name}/{f.name}", text))
        if len(files) >= 2:
            found.append((pkg.name, files))
    return found


def _statement_lines(text: str) -> set[int]:
    """0-based lines where a statement of a function body starts (not a docstring)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return set()
    out = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if (isinstance(node, ast.stmt) and node is not fn and not (
                        isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))):
                    out.add(node.lineno - 1)
    return out


def third_party_fim(n: int, rng: random.Random, max_tokens: int, repo_level: bool,
                    prefix_lines: int = 40, suffix_lines: int = 20) -> list[Item]:
    """`n` editor requests: a cursor at the start of a line's code inside a function body of a
    third-party file, the 40 lines before and 20 after it around the FIM tokens; with
    `repo_level`, another file of the package first (Qwen2.5-Coder's `<|repo_name|>` /
    `<|file_sep|>` format, as llama.vim's `input_extra` chunks become)."""
    packages = third_party_files()
    if not packages:
        raise MlxspecError("the fim workload needs installed third-party Python packages")
    rng.shuffle(packages)
    items = []
    for i in range(n):
        name, files = packages[i % len(packages)]
        (path, text), (other_path, other) = rng.sample(files, 2)
        lines = text.splitlines(keepends=True)
        body = sorted(_statement_lines(text) & set(range(prefix_lines,
                                                             len(lines) - suffix_lines)))
        j = rng.choice(body) if body else len(lines) // 2
        indent = len(lines[j]) - len(lines[j].lstrip())
        prefix = "".join(lines[j - prefix_lines : j]) + lines[j][:indent]
        suffix = "".join(lines[j + 1 : j + 1 + suffix_lines])
        middle = lines[j][indent:]
        fim = f"{FIM_PREFIX}{prefix}{FIM_SUFFIX}{suffix}{FIM_MIDDLE}"
        if repo_level:
            context = "".join(other.splitlines(keepends=True)[:60])
            fim = (f"{REPO_TOKENS[0]}{name}\n{REPO_TOKENS[1]}{other_path}\n{context}"
                   f"{REPO_TOKENS[1]}{path}\n{fim}")
        items.append(Item("fim", fim, max_tokens, meta={"middle": middle, "file": path,
                                                         "line": j + 1}))
    return items


def _has_fim_tokens(tokenizer) -> bool:
    vocab = tokenizer.get_vocab()
    return all(t in vocab for t in FIM_TOKENS)


def _has_chat_template(tokenizer) -> bool:
    return getattr(tokenizer, "chat_template", None) is not None


def uses_bundled_formats(tokenizer) -> bool:
    """The rule: a tokenizer (None: the bundled model's) gets the bundled workloads when it has
    the bundled FIM tokens and its chat template renders a conversation exactly as
    `format_chat` does; any other gets the chat-template workloads."""
    if tokenizer is None:
        return True
    if not _has_fim_tokens(tokenizer) or not _has_chat_template(tokenizer):
        return False
    from ..chat_session import render_chat

    probe = [{"role": "user", "content": "probe"}]
    try:
        return render_chat(tokenizer, probe) == format_chat(probe, add_generation_prompt=True)
    except Exception:  # a template that fails on the probe is not the bundled one
        return False


def workloads_for(tokenizer) -> tuple[str, ...]:
    """The workloads a model with this tokenizer can run."""
    if uses_bundled_formats(tokenizer):
        return WORKLOADS
    names = CHAT_WORKLOADS if _has_chat_template(tokenizer) else ("completion",)
    return names + ("fim",) if _has_fim_tokens(tokenizer) else names


def workload_kind(tokenizer) -> str:
    """Which prompt formats the workloads of this tokenizer use, in words."""
    if uses_bundled_formats(tokenizer):
        return "the bundled formats"
    return "the model's chat template" if _has_chat_template(tokenizer) else "no chat template"


def check_workloads(names: list[str], tokenizer, model_name: str) -> None:
    """Refuse, before anything runs, a workload this model cannot run, naming the ones it can."""
    have = workloads_for(tokenizer)
    for w in names:
        if w in have or w == "mixed" or (w in EXTRA_WORKLOADS and _has_chat_template(tokenizer)):
            continue
        if w in EXTRA_WORKLOADS:
            why = f"{w} needs a model with a chat template; {model_name} has none"
        elif w == "fim":
            why = f"fim needs a model with FIM tokens ({', '.join(FIM_TOKENS)}); {model_name} has none"
        elif w in CHAT_WORKLOADS and not _has_chat_template(tokenizer):
            why = f"{w} needs a model with a chat template; {model_name} has none"
        elif w in CHAT_WORKLOADS + WORKLOADS:
            why = (f"{w} is not a workload of {model_name} "
                   f"({'bundled formats' if have is WORKLOADS else 'its own chat template'})")
        else:
            why = f"unknown workload {w!r}"
        raise MlxspecError(f"{why}; it has: {', '.join(have)}, mixed")


def build_workload(name: str, n: int = 20, max_tokens: int | None = DEFAULT_MAX_TOKENS,
                   seed: int = 0, tokenizer=None) -> list[Item]:
    """`n` prompts of workload `name` (or 'mixed': every workload, shuffled) for a model with
    `tokenizer` (None: the bundled model). `max_tokens` None: each workload's default."""
    if name == "agent":
        return agent_items(tokenizer, n, max_tokens)
    if not uses_bundled_formats(tokenizer):
        return build_chat_workload(name, n, max_tokens, seed, tokenizer)
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    rng = random.Random(seed)
    if name == "mixed":
        per = -(-n // len(WORKLOADS))  # ceil: at least n items before the cut
        items = [it for w in WORKLOADS for it in build_workload(w, per, max_tokens, seed)]
        rng.shuffle(items)
        return items[:n]
    functions = heldout_functions(n, max_lines=30)
    if name == "completion":
        return _completion(n, rng, max_tokens)
    if name == "fim":
        return _fim(functions, rng, max_tokens)
    if name == "edit":
        # An edit answers with the whole function: give it room to finish.
        return _edit(functions, rng, max(max_tokens, 256))
    if name == "doc-qa":
        return _doc_qa(functions, rng, max(max_tokens, 128))
    if name == "chat":
        return _chat(functions, rng, max_tokens)
    if name == "free":
        return _free(n, rng, max_tokens)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS + ('mixed',))}")


# ---------------------------------------------------------------- chat-template workloads


def _top_level_defs(body: list[ast.stmt]) -> list[list[ast.stmt]]:
    """Runs of consecutive function/class definitions among `body` and in every class body:
    the pieces a source window is cut from, so the window is valid Python once dedented."""
    runs, run = [], []
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            run.append(node)
            if isinstance(node, ast.ClassDef):
                runs += _top_level_defs(node.body)
        elif run:
            runs.append(run)
            run = []
    if run:
        runs.append(run)
    return runs


def _count_functions(nodes: list[ast.stmt]) -> int:
    return sum(isinstance(x, (ast.FunctionDef, ast.AsyncFunctionDef))
               for node in nodes for x in ast.walk(node))


@lru_cache(maxsize=4)
def source_windows(min_lines: int = 40, max_lines: int = 80) -> tuple[tuple[str, ...], ...]:
    """Per held-out module, every window of `min_lines`-`max_lines` whole lines made of
    consecutive definitions (at least two functions), dedented: real source files' worth."""
    per_file = []
    for path in heldout_files():
        text = read_source(path)
        try:
            tree = ast.parse(text or "")
        except SyntaxError:
            continue
        lines = text.splitlines(keepends=True)
        windows = []
        for run in _top_level_defs(tree.body):
            starts = [min([n.lineno] + [d.lineno for d in getattr(n, "decorator_list", [])])
                      for n in run]
            for i in range(len(run)):
                for j in range(i, len(run)):
                    size = run[j].end_lineno - starts[i] + 1
                    if size > max_lines:
                        break
                    if size >= min_lines and _count_functions(run[i : j + 1]) >= 2:
                        seg = "".join(lines[starts[i] - 1 : run[j].end_lineno])
                        windows.append(textwrap.dedent(seg))
                        break  # the shortest window from each start: fewer near-duplicates
        if windows:
            per_file.append(tuple(windows))
    return tuple(per_file)


def _documents(n: int, rng: random.Random) -> list[str]:
    """`n` source windows, each from a different module while they last, fixed by `rng`."""
    per_file = list(source_windows())
    rng.shuffle(per_file)
    return [rng.choice(per_file[i % len(per_file)]) for i in range(n)]


def _ask(tokenizer, content: str) -> str:
    from ..chat_session import render_chat

    return render_chat(tokenizer, [{"role": "user", "content": content}])


def _fenced(code: str) -> str:
    return f"```python\n{code.rstrip()}\n```"


def build_chat_workload(name: str, n: int, max_tokens: int | None, seed: int,
                        tokenizer) -> list[Item]:
    """`n` prompts of chat-template workload `name` ('mixed': all this tokenizer has,
    shuffled). `max_tokens` None: the workload's own default (CHAT_MAX_TOKENS)."""
    rng = random.Random(seed)
    if name == "mixed":
        names = [w for w in workloads_for(tokenizer)]
        per = -(-n // len(names))
        items = [it for w in names for it in build_chat_workload(w, per, max_tokens, seed,
                                                                 tokenizer)]
        rng.shuffle(items)
        return items[:n]
    if name not in workloads_for(tokenizer):
        check_workloads([name], tokenizer, "this model")
    cap = max_tokens if max_tokens is not None else CHAT_MAX_TOKENS[name]
    if name == "completion":
        return _completion(n, rng, cap)
    if name == "fim":
        vocab = tokenizer.get_vocab()
        return third_party_fim(n, rng, cap, repo_level=all(t in vocab for t in REPO_TOKENS))
    if name in ("edit", "rewrite", "quote"):
        instruction = {"edit": EDIT_INSTRUCTION, "rewrite": REWRITE_INSTRUCTION,
                       "quote": QUOTE_INSTRUCTION}[name]
        items = []
        for doc in _documents(n, rng):
            prompt = _ask(tokenizer, f"{_fenced(doc)}\n\n{instruction}")
            # An editor sends the file as the predicted output of an edit (what ngram uses).
            prediction = doc.rstrip("\n") if name == "edit" else None
            items.append(Item(name, prompt, cap, prediction=prediction, meta={"document": doc}))
        return items
    if name == "chat":
        return [Item("chat", _ask(tokenizer, f"{_fenced(src)}\n\n{CHAT_QUESTION}"), cap,
                     meta={"function": f"{mod}.{qual}"})
                for mod, qual, src in heldout_functions(n, max_lines=30)]
    if name == "free":
        questions = list(FREE_QUESTIONS)
        rng.shuffle(questions)
        return [Item("free", _ask(tokenizer, questions[i % len(questions)]), cap,
                     temperature=1.0) for i in range(n)]
    raise ValueError(f"unknown workload {name!r}")


# ---------------------------------------------------------------- recorded agent sessions


def agent_sessions(folder: Path | None = None) -> list[dict]:
    """The recorded sessions (`bench/record_agent.py`), by name: each a task, its source
    files' package and license, and its turns ({"request": the chat-completions body the agent
    client sent, "answer", "kind"})."""
    import json

    folder = AGENT_SESSIONS if folder is None else folder
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]


def agent_items(tokenizer, n: int | None = None, max_tokens: int | None = None,
                folder: Path | None = None) -> list[Item]:
    """The first `n` turns (None: all) of the recorded agent sessions, session by session in
    order (so that `suffix` has seen a session's earlier turns, as in a server): each request
    rendered by the server's own request parser (messages and tools through the chat template,
    and the grammar a `tool_choice` of "required" or a function holds the answer to, as
    `/v1/chat/completions` does), at T = 0 with `max_tokens` (None: 256), its turn kind (what
    the recorded answer was: `tool_call`, `edit`, `answer`) in `meta`."""
    from ..server.protocol import RequestParser, ServerConfig

    if tokenizer is None or not _has_chat_template(tokenizer):
        raise MlxspecError("the agent workload needs a model with a chat template")
    parser = RequestParser(tokenizer, ServerConfig("bench", set(), None, accept_any_model=True))
    cap = max_tokens if max_tokens is not None else CHAT_MAX_TOKENS["agent"]
    items = []
    for session in agent_sessions(folder):
        for j, turn in enumerate(session["turns"]):
            body = {k: v for k, v in turn["request"].items() if k != "max_completion_tokens"}
            req, = parser.requests("chat", {**body, "max_tokens": cap})
            items.append(Item("agent", parser.prompt_text(req.prompt), cap, tokens=req.prompt,
                              grammar=req.grammar,
                              meta={"kind": turn["kind"], "session": session["name"],
                                    "turn": j}))
    return items[:n] if n is not None else items
