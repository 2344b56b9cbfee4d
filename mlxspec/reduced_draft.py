"""A trained draft for a real target: a few llama layers reading the target's own token embedding,
with an output head over the target's N most frequent tokens (FR-Spec).

The draft is an mlx-lm llama (`DraftModelProposer` runs it as any draft);
its `__call__` returns full-vocabulary logits, -inf outside the head, so q is a distribution
over the whole vocabulary that is zero off the head and the acceptance rules stay exact. Its
folder holds `config.json` (llama arguments plus an `mlxspec_draft` entry), and
`model.safetensors` (layers, norm, head, `head_ids`), but no embedding: on loading the draft
shares the target's embedding module (no copy, no extra memory).

Where a trained draft is found for `-m NAME`: `models/drafts/NAME/` (shipped; in a wheel under
share/mlxspec/models/drafts/), then `<cache>/drafts/NAME/` (where `mlxspec train --draft-for
-m NAME` writes it).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache
from mlx_lm.models.llama import LlamaModel, ModelArgs

from .errors import MlxspecError

CONFIG_KEY = "mlxspec_draft"
FINGERPRINT_ROWS = 64


class ReducedHeadDraft(nn.Module):
    """llama layers on a (shared) embedding, and a head over `head_ids` only."""

    def __init__(self, args: ModelArgs, head_ids: list[int] | mx.array):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = LlamaModel(args)
        ids = mx.array(head_ids).astype(mx.uint32)
        self.lm_head = nn.Linear(args.hidden_size, ids.size, bias=False)
        self.set_head_ids(ids)

    def set_head_ids(self, ids: mx.array) -> None:
        """The head's vocabulary; `_full_index` maps a vocabulary id to its head row (or to the
        -inf slot past the last row). Underscored: not parameters."""
        ids = ids.astype(mx.uint32)
        n, vocab = ids.size, self.args.vocab_size
        index = mx.full((vocab,), n, dtype=mx.uint32)
        index[ids] = mx.arange(n, dtype=mx.uint32)
        self._head_ids = ids
        self._full_index = index
        mx.eval(self._head_ids, self._full_index)

    @property
    def head_ids(self) -> mx.array:
        return self._head_ids

    def reduced(self, inputs: mx.array, cache=None) -> mx.array:
        """Logits over the head's tokens only (training, and the draft's own argmax)."""
        return self.lm_head(self.model(inputs, cache))

    def __call__(self, inputs: mx.array, cache=None, input_embeddings=None) -> mx.array:
        small = self.lm_head(self.model(inputs, cache, input_embeddings))
        pad = mx.full(small.shape[:-1] + (1,), -mx.inf, dtype=small.dtype)
        return mx.take(mx.concatenate([small, pad], axis=-1), self._full_index, axis=-1)

    @property
    def layers(self):
        return self.model.layers

    def make_cache(self):
        return [KVCache() for _ in self.layers]


def target_embedding(target: nn.Module) -> nn.Module:
    """The target's token-embedding module (mlx-lm models keep it at `model.embed_tokens`)."""
    emb = getattr(getattr(target, "model", None), "embed_tokens", None)
    if emb is None:
        raise MlxspecError("the target has no `model.embed_tokens` (a token embedding an "
                           "mlx-lm llama-style model has): a trained draft needs one to share")
    return emb


