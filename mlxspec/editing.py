"""`mlxspec edit`'s machinery, independent of the command line: read a source file safely, ask
the chat model for the edited text with the original as a predicted output, diff it, and
replace the file atomically.

Two answer formats:

- "plain", the format the bundled model was trained on (`mlxspec.recipe.edit_messages`): one
  user message `{instruction}\\n\\n{code}` answered by the whole edited code, no fences. Used
  for the bundled model and every model whose chat template renders exactly the recipe's ChatML
  (a pair from `mlxspec train --out`, models built like it).
- "fenced", for the other chat models (instruct models such as Qwen2.5-Coder-Instruct, which
  answer with prose around a fenced block): the request asks for the whole edited code in ONE
  fenced block tagged with the file's language; the code is taken from the block of the answer
  that best matches the original, and an answer without one, cut inside it, or (Python) that no
  longer parses is reported as a `problem` and never written.

The original code is handed to the engine as `prediction` (in the fenced format wrapped in the
fence lines the answer should have): the n-gram proposer drafts from it, so the unchanged lines
are accepted many tokens per target forward.
"""

from __future__ import annotations

import ast
import difflib
import os
import re
import shutil
import stat as stat_mod
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .errors import MlxspecError
from .stats import Stats

MAX_FILE_BYTES = 4_000_000  # read no further than this (the context check comes after)
BINARY_SNIFF_BYTES = 8192


# ----------------------------------------------------------------------------- reading


@dataclass
class SourceFile:
    path: Path  # the real path (symbolic links resolved): what gets replaced
    shown: str  # the path as the user gave it
    raw: bytes
    text: str  # decoded, with "\n" line ends
    newline: str  # "\n" or "\r\n": what the file uses
    bom: bool
    mtime_ns: int
    mode: int

    def encode(self, text: str) -> bytes:
        """`text` (with "\\n" line ends) in the file's own encoding conventions."""
        if self.newline != "\n":
            text = text.replace("\n", self.newline)
        return (b"\xef\xbb\xbf" if self.bom else b"") + text.encode("utf-8")

    def changed_on_disk(self) -> bool:
        try:
            return self.path.read_bytes() != self.raw
        except OSError:
            return True


def looks_binary(data: bytes) -> bool:
    head = data[:BINARY_SNIFF_BYTES]
    if b"\x00" in head:
        return True
    control = sum(1 for b in head if b < 32 and b not in (9, 10, 12, 13, 27))
    return bool(head) and control / len(head) > 0.1


def read_source(path: str | os.PathLike, max_bytes: int = MAX_FILE_BYTES) -> SourceFile:
    """Read a text file for editing; refuse what cannot be edited with a clear error."""
    shown = str(path)
    real = Path(os.path.realpath(path))
    if not real.exists():
        raise MlxspecError(f"{shown}: no such file")
    if not real.is_file():
        raise MlxspecError(f"{shown}: not a regular file")
    try:
        st = real.stat()
        if st.st_size > max_bytes:
            raise MlxspecError(f"{shown}: {st.st_size} bytes is too large to edit "
                               f"(at most {max_bytes}); select a part with --lines A:B")
        raw = real.read_bytes()
    except OSError as e:
        raise MlxspecError(f"{shown}: cannot read: {e.strerror or e}") from None
    if looks_binary(raw):
        raise MlxspecError(f"{shown}: looks like a binary file; only UTF-8 text can be edited")
    bom = raw.startswith(b"\xef\xbb\xbf")
    try:
        text = raw[3 if bom else 0:].decode("utf-8")
    except UnicodeDecodeError as e:
        raise MlxspecError(f"{shown}: not UTF-8 text (invalid byte at offset {e.start}); "
                           "only UTF-8 text can be edited") from None
    newline = "\r\n" if "\r\n" in text and text.count("\r\n") == text.count("\n") else "\n"
    if newline != "\n":
        text = text.replace("\r\n", "\n")
    return SourceFile(real, shown, raw, text, newline, bom, st.st_mtime_ns,
                      stat_mod.S_IMODE(st.st_mode))


