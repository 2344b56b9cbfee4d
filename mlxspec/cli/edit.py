"""`mlxspec edit FILE --instruction TEXT`: an offline code-editing assistant. The original text
is the predicted output, so the unchanged lines are drafted from it and cost almost nothing.

Safe by default: prints a unified diff and changes nothing. `--write` replaces the file
atomically, keeps a backup that no later edit overwrites (FILE.orig, then FILE.orig.1, ...) and
the file's permissions, and refuses if the file changed on disk since it was read.

The bundled model answers with the bare code it was trained to write; any other chat model (an
instruct model) is asked for the whole edited file in one fenced code block, which is taken
from its answer; an answer without one, cut inside it, or a .py file that no longer parses is
never written."""

from __future__ import annotations

import json
import sys
import time

import click

from ..editing import (
    FENCED,
    PLAIN,
    edit_text,
    language_for,
    parse_lines,
    read_source,
    split_lines,
    unified_diff,
    write_atomic,
)
from ..errors import MlxspecError
from ..memory import prompt_memory
from .common import (
    distributed_option,
    exits_cleanly,
    load_engine,
    memory_budget,
    model_options,
    open_suffix_cache,
    option,
    options,
    save_suffix_cache,
    suffix_cache_option,
)
from .statsline import dim, stats_dict, stats_line


def colored_diff(diff: str) -> str:
    styles = [(("+++", "---"), {"bold": True}), (("+",), {"fg": "green"}),
              (("-",), {"fg": "red"}), (("@@",), {"fg": "cyan"})]
    out = []
    for line in split_lines(diff):
        body, nl = (line[:-1], "\n") if line.endswith("\n") else (line, "")
        for prefixes, style in styles:
            if body.startswith(prefixes):
                body = click.style(body, **style)
                break
        out.append(body + nl)
    return "".join(out)


