"""The one-line, dim statistics summary that `mlxspec chat` prints after each reply and
`mlxspec edit` after each edit."""

from __future__ import annotations

import click

from ..stats import Stats


def stats_line(stats: Stats, *, prediction: bool = False, interrupted: bool = False) -> str:
    """generated tokens · tok/s · prompt (new + cached) · drafted/accepted (%) · tok/forward ·
    mode, and with `prediction` the accepted/rejected predicted-output tokens."""
    parts = [f"{stats.generated_tokens} tokens", f"{stats.generation_tps:.1f} tok/s"]
    prefilled = stats.prompt_tokens - stats.cached_tokens
    parts.append(f"prompt {prefilled} new + {stats.cached_tokens} cached")
    if stats.drafted:
        parts.append(f"drafted {stats.drafted} accepted {stats.accepted} "
                     f"({100 * stats.acceptance_rate:.0f}%)")
    elif stats.mode != "none":
        parts.append("drafted 0")
    if prediction:
        acc, rej = stats.prediction_counts
        parts.append(f"prediction {acc} accepted {rej} rejected")
    parts.append(f"{stats.mean_accepted_length:.2f} tok/forward ({stats.target_forwards} forwards)")
    parts.append(f"mode {stats.mode}")
    if interrupted:
        parts.append("interrupted")
    return " · ".join(parts)


def dim(text: str) -> str:
    """Dim styling; click.echo drops it when the stream is not a terminal."""
    return click.style(text, dim=True)


def stats_dict(stats: Stats) -> dict:
    """Stats as JSON, with the predicted-output counts OpenAI reports."""
    d = stats.to_dict()
    acc, rej = stats.prediction_counts
    d["accepted_prediction_tokens"] = acc
    d["rejected_prediction_tokens"] = rej
    return d