def parse_lines(spec: str | None, num_lines: int) -> tuple[int, int]:
    """`A:B` (1-based, inclusive; `A:` and `:B` open-ended; `A` one line) -> [start, end)."""
    if spec is None:
        return 0, num_lines
    m = re.fullmatch(r"\s*(\d*)\s*(?:([:-])\s*(\d*))?\s*", spec)
    if not m or (not m.group(1) and not m.group(3)):
        raise MlxspecError(f"--lines {spec!r}: expected A:B, A: or :B (1-based, inclusive)")
    a = int(m.group(1)) if m.group(1) else 1
    b = int(m.group(3)) if m.group(3) else (num_lines if m.group(2) else a)
    if a < 1 or b < a:
        raise MlxspecError(f"--lines {spec}: need 1 <= A <= B")
    if a > num_lines:
        raise MlxspecError(f"--lines {spec}: the file has only {num_lines} lines")
    return a - 1, min(b, num_lines)


# ----------------------------------------------------------------------------- the prompt

_NAME = r"[`'\"]?([A-Za-z_][A-Za-z0-9_]*)[`'\"]?"
_KIND = r"(?:(?:the\s+)?(?:function|method|variable|argument|parameter|name|identifier|class|attribute)\s+)?"
_CANONICAL = [
    (re.compile(rf"rename\s+{_KIND}{_NAME}\s+(?:to|->|as|into)\s+{_NAME}\s*\.?", re.I),
     lambda m: f"Rename `{m.group(1)}` to `{m.group(2)}`."),
    (re.compile(r"(?:remove|delete|drop)\s+the\s+docstring\s*\.?", re.I),
     lambda m: "Remove the docstring."),
    (re.compile(r"(?:delete|remove)\s+the\s+line\s+`(.+)`\s*\.?", re.I),
     lambda m: f"Delete the line `{m.group(1).strip()}`."),
]


def canonical_instruction(instruction: str) -> str:
    """Common phrasings rewritten into the exact wording the bundled model's edit examples use
    ("rename foo to bar" -> "Rename `foo` to `bar`."); anything else unchanged."""
    text = " ".join(instruction.split())
    for pattern, build in _CANONICAL:
        m = pattern.fullmatch(text)
        if m:
            return build(m)
    return instruction.strip()


def common_indent(text: str) -> str:
    """The whitespace prefix shared by every non-blank line."""
    prefix = None
    for line in text.split("\n"):
        if not line.strip():
            continue
        ind = line[: len(line) - len(line.lstrip())]
        if prefix is None:
            prefix = ind
        else:
            n = 0
            while n < min(len(prefix), len(ind)) and prefix[n] == ind[n]:
                n += 1
            prefix = prefix[:n]
    return prefix or ""


def dedent(text: str, prefix: str) -> str:
    return "\n".join(line[len(prefix):] if line.startswith(prefix) else line.lstrip(" \t")
                     for line in text.split("\n"))


def indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line if line.strip() else line for line in text.split("\n"))


def edit_prompt_messages(code: str, instruction: str) -> list[dict]:
    """The chat messages of an edit request, in the bundled model's training format."""
    try:
        from .recipe.corpus import edit_messages
    except ImportError:  # the recipe is part of the package; this is a safety net only
        return [{"role": "user", "content": f"{instruction}\n\n{code.rstrip(chr(10))}"}]
    return edit_messages(code, instruction)


# ----------------------------------------------------------------------------- instruct models

PLAIN, FENCED = "plain", "fenced"

# File suffix -> the info string of its fenced code blocks (what chat models write after ```).
LANGUAGES = {
    ".py": "python", ".pyi": "python", ".pyw": "python", ".ipy": "python",
    ".js": "javascript", ".mjs": "javascript", ".cjs": "javascript", ".jsx": "jsx",
    ".ts": "typescript", ".mts": "typescript", ".cts": "typescript", ".tsx": "tsx",
    ".rs": "rust", ".go": "go", ".c": "c", ".h": "c", ".cc": "cpp", ".cpp": "cpp",
    ".cxx": "cpp", ".hpp": "cpp", ".hh": "cpp", ".hxx": "cpp", ".m": "objectivec",
    ".mm": "objectivec", ".java": "java", ".kt": "kotlin", ".kts": "kotlin", ".scala": "scala",
    ".swift": "swift", ".cs": "csharp", ".fs": "fsharp", ".rb": "ruby", ".php": "php",
    ".pl": "perl", ".lua": "lua", ".r": "r", ".jl": "julia", ".dart": "dart", ".zig": "zig",
    ".hs": "haskell", ".ml": "ocaml", ".ex": "elixir", ".exs": "elixir", ".erl": "erlang",
    ".clj": "clojure", ".sh": "bash", ".bash": "bash", ".zsh": "zsh", ".fish": "fish",
    ".ps1": "powershell", ".sql": "sql", ".html": "html", ".htm": "html", ".xml": "xml",
    ".css": "css", ".scss": "scss", ".json": "json", ".yaml": "yaml", ".yml": "yaml",
    ".toml": "toml", ".ini": "ini", ".cfg": "ini", ".md": "markdown", ".rst": "rst",
    ".tex": "latex", ".cmake": "cmake", ".vue": "vue", ".svelte": "svelte",
}
SPECIAL_NAMES = {"makefile": "makefile", "dockerfile": "dockerfile", "cmakelists.txt": "cmake"}


