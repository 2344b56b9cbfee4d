"""`mlxspec generate`: one completion, streamed, with a stats line (or one JSON object)."""

from __future__ import annotations

import json
import sys

import click

from ..errors import MlxspecError
from .common import (
    exits_cleanly,
    load_engine,
    mode_kwargs,
    mode_options,
    model_options,
    sampling_options,
)


@click.command()
@model_options
@sampling_options
@mode_options
@click.option("--prompt", "-p", default=None, help="Prompt text ('-' reads standard input).")
@click.option("--prompt-file", type=click.Path(dir_okay=False), default=None, help="Read the prompt from a file.")
@click.option("--chat/--no-chat", default=False, help="Wrap the prompt in the model's chat template.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming.")
@exits_cleanly
def generate(model, draft_model, mode, num_draft, max_tokens, temp, top_p, top_k, seed,
             prompt, prompt_file, chat, as_json, **mode_flags):
    """Generate a completion of a prompt."""
    if (prompt is None) == (prompt_file is None):
        raise MlxspecError("give exactly one of --prompt or --prompt-file")
    if prompt_file is not None:
        try:
            with open(prompt_file, encoding="utf-8") as f:
                prompt = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise MlxspecError(f"cannot read prompt file {prompt_file}: {e}") from None
    elif prompt == "-":
        prompt = sys.stdin.read()
    if not prompt:
        raise MlxspecError("the prompt is empty")
    engine = load_engine(model, draft_model, mode, num_draft, quiet=as_json,
                         **mode_kwargs(mode, **mode_flags))
    if chat:
        prompt = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    kwargs = dict(max_tokens=max_tokens, temperature=temp, top_p=top_p, top_k=top_k, seed=seed)
    if as_json:
        result = engine.generate(prompt, **kwargs)
        s = result.stats
        click.echo(json.dumps({
            "model": engine.name, "mode": engine.mode, "text": result.text, "tokens": result.tokens,
            "finish_reason": result.finish_reason,
            "stats": {
                "prompt_tokens": s.prompt_tokens, "generated_tokens": s.generated_tokens,
                "target_forwards": s.target_forwards, "drafted": s.drafted, "accepted": s.accepted,
                "acceptance_rate": s.acceptance_rate, "mean_accepted_length": s.mean_accepted_length,
                "acceptance_by_position": s.acceptance_by_position,
                "prompt_tps": s.prompt_tps, "generation_tps": s.generation_tps,
                "peak_memory_gb": s.peak_memory_gb},
        }))
        return
    stats = None
    for out in engine.stream_steps(prompt, **kwargs):
        click.echo(out.text, nl=False)
        stats = out.stats
    click.echo()
    click.echo(stats.summary(), err=True)