class Progress:
    """`editing: N tokens` on a terminal's stderr while the answer is generated."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.count = 0
        self.last = 0.0

    def __call__(self, out) -> None:
        self.count += len(out.tokens)
        now = time.perf_counter()
        if self.enabled and now - self.last > 0.1:
            self.last = now
            click.echo(f"\rediting: {self.count} tokens", nl=False, err=True)

    def done(self) -> None:
        if self.enabled and self.last:
            click.echo("\r\x1b[K", nl=False, err=True)


@click.command()
@click.argument("file", type=click.Path(dir_okay=True, path_type=str))
@click.option("--instruction", "-i", required=True, help="What to change, e.g. 'Rename `x` to `y`.'")
@click.option("--lines", "line_range", default=None, metavar="A:B",
              help="Edit only lines A to B (1-based, inclusive; A: and :B are open-ended).")
@click.option("--write", is_flag=True,
              help="Replace the file (atomically, keeping a backup); default: print a diff only.")
@click.option("--backup-suffix", default=".orig", show_default=True,
              help="The backup is FILE + this suffix, or FILE + suffix + .1, .2, ... when that "
                   "exists (a backup is never overwritten); '' for no backup.")
@click.option("--json", "as_json", is_flag=True, help='Print {"path", "diff", "stats"} as JSON.')
@click.option("--print", "print_text", is_flag=True,
              help="Print the whole edited text instead of a diff.")
@click.option("--verbatim", is_flag=True,
              help="Send the instruction as typed (by default common phrasings such as "
                   "'rename a to b' are rewritten into the bundled model's training wording).")
@click.option("--fenced/--plain", "fenced", default=None,
              help="How the model is asked to answer: --fenced, the whole edited code in one "
                   "fenced code block (default for instruct models); --plain, the bare code "
                   "(the bundled model's format, its default).")
@model_options
@option("max-tokens", default=None, show_default=False,
        help="Answer length limit (default: enough for the whole selection, its tokens x 1.5 "
             "+ 64 with an instruct model, within the context).")
@options("temp", "top-p", "top-k", "seed", "memory-limit")
@suffix_cache_option
@distributed_option
@exits_cleanly
def edit(file, instruction, line_range, write, backup_suffix, as_json, print_text, verbatim,
         fenced, model, draft_model, mode, num_draft, max_tokens, temp, top_p, top_k, seed,
         memory_limit=None, suffix_cache=None, distributed=None):
    """Edit FILE as --instruction says, with the original text as the predicted output.

    Prints a unified diff (nothing written) unless --write; see docs/COMMANDS.md."""
    try:
        _edit(file, instruction, line_range, write, backup_suffix, as_json, print_text, verbatim,
              model, draft_model, mode, num_draft, max_tokens, temp, top_p, top_k, seed,
              distributed, suffix_cache, fenced, memory_limit)
    except MlxspecError as e:
        if as_json:  # a refusal is still one JSON object on stdout
            click.echo(json.dumps({"path": file, "error": str(e), "written": False,
                                   "backup": None}, ensure_ascii=False))
        raise


def backup_note(backup, suffix: str) -> str:
    """Where the replaced text went, and that the first backup is still there."""
    first = backup.with_name(backup.name[: backup.name.rindex(suffix) + len(suffix)])
    if first == backup:
        return f" (the original is in {backup})"
    return f" (the replaced version is in {backup}; {first}, the first backup, is untouched)"


def _edit(file, instruction, line_range, write, backup_suffix, as_json, print_text, verbatim,
          model, draft_model, mode, num_draft, max_tokens, temp, top_p, top_k, seed,
          distributed=None, suffix_cache=None, fenced=None, memory_limit=None):
    src = None

    def read():
        nonlocal src
        src = read_source(file)
        parse_lines(line_range, len(split_lines(src.text)))  # a bad --lines before loading
        if not instruction.strip():
            raise MlxspecError("the instruction (--instruction/-i) is empty")

    if distributed:
        # Only rank 0 reads the file (the others need not have it); an error there stops
        # every rank before loading. The others then follow rank 0's generation inside
        # load_engine and never return: nothing below runs on them.
        from .distributed import leader_input

        leader_input(read)
    else:
        read()
    limit, source = memory_budget(memory_limit, distributed)
    try:
        engine = load_engine(model, draft_model, mode, num_draft, quiet=as_json,
                             distributed=distributed, remember=True)
    except FileNotFoundError as e:  # no bundled model
        raise MlxspecError(str(e)) from None
    stores, store = (open_suffix_cache(suffix_cache, engine) if suffix_cache
                     else (None, None))
    progress = Progress(enabled=not as_json and sys.stderr.isatty())
    try:
        result = edit_text(engine, src.text, instruction, lines=line_range, max_tokens=max_tokens,
                           temperature=temp, top_p=top_p, top_k=top_k, seed=seed,
                           canonical=not verbatim, on_step=progress, suffix_store=store,
                           language=language_for(src.path) or language_for(src.shown),
                           format=None if fenced is None else (FENCED if fenced else PLAIN),
                           memory=prompt_memory(engine, limit, source))
    finally:
        progress.done()
    save_suffix_cache(suffix_cache, stores)
    diff = unified_diff(src.text, result.edited, src.shown)

    error = None
    written, backup = False, None
    if not result.complete:
        ctx = getattr(engine, "max_context", None)
        used = result.stats.prompt_tokens + result.stats.generated_tokens
        why = (f"the model's context ({ctx} tokens) is full; select fewer lines with --lines"
               if ctx and used >= ctx else "raise --max-tokens")
        where = " before its code block closed" if result.format == FENCED else ""
        error = (f"the answer was cut at {result.stats.generated_tokens} tokens{where} ({why})"
                 + ("; nothing written" if write else ""))
    elif result.problem:
        error = result.problem + ("; nothing written" if write else "")
    elif write and result.changed:
        try:
            backup = write_atomic(src, result.edited, backup_suffix or None)
            written = True
        except MlxspecError as e:
            error = str(e)
        except OSError as e:
            error = f"{src.shown}: cannot write: {e.strerror or e}; nothing changed"

    if as_json:
        payload = {"path": src.shown, "diff": diff, "stats": stats_dict(result.stats),
                   "instruction": result.instruction, "lines": [result.start + 1, result.end],
                   "finish_reason": result.finish_reason, "format": result.format,
                   "code": result.code, "written": written,
                   "backup": str(backup) if backup else None}
        if print_text:
            payload["text"] = result.edited
        if error:
            payload["error"] = error
        click.echo(json.dumps(payload, ensure_ascii=False))
    else:
        if print_text:
            click.echo(result.edited, nl=False)
        elif diff:
            click.echo(colored_diff(diff) if sys.stdout.isatty() else diff, nl=False)
        click.echo(dim(stats_line(result.stats, prediction=True)), err=True)
        if not result.changed:
            if result.code is not None:  # else the error says why there is nothing to show
                click.echo("no changes", err=True)
        elif written:
            click.echo(f"wrote {src.shown}" + (backup_note(backup, backup_suffix) if backup
                                               else " (no backup)"), err=True)
        elif not write:
            click.echo(dim("dry run: nothing written (--write replaces the file)"), err=True)
    if error:
        click.echo(f"error: {error}", err=True)
        sys.exit(2 if write else 1)
