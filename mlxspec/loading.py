"""Model resolution and loading: local directories, Hugging Face ids (the local cache first),
the bundled pair; draft compatibility and memory checks."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn

from . import backend
from .errors import MlxspecError
from .policy import check_num_draft
from .proposers import check_mode

if TYPE_CHECKING:
    from .engine import Engine

def _local_snapshot(repo: str) -> Path | None:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo, local_files_only=True))
    except Exception:
        return None


def resolve_model_path(model: str | None, *, gguf_weights: str | None = None) -> Path:
    """A local directory, a GGUF source (a file, a folder holding one, `ollama:NAME`, a named
    model such as `smollm2`: converted once to a cached mlx-lm folder), a Hugging Face repo id
    (cache first, then download), or None for the bundled default model."""
    if model is None:
        from .models import bundled_model_path

        try:
            return bundled_model_path("target")
        except FileNotFoundError as e:
            raise MlxspecError(str(e)) from None
    from .gguf import model_folder

    converted = model_folder(model, weights=gguf_weights)
    if converted is not None:
        return converted
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise MlxspecError(f"{model}: not a model directory (no config.json or GGUF file "
                               "in it)")
        return path
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(model)
    except HFValidationError:
        raise MlxspecError(f"{model}: no such model directory, and not a Hugging Face repo id") from None
    if model.startswith((".", "/", "~")):
        raise MlxspecError(f"{model}: no such model directory")
    cached = _local_snapshot(model)
    if cached is not None:
        return cached
    import os

    if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0"):
        raise MlxspecError(
            f"{model}: not in the local Hugging Face cache and HF_HUB_OFFLINE is set. "
            f"Download it first (`hf download {model}`) or pass a local model directory.")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(
            model, allow_patterns=["*.json", "*.safetensors", "*.py", "tokenizer.model",
                                   "*.tiktoken", "*.txt", "*.jinja"]))
    except Exception as e:
        raise MlxspecError(
            f"{model}: could not be downloaded ({type(e).__name__}) and is not in the local "
            f"Hugging Face cache. Download it on a machine with network access "
            f"(`hf download {model}`) or pass a local model directory.") from None


def load_model(model: str | None) -> tuple[nn.Module, Any, dict, str]:
    """(model, tokenizer, config, name) via mlx-lm; on the CPU backend computed in float32."""
    from mlx_lm.utils import load as mlx_lm_load

    path = resolve_model_path(model)
    try:
        net, tokenizer, config = mlx_lm_load(str(path), return_config=True)
    except (FileNotFoundError, ValueError) as e:
        raise MlxspecError(f"{model or path}: cannot load model: {e}") from None
    dtype = backend.compute_dtype()
    if dtype is not None:
        net.set_dtype(dtype)
    name = model if model is not None else f"bundled:{path.name}"
    return net, tokenizer, config, name


def vocab_size(model: nn.Module) -> int | None:
    args = getattr(model, "args", None)
    return getattr(args, "vocab_size", None)


def check_draft_compatible(target_tok, draft_tok, target_model, draft_model,
                           target_name: str, draft_name: str) -> None:
    tv, dv = vocab_size(target_model), vocab_size(draft_model)
    if tv is not None and dv is not None and tv != dv:
        raise MlxspecError(
            f"draft model {draft_name} has vocabulary size {dv} but target {target_name} has {tv}: "
            "a draft must share the target's tokenizer")
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise MlxspecError(
            f"draft model {draft_name} does not share the tokenizer of target {target_name} "
            "(their token strings differ)")


def check_fits_in_memory(paths: list[Path], context_tokens: int = 0) -> None:
    """On Metal, refuse models that do not fit in the recommended working set."""
    if backend.device_name() != "metal":
        return
    need = sum(f.stat().st_size for p in paths for f in p.glob("*.safetensors"))
    limit = mx.device_info()["max_recommended_working_set_size"]
    if need > limit:
        raise MlxspecError(
            f"the model weights need {need / 1e9:.1f} GB but Metal's recommended working set is "
            f"{limit / 1e9:.1f} GB: use a smaller or more quantized model "
            f"(at most about {limit / 1e9:.1f} GB of weights plus KV cache)")


def load_draft(source: str | Path, engine: Engine) -> nn.Module:
    """Load a draft model and check that it shares `engine`'s tokenizer (a draft trained by
    `mlxspec train --draft-for`: that it was trained for this target)."""
    from .reduced_draft import is_reduced_draft, load_reduced_draft

    if is_reduced_draft(source):
        return load_reduced_draft(source, engine.model, engine.tokenizer, engine.name)
    draft, draft_tok, _, draft_name = load_model(str(source))
    check_draft_compatible(engine.tokenizer, draft_tok, engine.model, draft, engine.name,
                           draft_name)
    return draft


def model_pair(model: str | None) -> tuple[str | None, Path | None]:
    """(model, the pair's draft): for a folder holding target/ and draft/ (what `mlxspec train
    --out` writes, as models/ ships) the target's folder and the draft's, used like the bundled
    pair; otherwise (model, None). A folder that looks meant as a pair but is not one is an
    error that says why."""
    from .models import describe_pair_problem, model_pair_paths

    pair = model_pair_paths(model)
    if pair is not None:
        return str(pair[0]), pair[1]
    if model and (problem := describe_pair_problem(model)):
        raise MlxspecError(problem)
    return model, None


def resolve_paths(model: str | None, draft: str | None, mode: str,
                  gguf_weights: str | None = None) -> tuple[str | None, Path, Path | None]:
    """(model, the target's folder, the draft's folder or None), for `load` and the sharded
    load: the draft given, else the pair's (`model_pair`), else the bundled draft with the
    bundled target, else one trained for the target (`mlxspec train --draft-for -m`); mode
    `draft` without one is an error."""
    model, pair_draft = model_pair(model)
    target_path = resolve_model_path(model, gguf_weights=gguf_weights)
    if draft is not None:
        return model, target_path, resolve_model_path(draft, gguf_weights=gguf_weights)
    if pair_draft is not None:
        return model, target_path, pair_draft
    if model is None:
        from .models import bundled_model_path

        try:
            return model, target_path, bundled_model_path("draft")
        except FileNotFoundError as e:
            if mode == "draft":
                raise MlxspecError(str(e)) from None
    elif (trained := trained_draft(model)) is not None:
        return model, target_path, trained
    elif mode == "draft":
        raise MlxspecError(f"mode '{mode}' needs a draft model (draft=..., --draft-model, or "
                           f"one trained for it: mlxspec train --draft-for -m {model})")
    return model, target_path, None


def load(model: str | None = None, *, mode: str = "none", draft: str | None = None,
         num_draft: int | None = None, max_context: int | None = None, adaptive: bool = False,
         gguf_weights: str | None = None, **mode_options) -> Engine:
    """Load a target (path, GGUF file, `ollama:NAME`, `smollm2`, repo id, or None for the
    bundled model) and an optional draft. `gguf_weights` ("auto", "quantized", "float32",
    "float16") sets how a GGUF file's weights are converted (default: float32 on the CPU
    backend, kept quantized on Metal and CUDA).

    With the bundled target and no `draft`, the bundled draft is loaded when a mode first needs
    it (`mode="draft"` now, or `set_mode("draft")` later), as `mlxspec chat`'s /mode does."""
    from .engine import Engine

    check_mode(mode)
    if num_draft is not None:
        check_num_draft(num_draft)
    if adaptive and mode == "none":
        raise MlxspecError("adaptive=True adapts k of a speculative mode, but mode 'none' never "
                           "speculates: pass mode='auto' (or another mode) with it")
    model, target_path, draft_path = resolve_paths(model, draft, mode, gguf_weights)
    check_fits_in_memory([p for p in (target_path, draft_path) if p is not None])
    # The resolved folder (a GGUF source's conversion), named as the user named it.
    net, tokenizer, config, name = load_model(str(target_path) if model else None)
    name = model or name
    # Engine settings (the KV-cache kind) go to the engine, the rest to the mode's proposer.
    engine_options = {k: mode_options.pop(k) for k in ("kv", "kv_group_size", "kv_buffer_size",
                                                      "prefill_step_size") if k in mode_options}
    engine = Engine(net, tokenizer, mode="none", num_draft=num_draft, config=config, name=name,
                    max_context=max_context, adaptive=adaptive, draft_source=draft_path,
                    **engine_options)
    if draft is not None:  # an explicit draft is loaded (and checked) now
        engine.draft_model = load_draft(draft_path, engine)
    engine.set_mode(mode, **mode_options)
    return engine


def trained_draft(model: str) -> Path | None:
    """A draft trained for `model` by `mlxspec train --draft-for` (shipped under models/drafts/
    or in the cache), unless MLXSPEC_NO_TRAINED_DRAFT is set."""
    import os

    if os.environ.get("MLXSPEC_NO_TRAINED_DRAFT", "") not in ("", "0"):
        return None
    from .reduced_draft import find_trained_draft

    return find_trained_draft(model)
