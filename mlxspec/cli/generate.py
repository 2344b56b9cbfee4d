"""`mlxspec generate`: one completion, streamed, with a stats line (or one JSON object)."""

from __future__ import annotations

import json
import sys

import click

from .. import memory
from ..chat_session import render_chat
from ..errors import MlxspecError
from .common import (
    distributed_option,
    exits_cleanly,
    load_engine,
    memory_budget,
    mode_kwargs,
    mode_options,
    model_options,
    option,
    sampling_options,
)
from .statsline import stats_dict


def context_note(engine, stats, max_tokens: int, finish_reason: str | None) -> str | None:
    """A sentence when the model's context, not --max-tokens, ended the generation."""
    ctx = getattr(engine, "max_context", None)
    if not ctx or finish_reason not in (None, "length") or stats.generated_tokens >= max_tokens:
        return None
    if stats.prompt_tokens + stats.generated_tokens < ctx:
        return None
    return (f"the model's context ({ctx} tokens) ended the answer: the prompt took "
            f"{stats.prompt_tokens}, so {stats.generated_tokens} of the {max_tokens} tokens "
            f"asked for (--max-tokens) were generated")


@click.command()
@click.option("--prompt", "-p", default=None, help="Prompt text ('-' reads standard input).")
@click.option("--prompt-file", type=click.Path(dir_okay=False), default=None,
              help="Read the prompt from a file.")
@model_options
@sampling_options
@option("memory-limit")
@click.option("--chat/--no-chat", default=False, help="Wrap the prompt in the model's chat template.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming.")
@mode_options
@distributed_option
@exits_cleanly
def generate(model, draft_model, mode, num_draft, max_tokens, temp, top_p, top_k, seed,
             prompt, prompt_file, chat, as_json, memory_limit=None, distributed=None,
             **mode_flags):
    """Generate a completion of a prompt.

    The text streams to stdout and a stats line follows on stderr; --json prints one object
    with the text, the tokens and every statistic instead."""
    if (prompt is None) == (prompt_file is None):
        raise MlxspecError("give exactly one of --prompt or --prompt-file")
    options = mode_kwargs(mode, **mode_flags)  # checked before the model loads

    def read_prompt():
        text = prompt
        if prompt_file is not None:
            try:
                with open(prompt_file, encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError) as e:
                raise MlxspecError(f"cannot read prompt file {prompt_file}: {e}") from None
        elif text == "-":
            text = sys.stdin.read()
        if not text:
            raise MlxspecError("the prompt is empty")
        return text

    if distributed:  # rank 0 reads the prompt; the others get it from rank 0
        from .distributed import leader_input

        prompt = leader_input(read_prompt)
    else:
        prompt = read_prompt()
    limit, source = memory_budget(memory_limit, distributed)
    engine = load_engine(model, draft_model, mode, num_draft, quiet=as_json,
                         distributed=distributed, remember=True, **options)
    if chat:
        prompt = render_chat(engine.tokenizer, [{"role": "user", "content": prompt}])
    budget = memory.prompt_memory(engine, limit, source)
    if budget is not None:  # a prompt that will not fit is refused before its prefill
        prompt = engine.encode(prompt)
        memory.check_prompt(budget, len(prompt), max_tokens, context=engine.max_context)
    kwargs = dict(max_tokens=max_tokens, temperature=temp, top_p=top_p, top_k=top_k, seed=seed)
    if as_json:
        result = engine.generate(prompt, **kwargs)
        note = context_note(engine, result.stats, max_tokens, result.finish_reason)
        payload = {"model": engine.name, "mode": engine.mode, "text": result.text,
                   "tokens": result.tokens, "finish_reason": result.finish_reason,
                   "context_exhausted": note is not None, "stats": stats_dict(result.stats)}
        if note:
            payload["warning"] = note
            click.echo(f"note: {note}", err=True)
        click.echo(json.dumps(payload))
        return
    stats = finish = None
    for out in engine.stream_steps(prompt, **kwargs):
        if out is None:  # a step that only prefilled a chunk of the prompt
            continue
        click.echo(out.text, nl=False)
        stats, finish = out.stats, out.finish_reason or finish
    click.echo()
    click.echo(stats.summary(), err=True)
    note = context_note(engine, stats, max_tokens, finish)
    if note:
        click.echo(f"note: {note}", err=True)