def language_for(path: str | os.PathLike | None) -> str:
    """The code-block language tag of a file ('' when its suffix is not a known one)."""
    if path is None:
        return ""
    p = Path(path)
    return SPECIAL_NAMES.get(p.name.lower()) or LANGUAGES.get(p.suffix.lower(), "")


def _renders_like_recipe(tokenizer) -> bool:
    """Whether the chat template renders conversations exactly as the recipe's ChatML does
    (no default system prompt, no reasoning block, the recipe's turn markers)."""
    from .recipe.corpus import CHAT_TEMPLATE, format_chat

    template = getattr(tokenizer, "chat_template", None)
    if template == CHAT_TEMPLATE:
        return True
    probes = [([{"role": "user", "content": "Rename `a` to `b`.\n\na = 1"}], True),
              ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], False)]
    try:
        return all(tokenizer.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
                   == format_chat(msgs, gen) for msgs, gen in probes)
    except Exception:  # a template that cannot render the probes is not the recipe's
        return False


def answer_format(engine) -> str:
    """PLAIN for the bundled model and models that speak its chat format (trained by the
    recipe); FENCED for any other model with a chat template (an instruct model)."""
    if str(getattr(engine, "name", "") or "").startswith("bundled:"):
        return PLAIN
    tokenizer = engine.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        return PLAIN  # no chat template: refused as before (`render_chat`)
    return PLAIN if _renders_like_recipe(tokenizer) else FENCED


def fence_for(code: str) -> str:
    """A backtick fence longer than any backtick run that starts a line of `code`."""
    longest = max((len(m.group(1)) for m in re.finditer(r"^[ \t]*(`{3,})", code, re.M)),
                  default=0)
    return "`" * max(3, longest + 1)


def fenced_messages(code: str, instruction: str, language: str = "", *,
                    whole_file: bool = True) -> list[dict]:
    """The chat messages of an edit request to an instruct model: the code in a fenced block,
    then the instruction and the request for the whole edited code in ONE block of the same
    kind. (The instruction comes after the code: Qwen2.5-Coder-0.5B-Instruct carried out a
    rename asked that way, and echoed the file unchanged when the instruction came first.)"""
    fence = fence_for(code)
    what = "file" if whole_file else "code"
    block = f"{fence}{language} code block" if language else f"fenced code block ({fence})"
    content = (f"{fence}{language}\n{code.rstrip(chr(10))}\n{fence}\n\n{instruction}\n\n"
               f"Return the complete edited {what} in a single {block}, with no explanation. "
               "Keep every line the instruction does not change exactly as it is.")
    return [{"role": "user", "content": content}]


def fenced_prediction(code: str, language: str = "") -> str:
    """The answer an instruct model is asked for when nothing changes: the original, wrapped in
    the opening fence line and the closing fence (so prompt lookup lines up from the start)."""
    fence = fence_for(code)
    return f"{fence}{language}\n{code.rstrip(chr(10))}\n{fence}"


def fenced_max_tokens(prediction_tokens: int) -> int:
    """The default answer length of a fenced edit: the whole original with its fences, half as
    much again for what the edit adds, and 64 tokens for a line of prose around the block."""
    return prediction_tokens * 3 // 2 + 64


_OPEN = re.compile(r"^([ \t]*)(`{3,}|~{3,})[ \t]*([^\s`]*)[^`]*$")


@dataclass
class CodeBlock:
    code: str  # the block's lines, without the fences ("\n" between lines, none at the end)
    info: str  # the language tag after the opening fence ('' when none)
    closed: bool  # False: the answer ended inside the block
    start: int  # the line of the answer where the opening fence is (0-based)


