"""A draft for any target: the smallest model with the target's tokenizer (the same tokens at
the same ids, the same added/special tokens) that this machine holds or a family name can fetch,
at most half the target's size. Chosen by tokenizer identity (`model_info.identity`), never by
name; the chosen draft is checked again token by token when it loads."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .errors import MlxspecError
from .model_info import ModelInfo, model_info

_PAD = re.compile(r"\[PAD\d+\]")
MAX_DRAFT_SHARE = 0.5  # a draft larger than half its target costs more than it saves


@dataclass(frozen=True)
class DraftChoice:
    """The draft chosen for a target: `source` is what `-m` would take (a family name, loaded
    when a mode first drafts; or a path), `label` how it is named to the user."""

    source: str
    label: str
    params: int
    where: str


def _candidates(target: ModelInfo, target_path: Path) -> list[tuple[int, int, DraftChoice]]:
    from .gguf.sources import NAMED_MODELS, named_model_cached
    from .hub import CODER_MODELS, QWEN25_TOKENIZER, stored_models

    limit = target.params * MAX_DRAFT_SHARE
    found: list[tuple[int, int, DraftChoice]] = []
    if target.tokenizer == QWEN25_TOKENIZER:  # the family's names, fetched when first used
        for name, m in CODER_MODELS.items():
            if m.params <= limit:
                found.append((m.params, 0, DraftChoice(name, name, m.params,
                                                       "the Qwen2.5-Coder family")))
    local: list[tuple[str, Path, str]] = []
    for name in NAMED_MODELS:
        gguf = named_model_cached(name)
        if gguf is not None:
            local.append((name, gguf, "mlxspec's cache"))
    try:
        stores = stored_models()
    except OSError:
        stores = []
    for s in stores:
        where = {"huggingface": "the Hugging Face cache", "lmstudio": "LM Studio",
                 "ollama": "Ollama"}[s.store]
        local.append((s.name, s.path, where))
    target_real = target_path.resolve()
    for label, path, where in local:
        try:
            if path.resolve() == target_real:
                continue
            info = model_info(path)
        except (MlxspecError, OSError, ValueError, KeyError):
            continue  # unreadable: not a candidate
        if info.tokenizer and info.tokenizer == target.tokenizer and info.params <= limit:
            source = label if label in NAMED_MODELS else str(path)
            found.append((info.params, 1, DraftChoice(source, label, info.params, where)))
    return found


def find_draft(target_path: Path) -> DraftChoice | None:
    """The default draft for the target in `target_path` (a model folder), or None."""
    try:
        target = model_info(target_path)
    except (MlxspecError, OSError, ValueError, KeyError):
        return None
    if not target.tokenizer or not target.params:
        return None
    found = _candidates(target, Path(target_path))
    if not found:
        return None
    found.sort(key=lambda c: (c[0], c[1]))
    return found[0][2]


# ----------------------------------------------------------------------------- the check


def real_vocab(tokenizer: Any) -> dict[str, int]:
    """token -> id without llama.cpp's `[PADn]` fill (a GGUF conversion has it, the same
    model's Hugging Face tokenizer does not)."""
    return {t: i for t, i in tokenizer.get_vocab().items() if not _PAD.fullmatch(t)}


def pad_logits(draft: nn.Module, rows: int) -> nn.Module:
    """Make `draft` return logits over `rows` ids, the target's: Qwen2.5's 7B-32B have 152,064
    embedding rows and its 0.5B-3B 151,936 over the same 151,665 tokens, and the rows beyond
    the tokens are never sampled. Extra rows get a large negative logit (finite, so that
    p * log p stays 0), surplus rows are dropped."""
    cls = type(draft)
    if getattr(cls, "_mlxspec_rows", None) == rows:
        return draft
    base = cls.__mro__[1] if getattr(cls, "_mlxspec_rows", None) else cls

    def __call__(self, *args, **kwargs):
        out = base.__call__(self, *args, **kwargs)
        have = out.shape[-1]
        if have > rows:
            return out[..., :rows]
        if have < rows:
            fill = -1e4 if out.dtype in (mx.float16, mx.bfloat16) else -1e9
            pad = mx.full((*out.shape[:-1], rows - have), fill, dtype=out.dtype)
            return mx.concatenate([out, pad], axis=-1)
        return out

    draft.__class__ = type(f"Padded{base.__name__}", (base,),
                           {"__call__": __call__, "_mlxspec_rows": rows})
    return draft
