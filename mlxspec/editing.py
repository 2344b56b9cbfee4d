"""`mlxspec edit`'s machinery, independent of the command line: read a source file safely, ask
the chat model for the edited text with the original as a predicted output, diff it, and
replace the file atomically.

The prompt is the format the bundled model was trained on (`mlxspec.recipe.edit_messages`):
one user message `{instruction}\\n\\n{code}` answered by the whole edited code, no fences. The
original code is handed to the engine as `prediction`: the n-gram proposer drafts from it, so
the unchanged lines are accepted many tokens per target forward.
"""

from __future__ import annotations

import difflib
import os
import re
import shutil
import stat as stat_mod
import tempfile
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


# ----------------------------------------------------------------------------- editing


@dataclass
class EditResult:
    original: str  # the whole text before ("\n" line ends)
    edited: str  # the whole text after
    start: int  # the edited line range [start, end) of the original
    end: int
    instruction: str  # as sent to the model
    reply: str  # the model's raw answer
    tokens: list[int]
    stats: Stats
    finish_reason: str

    @property
    def changed(self) -> bool:
        return self.edited != self.original

    @property
    def complete(self) -> bool:
        """False when the answer was cut by the token limit: never write it."""
        return self.finish_reason == "stop"


def edit_text(engine, text: str, instruction: str, *, lines: str | None = None,
              max_tokens: int | None = None, temperature: float = 0.0, top_p: float = 1.0,
              top_k: int = 0, seed: int | None = 0, mode: str | None = None,
              canonical: bool = True, on_step: Callable | None = None,
              suffix_store=None) -> EditResult:
    """Ask `engine`'s model to apply `instruction` to `text` (or to its `lines` A:B), with the
    original as the predicted output. The whole edited text comes back in the result.
    `suffix_store`: the store of earlier requests the suffix source reads and keeps this
    edit in (default: the proposer's own, shared by the edits of this engine)."""
    from .chat_session import add_turn_end_tokens, render_chat

    if not instruction or not instruction.strip():
        raise MlxspecError("the instruction is empty")
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

    add_turn_end_tokens(engine.tokenizer)
    prompt = engine.encode(render_chat(engine.tokenizer, edit_prompt_messages(code, sent)))
    prediction = engine.tokenizer.encode(code, add_special_tokens=False)
    ctx = engine.max_context
    need = len(prompt) + len(prediction) + 1
    if ctx and need > ctx:
        raise MlxspecError(
            f"too large for the model's context: the request takes {len(prompt)} tokens and the "
            f"answer about {len(prediction)} more, {need} in all, but the context is {ctx} "
            f"tokens; select fewer lines with --lines A:B")
    if max_tokens is None:
        max_tokens = len(prediction) + max(64, len(prediction) // 2)
    if ctx:
        max_tokens = min(max_tokens, ctx - len(prompt))

    pieces: list[str] = []
    tokens: list[int] = []
    out = None
    proposer = getattr(engine, "proposer", None)
    if mode not in (None, getattr(engine, "mode", None)) and hasattr(engine, "proposer_for"):
        proposer = engine.proposer_for(mode)
    if suffix_store is not None and hasattr(proposer, "set_store"):
        proposer.set_store(suffix_store)
    # The engine puts this edit's text into the suffix store when the generation ends.
    for out in engine.stream_steps(prompt, max_tokens=max_tokens, temperature=temperature,
                                   top_p=top_p, top_k=top_k, seed=seed,
                                   prediction=prediction, mode=mode):
        pieces.append(out.text)
        tokens.extend(out.tokens)
        if on_step is not None:
            on_step(out)
    reply = "".join(pieces)
    new_body = indent(reply.strip("\n"), prefix) if prefix else reply.strip("\n")
    edited = "".join(all_lines[:start]) + new_body + trailing + "".join(all_lines[end:])
    return EditResult(text, edited, start, end, sent, reply, tokens, out.stats,
                      out.finish_reason or "length")


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