def code_blocks(answer: str) -> list[CodeBlock]:
    """The fenced code blocks of a Markdown answer: ``` or ~~~ (three or more), closed by a
    line of the same character at least as long; the opening fence's indentation is removed
    from the block's lines. More lenient than CommonMark about indentation (a model may
    indent a block under a list item)."""
    blocks = []
    lines = [line.rstrip("\r") for line in answer.split("\n")]
    i = 0
    while i < len(lines):
        m = _OPEN.match(lines[i])
        if not m:
            i += 1
            continue
        ind, fence, info = m.group(1), m.group(2), m.group(3)
        close = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        body, j, closed = [], i + 1, False
        while j < len(lines):
            line = lines[j]
            if close.match(line):
                closed = True
                break
            body.append(line[len(ind):] if line.startswith(ind) else line.lstrip(" \t"))
            j += 1
        blocks.append(CodeBlock("\n".join(body), info, closed, i))
        i = j + 1
    return blocks


_WORD = re.compile(r"\w+|[^\w\s]")


def similarity(a: str, b: str) -> float:
    """How alike two texts are, in [0, 1]: difflib's ratio by lines (and by characters for
    short texts), or where higher the same ratio over their words taken as multisets (a
    rename changes every line it touches, and an ordered word-level ratio of a long text would
    be slow)."""
    ratio = difflib.SequenceMatcher(None, a.split("\n"), b.split("\n"), autojunk=False).ratio()
    if len(a) + len(b) <= 4000:
        ratio = max(ratio, difflib.SequenceMatcher(None, a, b, autojunk=False).ratio())
    wa, wb = Counter(_WORD.findall(a)), Counter(_WORD.findall(b))
    total = sum(wa.values()) + sum(wb.values())
    if total:
        ratio = max(ratio, 2 * sum((wa & wb).values()) / total)
    return ratio


def best_block(blocks: list[CodeBlock], original: str) -> CodeBlock | None:
    """The block that is the edited code: the one most like the original (difflib ratio). A
    block that merely repeats the original loses to a closed block that is a changed version
    of it (an answer that shows the original and then the edit)."""
    if not blocks:
        return None
    original = original.strip("\n")
    scored = sorted(((similarity(b.code.strip("\n"), original), -n, b)
                     for n, b in enumerate(blocks)), key=lambda t: t[:2], reverse=True)
    best = scored[0][2]
    if best.code.strip("\n") == original:
        changed = [(r, b) for r, _, b in scored[1:]
                   if b.closed and b.code.strip("\n") != original and r >= 0.6]
        if changed:
            return changed[0][1]
    return best


def extract_code(answer: str, original: str, *,
                 cut: bool = False) -> tuple[str | None, bool, str | None]:
    """(code, closed, problem) from an instruct model's answer: the code of the fenced block
    that best matches `original` (no fences, no prose), whether that block was closed, and
    what makes the answer unusable (None when nothing does). `cut`: the answer was stopped by
    the token limit (a block left open is then cut, not merely unclosed)."""
    block = best_block(code_blocks(answer), original)
    if block is None:
        if cut:
            return None, False, None  # the caller reports the cut
        return None, False, ("the model's answer holds no fenced code block (```), so there is "
                             "no edited code to take from it")
    if block.closed:
        return block.code, True, None
    if cut:
        return block.code, False, None
    return block.code, False, ("the model's answer ended inside its code block (the block was "
                               "never closed): the code may be incomplete")


def check_python(before: str, after: str) -> str | None:
    """Why `after` is not valid Python when `before` was (None when it parses, or when the
    original did not parse either: nothing to blame on the edit)."""
    try:
        ast.parse(before)
    except (SyntaxError, ValueError):
        return None
    try:
        ast.parse(after)
    except SyntaxError as e:
        where = f"line {e.lineno}" + (f", column {e.offset}" if e.offset else "")
        return f"the edited file does not parse as Python ({where}: {e.msg})"
    except ValueError as e:  # a null byte
        return f"the edited file does not parse as Python ({e})"
    return None


# ----------------------------------------------------------------------------- editing


@dataclass
class EditResult:
    original: str  # the whole text before ("\n" line ends)
    edited: str  # the whole text after (the original when no code could be taken)
    start: int  # the edited line range [start, end) of the original
    end: int
    instruction: str  # as sent to the model
    reply: str  # the model's raw answer
    tokens: list[int]
    stats: Stats
    finish_reason: str
    format: str = PLAIN  # PLAIN: the bundled model's format; FENCED: an instruct model's
    code: str | None = None  # the edited code taken from the answer (None: none found)
    closed: bool = True  # FENCED: the code block was closed
    problem: str | None = None  # what makes the answer unusable (None: nothing)

    @property
    def changed(self) -> bool:
        return self.edited != self.original

    @property
    def complete(self) -> bool:
        """False when the answer was cut by the token limit before the edited code ended
        (PLAIN: anywhere; FENCED: before its code block closed): never write it."""
        if self.format == FENCED and self.code is not None and self.closed:
            return True
        return self.finish_reason == "stop"

    @property
    def usable(self) -> bool:
        """Whether the edited text may be written: complete and without a problem."""
        return self.complete and self.problem is None


