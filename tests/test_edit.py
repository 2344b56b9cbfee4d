"""`mlxspec edit`: safe by default, atomic `--write` with a backup and the permissions kept,
refusals that change nothing, and speculation that changes nothing either (ngram == none)."""

from __future__ import annotations

import difflib
import json
import os
import stat

import pytest
from click.testing import CliRunner

import mlxspec.cli.edit as edit_cli
from mlxspec import editing
from mlxspec.cli.main import main
from mlxspec.editing import (
    canonical_instruction,
    edit_text,
    parse_lines,
    read_source,
    split_lines,
    unified_diff,
)
from mlxspec.engine import StepOutput
from mlxspec.errors import MlxspecError
from mlxspec.recipe.corpus import format_chat
from mlxspec.stats import Stats

SOURCE = '''\
import os


def total(values):
    """Sum the values."""
    result = 0
    for v in values:
        result += v
    return result


class Box:
    def size(self, items):
        count = 0
        for item in items:
            count += 1
        return count
'''


# ----------------------------------------------------------------------------- a scripted model


class CharTokenizer:
    chat_template = "chatml"

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    def get_vocab(self):
        return {}

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=False):
        return format_chat(messages, add_generation_prompt)


class ScriptedEngine:
    """Answers an edit request by applying `transform` to the predicted output (the original
    code), streaming it in a few steps, as the engine does."""

    name, mode, draft_model, max_context = "scripted", "ngram", None, 100_000

    def __init__(self, transform=lambda code: code.replace("result", "acc"), during=None):
        self.tokenizer = CharTokenizer()
        self.transform, self.during = transform, during
        self.prompts, self.predictions = [], []

    def encode(self, prompt):
        return self.tokenizer.encode(prompt)

    def stream_steps(self, prompt, *, max_tokens, prediction=None, **kw):
        self.prompts.append(self.tokenizer.decode(prompt))
        code = self.tokenizer.decode(prediction)
        self.predictions.append(code)
        answer = self.transform(code)
        stats = Stats(mode="ngram", prompt_tokens=len(prompt))
        if self.during is not None:
            self.during()
        step = max(1, len(answer) // 3)
        for i in range(0, len(answer), step):
            piece = answer[i : i + step]
            stats.record_step("prediction", len(piece), len(piece) - 1, len(piece))
            yield StepOutput(piece, self.encode(piece), stats)
        yield StepOutput("", [], stats, "stop")


@pytest.fixture
def scripted(monkeypatch):
    """Run `mlxspec edit` with a scripted engine in place of a loaded model."""
    holder = {"engine": ScriptedEngine()}
    monkeypatch.setattr(edit_cli, "load_engine", lambda *a, **k: holder["engine"])
    return holder


def run_edit(*args):
    return CliRunner().invoke(main, ["edit", *args], catch_exceptions=False)


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "code.py"
    path.write_text(SOURCE)
    os.chmod(path, 0o640)
    return path


def leftovers(folder):
    return [p.name for p in folder.iterdir() if "mlxspec-tmp" in p.name]


# ----------------------------------------------------------------------------- dry run and write


def test_dry_run_changes_nothing(scripted, source):
    before = source.stat()
    r = run_edit(str(source), "-i", "rename result to acc")
    assert r.exit_code == 0, r.output
    assert "-    result = 0" in r.output and "+    acc = 0" in r.output
    assert "dry run" in r.output
    after = source.stat()
    assert source.read_text() == SOURCE and after.st_mtime_ns == before.st_mtime_ns
    assert not (source.parent / "code.py.orig").exists() and not leftovers(source.parent)
    # The instruction went out in the training wording, with the original as the prediction.
    assert "Rename `result` to `acc`.\n\nimport os" in scripted["engine"].prompts[0]
    assert scripted["engine"].predictions[0] == SOURCE.rstrip("\n")


def test_write_matches_dry_run_keeps_backup_and_permissions(scripted, source):
    dry = json.loads(run_edit(str(source), "-i", "rename result to acc", "--json").output)
    assert dry["written"] is False and dry["path"] == str(source)
    assert set(dry) >= {"path", "diff", "stats"}
    assert dry["stats"]["accepted_prediction_tokens"] > 0
    r = run_edit(str(source), "-i", "rename result to acc", "--write")
    assert r.exit_code == 0, r.output
    new = source.read_text()
    assert new == SOURCE.replace("result", "acc")
    backup = source.parent / "code.py.orig"
    assert backup.read_text() == SOURCE
    assert stat.S_IMODE(source.stat().st_mode) == 0o640
    # What was written is exactly what the dry run showed.
    assert unified_diff(SOURCE, new, str(source)) == dry["diff"]
    applied = "".join(difflib.restore(difflib.ndiff(split_lines(SOURCE), split_lines(new)), 2))
    assert applied == new
    assert not leftovers(source.parent)


def test_three_writes_in_a_row_keep_the_original(scripted, source):
    """A later --write never overwrites an earlier backup: FILE.orig stays the untouched
    original, the replaced versions go to FILE.orig.1, FILE.orig.2, and the message says so."""
    steps = [("result", "acc"), ("acc", "total"), ("total", "s")]
    versions = [SOURCE]
    for n, (old, new) in enumerate(steps):
        scripted["engine"] = ScriptedEngine(transform=lambda code, o=old, w=new: code.replace(o, w))
        r = run_edit(str(source), "-i", f"rename {old} to {new}", "--write")
        assert r.exit_code == 0, r.output
        versions.append(versions[-1].replace(old, new))
        assert source.read_text() == versions[-1]
        backup = source.parent / ("code.py.orig" + (f".{n}" if n else ""))
        assert backup.read_text() == versions[-2]
        if n == 0:
            assert f"(the original is in {backup})" in r.stderr
        else:
            assert f"the replaced version is in {backup}" in r.stderr
            assert f"{source.parent / 'code.py.orig'}, the first backup, is untouched" in r.stderr
    assert (source.parent / "code.py.orig").read_text() == SOURCE
    assert sorted(p.name for p in source.parent.iterdir()) == [
        "code.py", "code.py.orig", "code.py.orig.1", "code.py.orig.2"]
    # --json reports the backup it made.
    scripted["engine"] = ScriptedEngine(transform=lambda code: code.replace("s", "S"))
    payload = json.loads(run_edit(str(source), "-i", "x", "--write", "--json").stdout)
    assert payload["written"] and payload["backup"] == str(source.parent / "code.py.orig.3")


def test_a_backup_that_exists_is_never_overwritten(tmp_path):
    """Someone else's FILE.orig (or a race creating it) is skipped, not replaced."""
    path = tmp_path / "f.py"
    path.write_text("new\n")
    (tmp_path / "f.py.orig").write_text("mine\n")
    (tmp_path / "f.py.orig.1").write_text("also mine\n")
    src = read_source(path)
    backup = editing.write_atomic(src, "newer\n")
    assert backup == tmp_path / "f.py.orig.2" and backup.read_text() == "new\n"
    assert (tmp_path / "f.py.orig").read_text() == "mine\n"
    assert (tmp_path / "f.py.orig.1").read_text() == "also mine\n"
    assert path.read_text() == "newer\n" and not leftovers(tmp_path)


def test_backup_without_hard_links(tmp_path, monkeypatch):
    """A filesystem without hard links: exclusive create, still never overwriting."""
    def no_links(*a, **k):
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(editing.os, "link", no_links)
    path = tmp_path / "f.py"
    path.write_text("one\n")
    (tmp_path / "f.py.orig").write_text("first\n")
    backup = editing.write_atomic(read_source(path), "two\n")
    assert backup == tmp_path / "f.py.orig.1" and backup.read_text() == "one\n"
    assert (tmp_path / "f.py.orig").read_text() == "first\n" and not leftovers(tmp_path)


def test_write_keeps_executable_bit_crlf_and_custom_backup(scripted, tmp_path):
    path = tmp_path / "run.py"
    path.write_bytes(SOURCE.replace("\n", "\r\n").encode())
    os.chmod(path, 0o755)
    r = run_edit(str(path), "-i", "rename result to acc", "--write", "--backup-suffix", ".bak")
    assert r.exit_code == 0, r.output
    assert path.read_bytes() == SOURCE.replace("result", "acc").replace("\n", "\r\n").encode()
    assert stat.S_IMODE(path.stat().st_mode) == 0o755
    assert (tmp_path / "run.py.bak").read_bytes() == SOURCE.replace("\n", "\r\n").encode()


def test_write_refused_when_file_changed_on_disk(scripted, source):
    concurrent = SOURCE + "# edited meanwhile\n"
    scripted["engine"] = ScriptedEngine(during=lambda: source.write_text(concurrent))
    r = run_edit(str(source), "-i", "rename result to acc", "--write")
    assert r.exit_code == 2
    assert "changed on disk" in r.output
    assert source.read_text() == concurrent
    assert not leftovers(source.parent)


@pytest.mark.parametrize("exc", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_failure_before_rename_leaves_original_intact(scripted, source, monkeypatch, exc):
    real_replace = os.replace

    def failing_replace(src, dst):
        if os.fspath(dst) == str(source):  # the final rename over the original ("a kill")
            raise exc
        return real_replace(src, dst)

    monkeypatch.setattr(editing.os, "replace", failing_replace)
    r = run_edit(str(source), "-i", "rename result to acc", "--write")
    assert r.exit_code != 0  # click turns KeyboardInterrupt into "Aborted!", exit 1
    if isinstance(exc, OSError):
        assert r.exit_code == 2 and "nothing changed" in r.output
    assert source.read_text() == SOURCE
    assert stat.S_IMODE(source.stat().st_mode) == 0o640
    assert not leftovers(source.parent)
    # The copy made for the backup went away with the failed write (the original is in place).
    assert sorted(p.name for p in source.parent.iterdir()) == ["code.py"]


def test_truncated_answer_is_never_written(scripted, source):
    class Cut(ScriptedEngine):
        def stream_steps(self, prompt, **kw):
            for out in super().stream_steps(prompt, **kw):
                if out.finish_reason:
                    yield StepOutput("", [], out.stats, "length")
                    return
                yield out

    scripted["engine"] = Cut()
    r = run_edit(str(source), "-i", "rename result to acc", "--write")
    assert r.exit_code == 2 and "cut at" in r.output
    assert source.read_text() == SOURCE and not (source.parent / "code.py.orig").exists()


def test_answer_cut_by_the_context_says_so(scripted, source):
    class CutLonger(ScriptedEngine):
        def stream_steps(self, prompt, **kw):
            for out in super().stream_steps(prompt, **kw):
                if out.finish_reason:
                    yield StepOutput("", [], out.stats, "length")
                    return
                yield out

    engine = CutLonger(transform=lambda code: code + "\n# a longer answer" * 3)
    prompt_chars = len(format_chat([{"role": "user", "content": "Rename `result` to `acc`.\n\n"
                                     + SOURCE.rstrip()}], True))
    engine.max_context = prompt_chars + len(SOURCE)  # just room for the request check
    scripted["engine"] = engine
    r = run_edit(str(source), "-i", "rename result to acc", "--write")
    assert r.exit_code == 2
    assert "context" in r.stderr and "--lines" in r.stderr and "raise --max-tokens" not in r.stderr
    assert source.read_text() == SOURCE


def test_lines_edits_only_the_selection(scripted, source):
    lines = SOURCE.split("\n")
    a = lines.index("    def size(self, items):") + 1
    b = lines.index("        return count") + 1
    engine = ScriptedEngine(transform=lambda code: code.replace("count", "n"))
    scripted["engine"] = engine
    r = run_edit(str(source), "-i", "rename count to n", "--lines", f"{a}:{b}", "--write")
    assert r.exit_code == 0, r.output
    # The selected method went out dedented, as the model was trained, and came back indented.
    assert engine.predictions[0].startswith("def size(self, items):\n    count = 0")
    want = SOURCE.replace("count", "n")
    assert source.read_text() == want


def test_no_change_writes_nothing(scripted, source):
    scripted["engine"] = ScriptedEngine(transform=lambda code: code)
    r = run_edit(str(source), "-i", "do nothing", "--write")
    assert r.exit_code == 0 and "no changes" in r.output
    assert not (source.parent / "code.py.orig").exists()


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("content,message", [
    (b"\x7fELF\x02\x01\x01\x00\x00\x00binary", "binary"),
    ("caf\u00e9 = 1\n".encode("latin-1"), "not UTF-8"),
])
def test_binary_and_non_utf8_refused(scripted, tmp_path, content, message):
    path = tmp_path / "data.py"
    path.write_bytes(content)
    r = run_edit(str(path), "-i", "rename a to b", "--write")
    assert r.exit_code == 2 and message in r.output
    assert path.read_bytes() == content and len(list(tmp_path.iterdir())) == 1


def test_oversize_refused(scripted, tmp_path, monkeypatch):
    path = tmp_path / "big.py"
    path.write_text(SOURCE * 10)
    scripted["engine"].max_context = 1000  # the request and the answer do not fit
    r = run_edit(str(path), "-i", "rename result to acc", "--write")
    assert r.exit_code == 2 and "context" in r.output and "--lines" in r.output
    monkeypatch.setattr(editing, "MAX_FILE_BYTES", 100)  # and the byte cap before reading
    monkeypatch.setattr(editing.read_source, "__defaults__", (100,))
    r = run_edit(str(path), "-i", "rename result to acc", "--write")
    assert r.exit_code == 2 and "too large" in r.output
    assert path.read_text() == SOURCE * 10 and len(list(tmp_path.iterdir())) == 1


def test_missing_file_and_directory_refused(scripted, tmp_path):
    assert "no such file" in run_edit(str(tmp_path / "nope.py"), "-i", "x").output
    assert "not a regular file" in run_edit(str(tmp_path), "-i", "x").output


def test_parse_lines_and_canonical_instruction():
    assert parse_lines(None, 10) == (0, 10)
    assert parse_lines("2:4", 10) == (1, 4)
    assert parse_lines("3:", 10) == (2, 10)
    assert parse_lines(":3", 10) == (0, 3)
    assert parse_lines("5", 10) == (4, 5)
    assert parse_lines("8:99", 10) == (7, 10)
    for bad in ("0:3", "4:2", "x", "11:12", ":"):
        with pytest.raises(MlxspecError):
            parse_lines(bad, 10)
    assert canonical_instruction("rename foo to bar") == "Rename `foo` to `bar`."
    assert canonical_instruction("Rename the variable `foo` to `bar`.") == "Rename `foo` to `bar`."
    assert canonical_instruction("remove the docstring") == "Remove the docstring."
    assert canonical_instruction("make it faster") == "make it faster"


def test_read_source_keeps_bom_and_form_feeds(tmp_path):
    path = tmp_path / "ff.py"
    raw = b"\xef\xbb\xbfx = 1\n\x0c\ny = 2\n"
    path.write_bytes(raw)
    src = read_source(path)
    assert src.text == "x = 1\n\x0c\ny = 2\n" and src.encode(src.text) == raw
    assert len(split_lines(src.text)) == 3


# ----------------------------------------------------------------------------- a real model


SMALL = "def add(a, b):\n    total = a + b\n    return total\n"


def test_ngram_edit_is_token_identical_to_none_with_fewer_forwards(model_dirs):
    from mlxspec.loading import load

    engine = load(str(model_dirs["llama"]), mode="none")
    fewer = 0
    for i, code in enumerate([SMALL, SMALL.replace("total", "t" * 3), "x = [1, 2, 3]\ny = x\n"]):
        plain = edit_text(engine, code, "rename total to s", max_tokens=48, seed=i)
        spec = edit_text(engine, code, "rename total to s", max_tokens=48, seed=i, mode="ngram")
        assert spec.tokens == plain.tokens and spec.edited == plain.edited
        assert plain.stats.target_forwards == plain.stats.generated_tokens
        assert spec.stats.target_forwards <= plain.stats.target_forwards
        fewer += spec.stats.target_forwards < plain.stats.target_forwards
    assert fewer >= 2


def test_cli_edit_json_on_a_real_model(model_dirs, tmp_path):
    path = tmp_path / "add.py"
    path.write_text(SMALL)
    r = CliRunner().invoke(main, ["edit", str(path), "-i", "rename total to s", "--json",
                                  "--model", str(model_dirs["llama"]), "--max-tokens", "16"])
    assert r.exit_code in (0, 1), r.output  # 1: a random model's answer is cut at 16 tokens
    payload = json.loads(r.stdout.strip().splitlines()[-1])
    assert payload["path"] == str(path) and payload["stats"]["mode"] == "auto"  # the default
    assert payload["stats"]["generated_tokens"] <= 16
    assert path.read_text() == SMALL


@pytest.mark.slow
def test_bundled_model_edit_ngram_equals_none():
    """On the bundled model: the n-gram run equals the plain run, in fewer forwards."""
    from mlxspec.loading import load
    from mlxspec.recipe import heldout_functions

    engine = load(None, mode="none")
    _, _, code = heldout_functions(1)[0]
    name = code.split("def ", 1)[1].split("(", 1)[0]
    plain = edit_text(engine, code, f"rename {name} to {name}_new")
    spec = edit_text(engine, code, f"rename {name} to {name}_new", mode="ngram")
    assert spec.tokens == plain.tokens
    assert spec.stats.target_forwards < plain.stats.target_forwards


def test_commands_are_registered():
    r = CliRunner().invoke(main, ["--help"])
    assert "chat" in r.output and "edit" in r.output
    r = CliRunner().invoke(main, ["edit", "--help"])
    assert "--instruction" in r.output and "--write" in r.output and "--lines" in r.output


def test_missing_bundled_model_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXSPEC_MODELS_DIR", str(tmp_path / "nowhere"))
    path = tmp_path / "add.py"
    path.write_text(SMALL)
    r = CliRunner().invoke(main, ["edit", str(path), "-i", "rename total to s"])
    assert r.exit_code == 2 and "error:" in r.output and "not found" in r.output
    r = CliRunner().invoke(main, ["chat"], input="")
    assert r.exit_code == 2 and "not found" in r.output
