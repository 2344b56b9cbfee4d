"""Corpus formats: plain source, fill-in-the-middle, chat and edit examples.

Every example is a plain string ending in `<|endoftext|>`; the documents are shuffled by the
seed, concatenated and cut into training rows. The formats are the ones the runtime prompts with:

- FIM, Qwen2.5-Coder prefix-suffix-middle order:
  `<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>{middle}<|endoftext|>`
- chat (ChatML, the same text the tokenizer's chat template renders):
  `<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n`
- edit: a chat example whose user message is `{instruction}\n\n{function source}` and whose
  answer is the whole edited function (no code fences).
"""

from __future__ import annotations

import ast
import io
import keyword
import random
import re
import tokenize
from pathlib import Path

from .heldout import extract_functions, read_source

EOT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
FIM_PREFIX = "<|fim_prefix|>"
FIM_SUFFIX = "<|fim_suffix|>"
FIM_MIDDLE = "<|fim_middle|>"
SPECIAL_TOKENS = [EOT, IM_START, IM_END, FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def format_chat(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """Render ChatML exactly as CHAT_TEMPLATE does."""
    out = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    if add_generation_prompt:
        out += f"{IM_START}assistant\n"
    return out


def format_fim(prefix: str, suffix: str, middle: str | None = None) -> str:
    """A FIM prompt (middle=None) or a full training example."""
    s = f"{FIM_PREFIX}{prefix}{FIM_SUFFIX}{suffix}{FIM_MIDDLE}"
    return s if middle is None else s + middle + EOT


# ---------------------------------------------------------------- FIM


def make_fim_example(text: str, rng: random.Random, window: int = 2048) -> str | None:
    """Cut a window of whole lines from `text` and a middle span from it (1-8 whole lines, or the
    rest of one line from a random column)."""
    lines = text.splitlines(keepends=True)
    if len(lines) < 3:
        return None
    start = rng.randrange(len(lines))
    end = start
    size = 0
    while end < len(lines) and size + len(lines[end]) <= window:
        size += len(lines[end])
        end += 1
    if end - start < 3:
        return None
    chunk = lines[start:end]
    i = rng.randrange(len(chunk))
    if rng.random() < 0.5:
        j = min(len(chunk), i + rng.randint(1, 8))
        prefix = "".join(chunk[:i])
        middle = "".join(chunk[i:j])
        suffix = "".join(chunk[j:])
    else:
        line = chunk[i]
        col = rng.randrange(len(line))
        prefix = "".join(chunk[:i]) + line[:col]
        middle = line[col:]
        suffix = "".join(chunk[i + 1 :])
    if not middle.strip():
        return None
    return format_fim(prefix, suffix, middle)


# ---------------------------------------------------------------- chat

_WHAT = (
    "What does `{q}` do?",
    "Explain what the function `{q}` does.",
    "What is `{name}` in the `{mod}` module for?",
    "Describe `{q}`.",
)
_SHOW = (
    "Show me the source of `{q}`.",
    "Show the implementation of `{name}` from `{mod}`.",
    "How is `{q}` implemented?",
    "Write out the code of `{q}`.",
)


def make_chat_example(mod: str, name: str, src: str, rng: random.Random) -> str | None:
    """A question about a function and the answer: its docstring, or its source."""
    q = f"{mod}.{name}"
    fields = {"q": q, "name": name, "mod": mod}
    doc = _docstring(src)
    if doc and rng.random() < 0.75:
        question = rng.choice(_WHAT).format(**fields)
        answer = doc
    else:
        question = rng.choice(_SHOW).format(**fields)
        answer = src.rstrip("\n")
    msgs = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return format_chat(msgs) + EOT


def function_node(src: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The function `src` defines (its first statement), or None."""
    try:
        node = ast.parse(src).body[0]
    except (SyntaxError, ValueError, IndexError):
        return None
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def _docstring(src: str) -> str | None:
    node = function_node(src)
    if node is None:
        return None
    doc = ast.get_docstring(node)
    return doc.strip() if doc and doc.strip() else None


# ---------------------------------------------------------------- edits


def edit_messages(func_source: str, instruction: str) -> list[dict]:
    """The chat messages of an edit request, exactly as the edit examples were trained."""
    return [{"role": "user", "content": f"{instruction}\n\n{func_source.rstrip(chr(10))}"}]


def make_edit_example(func_source: str, rng: random.Random) -> tuple[str, str]:
    """A mechanical edit of `func_source`: (instruction, whole edited function).

    Kinds: rename an identifier, change a number literal, delete a line, add a line, add or
    remove the docstring. The edited function ends with a single newline.
    """
    src = func_source.rstrip("\n") + "\n"
    kinds = [_edit_rename, _edit_literal, _edit_delete_line, _edit_add_line, _edit_docstring]
    rng.shuffle(kinds)
    for kind in kinds:
        out = kind(src, rng)
        if out is not None and out[1] != src:
            return out
    # Always possible: append a comment line at the end.
    return "Add the comment `# end` as the last line.", src + "# end\n"


def make_edit_chat_example(func_source: str, rng: random.Random) -> str:
    instruction, edited = make_edit_example(func_source, rng)
    msgs = edit_messages(func_source, instruction)
    msgs.append({"role": "assistant", "content": edited.rstrip("\n")})
    return format_chat(msgs) + EOT


def _name_tokens(src: str):
    try:
        return [t for t in tokenize.generate_tokens(io.StringIO(src).readline)]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return None


def _replace_tokens(src: str, toks, new: str) -> str:
    lines = src.splitlines(keepends=True)
    for t in sorted(toks, key=lambda t: t.start, reverse=True):
        (r, c0), (_, c1) = t.start, t.end
        line = lines[r - 1]
        lines[r - 1] = line[:c0] + new + line[c1:]
    return "".join(lines)


_SUFFIXES = ("_value", "_tmp", "_new", "_x", "2", "_item", "_obj", "_data")


def _edit_rename(src, rng):
    try:
        node = ast.parse(src).body[0]
    except (SyntaxError, ValueError, IndexError):
        return None
    names = sorted(
        {
            n.id
            for n in ast.walk(node)
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
        }
        | {a.arg for a in ast.walk(node) if isinstance(a, ast.arg) and a.arg not in ("self", "cls")}
    )
    toks = _name_tokens(src)
    if not names or toks is None:
        return None
    old = rng.choice(names)
    if rng.random() < 0.5 and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        old = node.name if not node.name.startswith("__") else old
    new = old + rng.choice(_SUFFIXES)
    if keyword.iskeyword(new) or re.search(rf"\b{re.escape(new)}\b", src):
        return None
    hits = [t for t in toks if t.type == tokenize.NAME and t.string == old]
    if not hits:
        return None
    return f"Rename `{old}` to `{new}`.", _replace_tokens(src, hits, new)


def _edit_literal(src, rng):
    toks = _name_tokens(src)
    if toks is None:
        return None
    nums = [t for t in toks if t.type == tokenize.NUMBER and re.fullmatch(r"\d+", t.string)]
    if not nums:
        return None
    old = rng.choice(nums).string
    new = str(int(old) + rng.choice((1, 2, 10)))
    hits = [t for t in nums if t.string == old]
    where = "every" if len(hits) > 1 else "the"
    return f"Change {where} literal `{old}` to `{new}`.", _replace_tokens(src, hits, new)


def _edit_delete_line(src, rng):
    lines = src.splitlines(keepends=True)
    cands = []
    for i in range(1, len(lines)):
        s = lines[i].strip()
        if not s or s.endswith((":", "(", "[", "{", ",", "\\")) or s in ('"""', "'''"):
            continue
        ind = len(lines[i]) - len(lines[i].lstrip())
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if nxt.strip() and len(nxt) - len(nxt.lstrip()) > ind:
            continue
        if sum(1 for ln in lines if ln.strip() == s) != 1:
            continue
        cands.append(i)
    if not cands:
        return None
    i = rng.choice(cands)
    return f"Delete the line `{lines[i].strip()}`.", "".join(lines[:i] + lines[i + 1 :])


def _body_start(src):
    """(line index where the body starts after any docstring, body indent) or None."""
    try:
        node = ast.parse(src).body[0]
    except (SyntaxError, ValueError, IndexError):
        return None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
        return None
    first = node.body[0]
    lines = src.splitlines(keepends=True)
    indent = lines[first.lineno - 1][: first.col_offset]
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        return first.end_lineno, indent, node, first
    return first.lineno - 1, indent, node, None


def _edit_add_line(src, rng):
    bs = _body_start(src)
    if bs is None:
        return None
    at, indent, node, _ = bs
    if indent.strip():
        return None
    args = [a.arg for a in node.args.args if a.arg not in ("self", "cls")]
    stmts = [f'print("{node.name} called")', f"# TODO: review {node.name}"]
    if args:
        a = rng.choice(args)
        stmts += [f"assert {a} is not None", f"print({a!r}, {a})"]
    stmt = rng.choice(stmts)
    lines = src.splitlines(keepends=True)
    new = lines[:at] + [indent + stmt + "\n"] + lines[at:]
    return f"Add the line `{stmt}` at the start of the function body.", "".join(new)


def _edit_docstring(src, rng):
    bs = _body_start(src)
    if bs is None:
        return None
    at, indent, node, doc = bs
    lines = src.splitlines(keepends=True)
    if doc is not None:
        new = lines[: doc.lineno - 1] + lines[doc.end_lineno :]
        # A function whose body was only the docstring needs a statement.
        if len(node.body) == 1:
            new.insert(doc.lineno - 1, indent + "pass\n")
        return "Remove the docstring.", "".join(new)
    words = re.sub(r"(?<!^)(?=[A-Z])", "_", node.name).strip("_").replace("_", " ").lower()
    text = rng.choice((f"Handle {words}.", f"Return the {words}.", f"Implement {words}."))
    return (
        f'Add the docstring """{text}""" to the function.',
        "".join(lines[:at] + [f'{indent}"""{text}"""\n'] + lines[at:]),
    )


# ---------------------------------------------------------------- the corpus


def build_documents(files: list[Path], root: Path | None, seed: int) -> tuple[list[str], dict]:
    """All training documents from `files`, in a seed-determined shuffled order, and counts."""
    rng = random.Random(seed)
    docs: list[str] = []
    counts = {"source": 0, "fim": 0, "chat": 0, "edit": 0, "bytes_source": 0}
    for p in files:
        text = read_source(p)
        if not text or not text.strip():
            continue
        if root is not None:
            try:
                mod = ".".join(Path(p).relative_to(root).with_suffix("").parts)
            except ValueError:
                mod = Path(p).stem
        else:
            mod = Path(p).stem
        if mod.endswith(".__init__"):
            mod = mod[: -len(".__init__")]
        docs.append(text + EOT)
        counts["source"] += 1
        counts["bytes_source"] += len(text.encode("utf-8"))
        for _ in range(min(8, 1 + len(text) // 8000)):
            ex = make_fim_example(text, rng)
            if ex:
                docs.append(ex)
                counts["fim"] += 1
        for name, fsrc in extract_functions(text):
            nl = fsrc.count("\n")
            if nl > 60:
                continue
            r = rng.random()
            if r < 0.25 and (_docstring(fsrc) or nl <= 40):
                ex = make_chat_example(mod, name, fsrc, rng)
                if ex:
                    docs.append(ex)
                    counts["chat"] += 1
            elif r < 0.35 and 3 <= nl <= 40:
                docs.append(make_edit_chat_example(fsrc, rng))
                counts["edit"] += 1
    rng.shuffle(docs)
    return docs, counts