def edit_text(engine, text: str, instruction: str, *, lines: str | None = None,
              max_tokens: int | None = None, temperature: float = 0.0, top_p: float = 1.0,
              top_k: int = 0, seed: int | None = None, mode: str | None = None,
              canonical: bool = True, on_step: Callable | None = None,
              suffix_store=None, language: str | None = None,
              format: str | None = None, memory=None) -> EditResult:
    """Ask `engine`'s model to apply `instruction` to `text` (or to its `lines` A:B), with the
    original as the predicted output. The whole edited text comes back in the result.
    `suffix_store`: the store of earlier requests the suffix source reads and keeps this
    edit in (default: the proposer's own, shared by the edits of this engine).
    `format`: PLAIN or FENCED (default: `answer_format(engine)`); `language`: the code-block
    tag of a FENCED request (`language_for(path)`; "python" also checks that the edited text
    still parses). `memory`: a ServingMemory (`memory.prompt_memory`) the request's prompt +
    max_tokens is checked against before its prefill (`memory.check_prompt`)."""
    from .chat_session import add_turn_end_tokens, render_chat

    if not instruction or not instruction.strip():
        raise MlxspecError("the instruction is empty")
    if format not in (None, PLAIN, FENCED):
        raise MlxspecError(f"unknown answer format {format!r} (expected {PLAIN} or {FENCED})")
    all_lines = split_lines(text)
    start, end = parse_lines(lines, len(all_lines))
    region = "".join(all_lines[start:end])
    body = region.rstrip("\n")
    trailing = region[len(body):]
    if not body.strip():
        raise MlxspecError("nothing to edit: the selected text is empty")
    prefix = common_indent(body)
    code = dedent(body, prefix)
    sent = canonical_instruction(instruction) if canonical else instruction.strip()
    fmt = format or answer_format(engine)
    language = language or ""

    add_turn_end_tokens(engine.tokenizer)
    if fmt == FENCED:
        messages = fenced_messages(code, sent, language,
                                   whole_file=(start, end) == (0, len(all_lines)))
        predicted = fenced_prediction(code, language)
    else:
        messages, predicted = edit_prompt_messages(code, sent), code
    prompt = engine.encode(render_chat(engine.tokenizer, messages))
    prediction = engine.tokenizer.encode(predicted, add_special_tokens=False)
    ctx = engine.max_context
    need = len(prompt) + len(prediction) + 1
    if ctx and need > ctx:
        raise MlxspecError(
            f"too large for the model's context: the request takes {len(prompt)} tokens and the "
            f"answer about {len(prediction)} more, {need} in all, but the context is {ctx} "
            f"tokens; select fewer lines with --lines A:B")
    if max_tokens is None:
        max_tokens = (fenced_max_tokens(len(prediction)) if fmt == FENCED
                      else len(prediction) + max(64, len(prediction) // 2))
    if ctx:
        max_tokens = min(max_tokens, ctx - len(prompt))
    from .memory import check_prompt

    check_prompt(memory, len(prompt), max_tokens, what="this edit",
                 hint="select fewer lines with --lines A:B")

    pieces: list[str] = []
    tokens: list[int] = []
    out = None
    proposer = getattr(engine, "proposer", None)
    if mode not in (None, getattr(engine, "mode", None)) and hasattr(engine, "proposer_for"):
        proposer = engine.proposer_for(mode)
    if suffix_store is not None and hasattr(proposer, "set_store"):
        proposer.set_store(suffix_store)
    # The engine puts this edit's text into the suffix store when the generation ends.
    for step in engine.stream_steps(prompt, max_tokens=max_tokens, temperature=temperature,
                                    top_p=top_p, top_k=top_k, seed=seed,
                                    prediction=prediction, mode=mode):
        if step is None:  # a step that only prefilled
            continue
        out = step
        pieces.append(out.text)
        tokens.extend(out.tokens)
        if on_step is not None:
            on_step(out)
    reply = "".join(pieces)
    finish = out.finish_reason or "length"
    closed, problem = True, None
    if fmt == FENCED:
        new_code, closed, problem = extract_code(reply, code, cut=finish != "stop")
    else:
        new_code = reply.strip("\n")
    if new_code is None:
        edited = text
    else:
        new_code = new_code.strip("\n")
        new_body = indent(new_code, prefix) if prefix else new_code
        edited = "".join(all_lines[:start]) + new_body + trailing + "".join(all_lines[end:])
        if fmt == FENCED and problem is None and closed and language == "python":
            problem = check_python(text, edited)
    return EditResult(text, edited, start, end, sent, reply, tokens, out.stats, finish,
                      fmt, new_code, closed, problem)


def split_lines(text: str) -> list[str]:
    """Lines with their "\n" (str.splitlines would also split at form feeds and other
    separators that source files contain)."""
    parts = text.split("\n")
    lines = [p + "\n" for p in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return lines


def unified_diff(old: str, new: str, name: str, context: int = 3) -> str:
    """A unified diff, `a/NAME` -> `b/NAME` for relative names as git writes them."""
    a, b = split_lines(old), split_lines(new)
    before, after = (name, name) if os.path.isabs(name) else (f"a/{name}", f"b/{name}")
    out = []
    for line in difflib.unified_diff(a, b, before, after, n=context):
        out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out)


# ----------------------------------------------------------------------------- writing


MAX_BACKUPS = 10_000


def backup_candidates(path: Path, suffix: str):
    """FILE.orig, then FILE.orig.1, FILE.orig.2, ...: where successive backups go."""
    yield path.with_name(path.name + suffix)
    for n in range(1, MAX_BACKUPS):
        yield path.with_name(f"{path.name}{suffix}.{n}")


def _create_new(tmp: Path, dest: Path, data: bytes) -> bool:
    """Give `dest` the bytes of `tmp` only if `dest` does not exist yet (never overwrites);
    False when it exists."""
    try:
        os.link(tmp, dest)  # atomic, and fails if dest exists
        return True
    except FileExistsError:
        return False
    except OSError:  # a filesystem without hard links: exclusive create, then copy
        pass
    try:
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    shutil.copystat(tmp, dest)
    return True


def write_backup(path: Path, data: bytes, suffix: str) -> Path:
    """Keep `data` (the bytes being replaced) in a new backup file beside `path` and return it.
    An existing backup is never overwritten: the first goes to FILE.orig, later ones to
    FILE.orig.1, FILE.orig.2, ..., so the untouched original of a series of edits stays in
    FILE.orig."""
    tmp = path.with_name(f".{path.name}{suffix}.mlxspec-tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    try:
        shutil.copystat(path, tmp)
        for candidate in backup_candidates(path, suffix):
            if _create_new(tmp, candidate, data):
                return candidate
        raise MlxspecError(f"{path}: {MAX_BACKUPS} backups ({path.name}{suffix}.N) already "
                           "exist; remove some; nothing written")
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def write_atomic(src: SourceFile, new_text: str, backup_suffix: str | None = ".orig",
                 before_replace: Callable | None = None) -> Path | None:
    """Replace `src.path` with `new_text`: a temporary file in the same folder, written,
    flushed to disk and given the original's permissions, then renamed over the original.
    Refuses (MlxspecError, nothing changed) if the file changed on disk since `src` was read.
    Keeps the replaced bytes in a new backup (`write_backup`: FILE.orig, then FILE.orig.1, ...;
    none when the suffix is empty), removed again if the file is not replaced.
    Returns the backup's path."""
    path = src.path
    if src.changed_on_disk():
        raise MlxspecError(f"{src.shown} changed on disk since it was read; nothing written "
                           "(run the edit again)")
    data = src.encode(new_text)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".mlxspec-tmp", dir=path.parent)
    backup = None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, src.mode)
        try:
            st = path.stat()
            os.chown(tmp, st.st_uid, st.st_gid)
        except (OSError, AttributeError):
            pass  # not permitted (another owner): the new file is ours, permissions kept
        if backup_suffix:
            backup = write_backup(path, src.raw, backup_suffix)
        if before_replace is not None:
            before_replace(tmp)
        if src.changed_on_disk():  # checked again, as late as possible
            raise MlxspecError(f"{src.shown} changed on disk during the edit; nothing written")
        os.replace(tmp, path)
    except BaseException:
        for leftover in (tmp, backup):
            # The original was not replaced: its copy is not needed (and must not push the
            # next edit's backup to another number).
            if leftover is not None:
                try:
                    os.unlink(leftover)
                except OSError:
                    pass
        raise
    return backup
