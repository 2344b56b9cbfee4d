"""`mlxspec chat`: an interactive assistant that streams its replies and shows, after each one,
how much the speculation saved."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import click

from ..chat_session import ChatSession, check_chat_template
from ..errors import MlxspecError
from ..memory import prompt_memory
from ..proposers import MODES
from .common import (
    distributed_option,
    exits_cleanly,
    load_engine,
    memory_budget,
    model_options,
    open_suffix_cache,
    option,
    sampling_options,
    save_suffix_cache,
    suffix_cache_option,
)
from .statsline import dim, stats_line

PROMPT = ">>> "
CONTINUATION = "... "
FENCE = '"""'

HELP = f"""\
commands:
  /help            this help
  /reset           start a new conversation (the system prompt stays)
  /mode [NAME]     show or switch the speculation mode ({", ".join(MODES)})
  /system [TEXT]   show or set the system prompt ('/system -' removes it)
  /stats           totals for this session
  /save FILE       save the conversation as JSON
  /exit            quit (also Ctrl-D, or Ctrl-C twice at the prompt)
  {FENCE}              start or end a multi-line message
Ctrl-C while a reply streams stops it and keeps what was written."""


def describe_model(engine, seconds: float) -> str:
    """What was loaded and how much memory its weights take."""
    from mlx.utils import tree_flatten

    def size(model):
        leaves = [v for _, v in tree_flatten(model.parameters())]
        return sum(v.size for v in leaves), sum(v.nbytes for v in leaves)

    n, nbytes = size(engine.model)
    text = f"loaded {engine.name}: {n / 1e6:.1f} M parameters, {nbytes / 1e6:.1f} MB"
    if engine.draft_model is not None:
        dn, dbytes = size(engine.draft_model)
        text += f"; draft {dn / 1e6:.1f} M parameters, {dbytes / 1e6:.1f} MB"
    if engine.max_context:
        text += f"; context {engine.max_context} tokens"
    return text + f" ({seconds:.1f} s)"


class DeferredInterrupt:
    """While active, Ctrl-C sets `hit` instead of raising: the reply stops between two engine
    steps, where its KV cache is consistent, never in the middle of one."""

    def __init__(self):
        self.hit = False
        self._previous = None

    def _handler(self, signum, frame):
        self.hit = True

    def __enter__(self):
        self.hit = False
        try:
            self._previous = signal.signal(signal.SIGINT, self._handler)
        except ValueError:  # not the main thread: Ctrl-C keeps its default behaviour
            self._previous = None
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        return False


def setup_readline() -> str | None:
    """Line editing and a persistent history when stdin is a terminal; the history file."""
    if not sys.stdin.isatty():
        return None
    try:
        import readline
    except ImportError:
        return None
    path = os.environ.get("MLXSPEC_HISTORY") or os.path.expanduser("~/.mlxspec_history")
    try:
        readline.read_history_file(path)
    except OSError:
        pass
    readline.set_history_length(1000)
    return path


def save_readline(path: str | None) -> None:
    if path is None:
        return
    try:
        import readline

        readline.write_history_file(path)
    except (ImportError, OSError):
        pass


