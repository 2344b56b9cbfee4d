"""`mlxspec edit` with an instruct model (Qwen2.5-Coder-Instruct and the like): the request asks
for the whole edited file in one fenced code block, the code is taken from the block of the
answer that best matches the original (no prose, no fences), the answer length is sized from the
file, and an answer without a block, cut inside it, or a .py file that no longer parses is
never written. The bundled model's format is unchanged (tests/test_edit.py)."""

from __future__ import annotations

import ast
import json
import shutil

import pytest
from click.testing import CliRunner

import mlxspec.cli.edit as edit_cli
from mlxspec import editing
from mlxspec.cli.main import main
from mlxspec.editing import (
    FENCED,
    PLAIN,
    answer_format,
    check_python,
    code_blocks,
    edit_text,
    extract_code,
    fenced_max_tokens,
    fenced_messages,
    fenced_prediction,
    language_for,
)
from mlxspec.engine import StepOutput
from mlxspec.errors import MlxspecError
from mlxspec.recipe.corpus import CHAT_TEMPLATE, IM_END, IM_START, format_chat
from mlxspec.stats import Stats

SOURCE = '''\
def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)


def span(values):
    return max(values) - min(values)
'''
EDITED = SOURCE.replace("total", "acc")
QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
# Qwen2.5-Instruct's chat template without its tool calls: a default system prompt.
QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\n" + QWEN_SYSTEM + "<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def instruct_answer(code: str, lang: str = "python") -> str:
    """What Qwen2.5-Coder-Instruct answers: prose, the fenced file, more prose."""
    return (f"Here is the edited file with `total` renamed to `acc`:\n\n```{lang}\n"
            f"{code.rstrip(chr(10))}\n```\n\nI renamed every use of the variable.")


# ----------------------------------------------------------------------------- fake engines


class CharTokenizer:
    """One token per character; the chat template is Qwen's (a default system prompt)."""

    chat_template = QWEN_TEMPLATE

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    def get_vocab(self):
        return {}

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=False):
        if messages[0]["role"] != "system":
            messages = [{"role": "system", "content": QWEN_SYSTEM}, *messages]
        return format_chat(messages, add_generation_prompt)


class RecipeTokenizer(CharTokenizer):
    chat_template = CHAT_TEMPLATE

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=False):
        return format_chat(messages, add_generation_prompt)