def embedding_fingerprint(target: nn.Module) -> list[float]:
    """Values that identify the target's embedding: 4 entries of FINGERPRINT_ROWS rows spread
    over the vocabulary (equal up to rounding for the same weights in another precision)."""
    vocab = target_embedding(target).weight.shape[0] if hasattr(
        target_embedding(target), "weight") else FINGERPRINT_ROWS
    rows = mx.arange(FINGERPRINT_ROWS) * max(1, vocab // FINGERPRINT_ROWS)
    values = target_embedding(target)(rows)[:, :4].astype(mx.float32)
    return [round(float(v), 5) for v in values.reshape(-1).tolist()]


def same_embedding(a: list[float], b: list[float]) -> bool:
    a, b = mx.array(a), mx.array(b)
    if a.shape != b.shape:
        return False
    return float(mx.abs(a - b).mean().item()) <= 0.1 * float(mx.abs(a).mean().item()) + 1e-6


def tokenizer_digest(tokenizer) -> str:
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


def is_reduced_draft(path: str | Path) -> bool:
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return False
    try:
        return CONFIG_KEY in json.loads(cfg.read_text())
    except (OSError, ValueError):
        return False


def draft_args(cfg: dict) -> ModelArgs:
    keys = set(ModelArgs.__dataclass_fields__)
    return ModelArgs(**{k: v for k, v in cfg.items() if k in keys})


def check_matches(meta: dict, target: nn.Module, tokenizer, draft_name: str,
                  target_name: str) -> None:
    """Refuse a draft trained for another target (tokenizer, vocabulary, width, embedding)."""
    args = getattr(target, "args", None)
    tv, td = getattr(args, "vocab_size", None), getattr(args, "hidden_size", None)
    if (tv, td) != (meta["vocab_size"], meta["hidden_size"]):
        raise MlxspecError(
            f"draft {draft_name} was trained for a target with vocabulary {meta['vocab_size']} "
            f"and width {meta['hidden_size']}; {target_name} has {tv} and {td}")
    if tokenizer_digest(tokenizer) != meta["tokenizer"]:
        raise MlxspecError(f"draft {draft_name} does not share the tokenizer of target "
                           f"{target_name}")
    if not same_embedding(embedding_fingerprint(target), meta["embedding_fingerprint"]):
        raise MlxspecError(f"draft {draft_name} was trained for another target (its token "
                           f"embedding differs from {target_name}'s)")


def load_reduced_draft(path: str | Path, target: nn.Module, tokenizer,
                       target_name: str = "the target") -> ReducedHeadDraft:
    """Load a trained draft folder onto `target` (sharing its embedding), after checking that
    it was trained for this target."""
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    meta = cfg[CONFIG_KEY]
    check_matches(meta, target, tokenizer, str(path), target_name)
    weights = mx.load(str(path / "model.safetensors"))
    head_ids = weights.pop("head_ids")
    draft = ReducedHeadDraft(draft_args(cfg), head_ids)
    draft.model.embed_tokens = target_embedding(target)
    dtype = target_embedding(target)(mx.array([0])).dtype
    expected = {k for k, _ in _flat(draft.parameters()) if not k.startswith("model.embed_tokens")}
    if set(weights) != expected:
        missing, extra = sorted(expected - set(weights)), sorted(set(weights) - expected)
        raise MlxspecError(f"draft {path}: weights do not match its config (missing "
                           f"{missing[:3]}, unexpected {extra[:3]})")
    from mlx.utils import tree_unflatten

    draft.update(tree_unflatten([(k, v.astype(dtype)) for k, v in weights.items()]))
    mx.eval(draft.parameters())
    return draft


def _flat(params) -> list:
    from mlx.utils import tree_flatten

    return tree_flatten(params)


def save_reduced_draft(draft: ReducedHeadDraft, out: str | Path, meta: dict) -> None:
    """Write the draft (float16, no embedding) and its config with `meta` under CONFIG_KEY."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(mx.float16) for k, v in _flat(draft.parameters())
               if not k.startswith("model.embed_tokens")}
    weights["head_ids"] = draft.head_ids.astype(mx.int32)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    cfg = {k: v for k, v in vars(draft.args).items() if v is not None}
    cfg.pop("layer_types", None)
    cfg[CONFIG_KEY] = meta
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def draft_key(model: str) -> str:
    """The folder name a trained draft for `-m model` lives under: the name itself for a named
    model (`smollm2`), else a readable stem plus a hash of the resolved path."""
    from .gguf.sources import is_named_model

    if is_named_model(model):
        return model
    resolved = str(Path(model).expanduser().resolve()) if Path(model).expanduser().exists() else model
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(resolved).name or "model")[:40]
    return f"{stem}-{hashlib.sha256(resolved.encode()).hexdigest()[:10]}"


def shipped_drafts_dirs() -> list[Path]:
    """`drafts/` in every folder the bundled models are searched in (a checkout's models/,
    a wheel's share/mlxspec/models/, $MLXSPEC_MODELS_DIR)."""
    from .models import candidate_dirs

    return [d / "drafts" for d in candidate_dirs()]


def cached_drafts_dir() -> Path:
    from .gguf.sources import cache_root

    return cache_root() / "drafts"


def find_trained_draft(model: str | None) -> Path | None:
    """The trained draft for `-m model`: shipped under models/drafts/, else in the cache."""
    if not model:
        return None
    key = draft_key(model)
    for root in [*shipped_drafts_dirs(), cached_drafts_dir()]:
        if is_reduced_draft(root / key):
            return root / key
    return None