class ChatREPL:
    """The read-eval-print loop around a `ChatSession`."""

    def __init__(self, session: ChatSession, input_fn=input):
        self.session = session
        self.engine = session.engine
        self.input = input_fn

    # -- input
    def read_message(self) -> tuple[str, bool]:
        """One message: a line, or the lines between two \"\"\" fences; and whether fenced
        (a fenced message is never a command)."""
        line = self.input(PROMPT)
        stripped = line.strip()
        if not stripped.startswith(FENCE):
            return line, False
        rest = stripped[len(FENCE):]
        if rest.endswith(FENCE) and len(rest) >= len(FENCE):  # """one line"""
            return rest[: -len(FENCE)], True
        lines = [rest] if rest else []
        while True:
            line = self.input(CONTINUATION)
            if line.rstrip().endswith(FENCE):
                last = line.rstrip()[: -len(FENCE)]
                if last:
                    lines.append(last)
                return "\n".join(lines), True
            lines.append(line)

    # -- the loop
    def run(self) -> None:
        armed = False  # a Ctrl-C at the prompt now exits
        while True:
            try:
                text, fenced = self.read_message()
            except EOFError:
                click.echo()
                return
            except KeyboardInterrupt:
                click.echo()
                if armed:
                    return
                armed = True
                click.echo(dim("(Ctrl-C again, Ctrl-D or /exit to quit)"))
                continue
            armed = False
            if not text.strip():
                continue
            if not fenced and text.lstrip().startswith("/"):
                if self.command(text.strip()) == "exit":
                    return
                continue
            armed = self.respond(text)

    def respond(self, text: str) -> bool:
        """Stream a reply; True when Ctrl-C stopped it."""
        session = self.session
        before = len(session.turn_stats)
        ends_with_newline = True
        with DeferredInterrupt() as interrupt:
            steps = session.send(text)
            try:
                for out in steps:
                    if out.text:
                        click.echo(out.text, nl=False)
                        ends_with_newline = out.text.endswith("\n")
                    if interrupt.hit:
                        break
            except MlxspecError as e:
                click.echo(f"error: {e}", err=True)
                return False
            finally:
                steps.close()
        if not ends_with_newline:
            click.echo()
        if len(session.turn_stats) == before:  # nothing was generated
            return interrupt.hit
        turn = session.last
        if turn.dropped_messages:
            click.echo(dim(f"({turn.dropped_messages} old messages dropped to fit the context)"))
        click.echo(dim(stats_line(turn.stats, interrupted=turn.interrupted)))
        if turn.finish_reason == "length":
            click.echo(dim(f"(reply cut at {session.settings['max_tokens']} tokens: --max-tokens)"))
        return turn.interrupted

    # -- commands
    def command(self, line: str) -> str | None:
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        name = name.lower()
        if name in ("/exit", "/quit", "/q"):
            return "exit"
        if name in ("/help", "/?"):
            click.echo(HELP)
        elif name == "/reset":
            self.session.reset()
            click.echo(dim("new conversation"))
        elif name == "/mode":
            self.switch_mode(arg)
        elif name == "/system":
            if not arg:
                click.echo(self.session.system or "(no system prompt)")
            else:
                self.session.set_system(None if arg == "-" else arg)
                click.echo(dim("system prompt removed" if arg == "-" else "system prompt set"))
        elif name == "/stats":
            click.echo(f"model              {self.engine.name}, mode {self.engine.mode}, "
                       f"{len(self.session.messages)} messages in the conversation")
            for ln in self.session.totals.lines():
                click.echo(ln)
        elif name == "/save":
            self.save(arg)
        else:
            click.echo(f"unknown command {name}: /help lists the commands "
                       f'(start a message with {FENCE} to send text that begins with "/")')
        return None

    def switch_mode(self, name: str) -> None:
        engine = self.engine
        if not name:
            click.echo(f"mode {engine.mode} (k={engine.num_draft}); modes: {', '.join(MODES)}")
            return
        try:
            if name in ("draft", "auto") and engine.draft_model is None and getattr(
                    engine, "coord", None) is not None:
                raise MlxspecError("with --distributed the draft model is loaded at start on "
                                   "every rank: start chat with --mode draft or --mode auto")
            if name in ("draft", "auto") and engine.draft_model is None and engine.draft_source:
                # the engine loads its draft (the bundled one, a pair's) when a mode first uses it
                click.echo(dim(f"loading the draft model {engine.draft_source}"), err=True)
            engine.set_mode(name)
        except MlxspecError as e:
            click.echo(f"error: {e}", err=True)
            return
        click.echo(dim(f"mode {engine.mode}"))

    def save(self, arg: str) -> None:
        if not arg:
            click.echo("error: /save needs a file name", err=True)
            return
        path = Path(arg).expanduser()
        try:
            path.write_text(json.dumps(self.session.to_json(), indent=2, ensure_ascii=False) + "\n",
                            encoding="utf-8")
        except OSError as e:
            click.echo(f"error: cannot write {path}: {e}", err=True)
            return
        click.echo(dim(f"saved {len(self.session.messages)} messages to {path}"))


@click.command()
@model_options
@sampling_options
@option("memory-limit")
@click.option("--system", default=None, help="System prompt.")
@suffix_cache_option
@distributed_option
@exits_cleanly
def chat(model, draft_model, mode, num_draft, max_tokens, temp, top_p, top_k, seed, system,
         memory_limit=None, suffix_cache=None, distributed=None):
    """Chat with a model (default: the bundled one). /help lists the commands."""
    # Ctrl-C must interrupt a reply even when started from a shell that launched us with SIGINT
    # ignored (a background job of a non-interactive shell inherits SIG_IGN).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    start = time.perf_counter()
    limit, source = memory_budget(memory_limit, distributed)
    try:
        # --distributed: only rank 0 returns here (reads stdin, prints); the others follow it
        engine = load_engine(model, draft_model, mode, num_draft, distributed=distributed,
                             remember=True,
                             **({"interactive": True} if distributed else {}))
    except FileNotFoundError as e:  # no bundled model
        raise MlxspecError(str(e)) from None
    click.echo(describe_model(engine, time.perf_counter() - start), err=True)
    stores, store = open_suffix_cache(suffix_cache, engine)
    session = ChatSession(engine, system=system, max_tokens=max_tokens, temperature=temp,
                          top_p=top_p, top_k=top_k, seed=seed, suffix_store=store,
                          memory=prompt_memory(engine, limit, source))
    check_chat_template(engine.tokenizer)  # fail now, not at the first message
    click.echo(dim(f"mode {engine.mode} · /help for commands · Ctrl-D or /exit to quit"))
    history = setup_readline()
    try:
        ChatREPL(session).run()
    finally:
        save_readline(history)
        save_suffix_cache(suffix_cache, stores)