class InstructEngine:
    """Answers every request with `answer` (a text, or a function of the predicted output),
    streamed in a few steps, then `finish` ("stop" or "length")."""

    name, mode, draft_model, max_context = "Qwen/Qwen2.5-Coder-0.5B-Instruct", "ngram", None, 100_000

    def __init__(self, answer=None, finish="stop", tokenizer=None):
        self.tokenizer = tokenizer or CharTokenizer()
        self.answer = answer if answer is not None else instruct_answer(EDITED)
        self.finish = finish
        self.prompts, self.predictions, self.max_tokens = [], [], []

    def encode(self, prompt):
        return self.tokenizer.encode(prompt)

    def stream_steps(self, prompt, *, max_tokens, prediction=None, **kw):
        self.prompts.append(self.tokenizer.decode(prompt))
        self.predictions.append(self.tokenizer.decode(prediction))
        self.max_tokens.append(max_tokens)
        answer = self.answer(self.predictions[-1]) if callable(self.answer) else self.answer
        stats = Stats(mode="ngram", prompt_tokens=len(prompt))
        step = max(1, len(answer) // 3)
        for i in range(0, len(answer), step):
            piece = answer[i : i + step]
            stats.record_step("prediction", len(piece), len(piece) - 1, len(piece))
            yield StepOutput(piece, self.encode(piece), stats)
        yield StepOutput("", [], stats, self.finish)


@pytest.fixture
def engine(monkeypatch):
    holder = {"engine": InstructEngine()}
    monkeypatch.setattr(edit_cli, "load_engine", lambda *a, **k: holder["engine"])
    return holder


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "stats.py"
    path.write_text(SOURCE)
    return path


def run_edit(*args):
    return CliRunner().invoke(main, ["edit", *args], catch_exceptions=False)


def error_lines(r) -> list[str]:
    return [line for line in r.stderr.splitlines() if line.startswith("error:")]


# ----------------------------------------------------------------------------- taking the code


def test_prose_around_a_block():
    code, closed, problem = extract_code(instruct_answer(EDITED), SOURCE)
    assert code == EDITED.rstrip("\n") and closed and problem is None
    assert "Here is" not in code and "```" not in code


def test_two_blocks_the_second_is_the_file():
    answer = ("Use it like this:\n\n```python\nprint(mean([1, 2]))\n```\n\n"
              "The whole file:\n\n```python\n" + EDITED + "```\n")
    code, closed, problem = extract_code(answer, SOURCE)
    assert code == EDITED.rstrip("\n") and closed and problem is None


def test_a_rename_of_every_line_of_a_long_file_still_beats_a_snippet():
    # Every line changed: no line of the file matches, yet its words mostly do.
    long = "".join(f"    x{i} = compute({i}, total)\n" for i in range(2000))
    edited = long.replace("total", "acc")
    answer = ("For example:\n```python\nprint(compute(1, acc))\n```\nThe file:\n```python\n"
              + edited + "```\n")
    assert extract_code(answer, long) == (edited.rstrip("\n"), True, None)


def test_an_answer_that_repeats_the_original_first_gives_the_edit():
    answer = ("Original:\n```python\n" + SOURCE + "```\nEdited:\n```python\n" + EDITED + "```\n")
    assert extract_code(answer, SOURCE)[0] == EDITED.rstrip("\n")
    # ...and an answer that only repeats it is no change, not an error.
    assert extract_code("```python\n" + SOURCE + "```", SOURCE) == (SOURCE.rstrip("\n"), True,
                                                                     None)


def test_no_block_is_a_problem():
    code, closed, problem = extract_code("Sure! Rename `total` to `acc` everywhere.", SOURCE)
    assert code is None and problem and "no fenced code block" in problem
    # The bare code, unfenced, is not taken either: the request asked for a block.
    assert extract_code(EDITED, SOURCE)[0] is None


def test_unterminated_block():
    answer = "Here it is:\n\n```python\n" + EDITED[:40]
    code, closed, problem = extract_code(answer, SOURCE, cut=True)  # the token limit cut it
    assert code == EDITED[:40] and not closed and problem is None  # the caller reports the cut
    code, closed, problem = extract_code(answer, SOURCE)  # the model stopped inside it
    assert not closed and "never closed" in problem
    assert extract_code("Let me think about", SOURCE, cut=True) == (None, False, None)


def test_fence_variants():
    # Tildes, an indented block (under a list item), a longer fence around ``` lines, no tag.
    assert code_blocks("~~~py\nx = 1\n~~~")[0].code == "x = 1"
    indented = code_blocks("1. The file:\n\n   ```python\n   def f():\n       pass\n   ```\n")
    assert indented[0].code == "def f():\n    pass" and indented[0].info == "python"
    nested = code_blocks("````markdown\n```python\nx\n```\n````\n")
    assert nested[0].code == "```python\nx\n```" and nested[0].closed
    bare = code_blocks("```\nx = 1\n```\r\n")
    assert bare[0].code == "x = 1" and bare[0].info == "" and bare[0].closed
    # A line that merely mentions ``` is not a fence; a fence line with a tag does not close.
    assert code_blocks("use ``` to fence") == []
    assert [b.closed for b in code_blocks("```python\n```js\n```")] == [True]


def test_python_that_does_not_parse_names_the_line():
    problem = check_python(SOURCE, SOURCE.replace("    return max", "    return max(("))
    assert problem.startswith("the edited file does not parse as Python (line 9")
    assert check_python(SOURCE, EDITED) is None
    # An original that did not parse either (Python 2, a template): nothing to blame the edit on.
    assert check_python("print 'x'\n", "print 'y'\n") is None


# ----------------------------------------------------------------------------- the request


def test_which_models_get_the_fenced_format():
    assert answer_format(InstructEngine()) == FENCED
    assert answer_format(InstructEngine(tokenizer=RecipeTokenizer())) == PLAIN  # a trained pair
    bundled = InstructEngine()
    bundled.name = "bundled:target"
    assert answer_format(bundled) == PLAIN

    class Broken(CharTokenizer):
        def apply_chat_template(self, *a, **k):
            raise ValueError("a template that rejects the probe")

    assert answer_format(InstructEngine(tokenizer=Broken())) == FENCED

    class NoTemplate(CharTokenizer):
        chat_template = None

    assert answer_format(InstructEngine(tokenizer=NoTemplate())) == PLAIN  # refused as before


def test_fenced_prompt_shape():
    engine = InstructEngine()
    result = edit_text(engine, SOURCE, "rename total to acc", language="python")
    prompt = engine.prompts[0]
    # The model's own system prompt, then ONE user message: the file in a python block, the
    # instruction, and the request for the whole file in one block, no explanation.
    user = (f"{IM_START}user\n```python\n{SOURCE.rstrip()}\n```\n\nRename `total` to `acc`.\n\n"
            "Return the complete edited file in a single ```python code block, with no "
            "explanation.")
    assert prompt.startswith(f"{IM_START}system\n{QWEN_SYSTEM}{IM_END}\n{user}")
    assert prompt.endswith(f"{IM_END}\n{IM_START}assistant\n") and prompt.count(IM_START) == 3
    # The prediction is the original wrapped as the answer should be.
    assert engine.predictions[0] == f"```python\n{SOURCE.rstrip()}\n```"
    assert result.format == FENCED and result.edited == EDITED and result.usable


def test_prompt_language_and_fences():
    assert language_for("a/b.py") == "python" and language_for("x.RS") == "rust"
    assert language_for("Makefile") == "makefile" and language_for("notes") == ""
    msgs = fenced_messages("x\n", "Do it.", "", whole_file=False)
    assert "```\nx\n```" in msgs[0]["content"] and "complete edited code" in msgs[0]["content"]
    # Code holding ``` lines (a Markdown file) is fenced with four backticks, answer included.
    md = "# Title\n\n```python\nx = 1\n```\n"
    assert fenced_prediction(md, "markdown") == "````markdown\n" + md.rstrip() + "\n````"
    assert "single ````markdown code block" in fenced_messages(md, "Do it.", "markdown")[0][
        "content"]


def test_max_tokens_sized_from_the_file():
    engine = InstructEngine()
    edit_text(engine, SOURCE, "rename total to acc", language="python")
    predicted = len(fenced_prediction(SOURCE, "python"))  # one token per character here
    assert engine.max_tokens[0] == fenced_max_tokens(predicted) == predicted * 3 // 2 + 64
    edit_text(engine, SOURCE, "rename total to acc", max_tokens=7)  # --max-tokens wins
    assert engine.max_tokens[1] == 7
    prompt_len = len(engine.prompts[0])
    engine.max_context = prompt_len + predicted + 10  # the context caps it
    edit_text(engine, SOURCE, "rename total to acc", language="python")
    assert engine.max_tokens[2] == engine.max_context - prompt_len
    # The bundled format keeps its own default.
    plain = InstructEngine(answer=lambda code: code, tokenizer=RecipeTokenizer())
    edit_text(plain, SOURCE, "rename total to acc")
    n = len(SOURCE.rstrip())
    assert plain.max_tokens[0] == n + max(64, n // 2)


def test_real_tokenizers_choose_their_format(model_dirs, tmp_path):
    from mlxspec import load

    qwen = tmp_path / "qwen-like"
    shutil.copytree(model_dirs["llama"], qwen)
    config = json.loads((qwen / "tokenizer_config.json").read_text())
    (qwen / "tokenizer_config.json").write_text(json.dumps({**config,
                                                            "chat_template": QWEN_TEMPLATE}))
    assert answer_format(load(str(qwen), mode="none")) == FENCED
    # The test models render the recipe's ChatML, as the bundled model does.
    assert answer_format(load(str(model_dirs["llama"]), mode="none")) == PLAIN


# ----------------------------------------------------------------------------- the command


def test_write_keeps_code_only(engine, source):
    r = run_edit(str(source), "-i", "rename total to acc", "--write")
    assert r.exit_code == 0, r.output
    written = source.read_text()
    assert written == EDITED and "```" not in written and "Here is" not in written
    ast.parse(written)
    assert (source.parent / "stats.py.orig").read_text() == SOURCE
    assert f"wrote {source}" in r.stderr and not error_lines(r)


def test_json_has_the_code_and_stats(engine, source):
    payload = json.loads(run_edit(str(source), "-i", "rename total to acc", "--json").stdout)
    assert payload["format"] == FENCED and payload["code"] == EDITED.rstrip("\n")
    assert payload["stats"]["generated_tokens"] > 0 and payload["written"] is False
    assert "+    acc = 0" in payload["diff"] and "```" not in payload["diff"]
    assert "error" not in payload


def test_cut_after_the_block_closed_is_written(engine, source):
    # The token limit stopped the prose after the block: the code is whole.
    engine["engine"] = InstructEngine(answer=instruct_answer(EDITED)[:-20], finish="length")
    r = run_edit(str(source), "-i", "rename total to acc", "--write")
    assert r.exit_code == 0, r.output
    assert source.read_text() == EDITED


BAD_ANSWERS = {
    "no block": ("Rename `total` to `acc` in both places.", "stop", "no fenced code block"),
    "cut inside the block": ("Here:\n\n```python\n" + EDITED[:50], "length",
                             "before its code block closed"),
    "never closed": ("Here:\n\n```python\n" + EDITED, "stop", "never closed"),
    "does not parse": (instruct_answer(EDITED.replace("(values):", "(values:", 1)), "stop",
                       "does not parse as Python (line 1"),
}


@pytest.mark.parametrize("case", sorted(BAD_ANSWERS))
def test_a_bad_answer_leaves_the_file_untouched(engine, source, case):
    answer, finish, message = BAD_ANSWERS[case]
    engine["engine"] = InstructEngine(answer=answer, finish=finish)
    before = source.stat().st_mtime_ns
    r = run_edit(str(source), "-i", "rename total to acc", "--write")
    assert r.exit_code == 2
    errors = error_lines(r)
    assert len(errors) == 1 and message in errors[0] and "nothing written" in errors[0], r.stderr
    assert source.read_text() == SOURCE and source.stat().st_mtime_ns == before
    assert sorted(p.name for p in source.parent.iterdir()) == ["stats.py"]
    # A dry run reports it too (exit 1, as a cut answer's), in --json as well.
    r = run_edit(str(source), "-i", "rename total to acc", "--json")
    payload = json.loads(r.stdout)
    assert r.exit_code == 1 and message in payload["error"] and payload["written"] is False


def test_parse_check_only_for_python(engine, tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("total: 1 (\n")
    engine["engine"] = InstructEngine(answer="```\nacc: 1 (\n```")
    r = run_edit(str(path), "-i", "rename total to acc", "--write")
    assert r.exit_code == 0, r.output
    assert path.read_text() == "acc: 1 (\n"
    assert "```\ntotal: 1 (\n```" in engine["engine"].prompts[0]  # no language tag


def test_lines_and_crlf_with_a_fenced_answer(engine, tmp_path):
    path = tmp_path / "box.py"
    text = "class Box:\n    def size(self, items):\n        total = 0\n        return total\n"
    path.write_bytes(text.replace("\n", "\r\n").encode())
    # The method goes out dedented, in a block; the answer comes back re-indented.
    engine["engine"] = InstructEngine(answer=lambda pred: instruct_answer(
        pred.split("\n", 1)[1].rsplit("\n", 1)[0].replace("total", "acc")))
    r = run_edit(str(path), "-i", "rename total to acc", "--lines", "2:4", "--write")
    assert r.exit_code == 0, r.output
    assert engine["engine"].predictions[0] == (
        "```python\ndef size(self, items):\n    total = 0\n    return total\n```")
    assert path.read_bytes() == text.replace("total", "acc").replace("\n", "\r\n").encode()


def test_plain_and_fenced_override_the_choice(engine, source):
    # --plain: the bundled model's format on an instruct model (the answer is then the code).
    engine["engine"] = InstructEngine(answer=lambda code: code.replace("total", "acc"))
    r = run_edit(str(source), "-i", "rename total to acc", "--plain", "--write")
    assert r.exit_code == 0, r.output
    assert engine["engine"].predictions[0] == SOURCE.rstrip("\n")
    assert "```" not in engine["engine"].prompts[0] and source.read_text() == EDITED
    # --fenced: the fenced request to a model that speaks the recipe's format.
    source.write_text(SOURCE)
    engine["engine"] = InstructEngine(tokenizer=RecipeTokenizer())
    r = run_edit(str(source), "-i", "rename total to acc", "--fenced", "--write")
    assert r.exit_code == 0, r.output
    assert engine["engine"].predictions[0].startswith("```python\n")


def test_unknown_format_refused():
    with pytest.raises(MlxspecError, match="unknown answer format"):
        edit_text(InstructEngine(), SOURCE, "x", format="diff")


def test_end_to_end_on_a_loaded_model(model_dirs, tmp_path, monkeypatch):
    """A real engine (a random model whose tokenizer has Qwen's template) whose generation is
    replaced by a canned instruct answer: the command asks for a block and writes its code."""
    qwen = tmp_path / "qwen-like"
    shutil.copytree(model_dirs["llama"], qwen)
    config = json.loads((qwen / "tokenizer_config.json").read_text())
    (qwen / "tokenizer_config.json").write_text(json.dumps({**config,
                                                            "chat_template": QWEN_TEMPLATE}))
    small, edited = "def f(total):\n    return total\n", "def f(acc):\n    return acc\n"
    source = tmp_path / "f.py"
    source.write_text(small)  # the test model's context is 512 tokens
    real_load = edit_cli.load_engine
    seen = {}

    def load_engine(*a, **k):
        eng = real_load(*a, **k)

        def stream_steps(prompt, *, max_tokens, prediction=None, **kw):
            seen["prompt"] = eng.tokenizer.decode(eng.encode(prompt))
            seen["prediction"] = eng.tokenizer.decode(prediction)
            seen["max_tokens"], seen["sizes"] = max_tokens, (len(prompt), len(prediction))
            answer = instruct_answer(edited)
            yield StepOutput(answer, eng.tokenizer.encode(answer, add_special_tokens=False),
                             Stats(mode="ngram", prompt_tokens=len(prompt)), "stop")

        monkeypatch.setattr(eng, "stream_steps", stream_steps)
        return eng

    monkeypatch.setattr(edit_cli, "load_engine", load_engine)
    r = run_edit(str(source), "-i", "rename total to acc", "-m", str(qwen), "--write")
    assert r.exit_code == 0, r.output
    assert source.read_text() == edited
    ast.parse(source.read_text())
    assert QWEN_SYSTEM in seen["prompt"] and "single ```python code block" in seen["prompt"]
    assert seen["prediction"] == f"```python\n{small.rstrip()}\n```"
    prompt_len, predicted = seen["sizes"]  # sized from the file, not the usual fixed 256:
    assert seen["max_tokens"] == min(fenced_max_tokens(predicted), 512 - prompt_len) < 256
    # A bad answer from the same engine: nothing written.
    source.write_text(small)
    monkeypatch.setattr(editing, "extract_code", lambda *a, **k: (None, False, "no block"))
    r = run_edit(str(source), "-i", "rename total to acc", "-m", str(qwen), "--write")
    assert r.exit_code == 2 and error_lines(r) == ["error: no block; nothing written"]
    assert source.read_text() == small
