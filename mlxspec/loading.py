"""Model resolution and loading: local directories, Hugging Face ids (the local cache first),
the bundled pair; draft compatibility and memory checks."""

from __future__ import annotations

from collections.abc import Callable
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
    """Refuse a draft whose tokenizer is not the target's, naming the difference."""
    tv, dv = vocab_size(target_model), vocab_size(draft_model)
    if tv is not None and dv is not None and tv != dv:
        raise MlxspecError(
            f"draft model {draft_name} has vocabulary size {dv} but target {target_name} has {tv}: "
            "a draft must share the target's tokenizer")
    target_vocab, draft_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    if target_vocab != draft_vocab:
        raise MlxspecError(
            f"draft model {draft_name} does not share the tokenizer of target {target_name}: "
            f"{tokenizer_difference(target_vocab, draft_vocab)}; a draft must share the target's "
            "tokenizer (--no-draft runs without one)")


def tokenizer_difference(target_vocab: dict[str, int], draft_vocab: dict[str, int]) -> str:
    """How two vocabularies (token string -> id) differ, in a few words."""
    target_ids = {i: t for t, i in target_vocab.items()}
    draft_ids = {i: t for t, i in draft_vocab.items()}
    differ = sorted(i for i in set(target_ids) | set(draft_ids)
                    if target_ids.get(i) != draft_ids.get(i))
    first = differ[0]
    return (f"{len(target_vocab)} against {len(draft_vocab)} tokens, {len(differ)} ids differ, "
            f"the first id {first}: {target_ids.get(first)!r} in the target, "
            f"{draft_ids.get(first)!r} in the draft")


def default_draft(model: str | None) -> str | None:
    """The named model a named target loads as its draft (`qwen2.5-coder-1.5b`: the 0.5B)."""
    from .gguf.sources import NAMED_MODELS

    named = NAMED_MODELS.get(model or "")
    return named.default_draft if named is not None else None


def weights_bytes(path: Path | str) -> int:
    """The bytes a model takes loaded: its folder's weights, or a named model's float32 size
    when it is not converted yet."""
    from .gguf.sources import NAMED_MODELS

    if str(path) in NAMED_MODELS:
        return NAMED_MODELS[str(path)].float32_bytes
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def available_memory() -> int | None:
    """Bytes of memory available now (Linux: MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def check_pair_fits(target_bytes: int, draft_bytes: int, target: str, draft: str | None) -> None:
    """On the CPU backend, refuse a target (and draft) that cannot fit in available memory."""
    if backend.device_name() == "metal":
        return  # check_fits_in_memory: Metal's working set
    free = available_memory()
    if free is None or target_bytes + draft_bytes <= free:
        return
    with_draft = f" and its draft {draft} {draft_bytes / 1e9:.1f} GB" if draft else ""
    hint = "; --no-draft runs without the draft" if draft else ""
    raise MlxspecError(
        f"{target} needs {target_bytes / 1e9:.1f} GB{with_draft} but {free / 1e9:.1f} GB of "
        f"memory is available: free some, or use a smaller model{hint}")


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
                  gguf_weights: str | None = None, no_draft: bool = False,
                  ) -> tuple[str | None, Path, Path | str | None]:
    """(model, the target's folder, the draft's folder or None), for `load` and the sharded
    load: the draft given, else the pair's (`model_pair`), else the bundled draft with the
    bundled target, else one trained for the target (`mlxspec train --draft-for -m`), else a
    named target's default draft (its name: fetched when a mode first uses it); mode `draft`
    without one is an error. `no_draft`: none at all."""
    if no_draft and draft is not None:
        raise MlxspecError("--no-draft and a draft model (--draft-model) contradict each other")
    if no_draft and mode == "draft":
        raise MlxspecError("mode 'draft' needs a draft model, and --no-draft turns it off")
    model, pair_draft = model_pair(model)
    target_path = resolve_model_path(model, gguf_weights=gguf_weights)
    if no_draft:
        return model, target_path, None
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
    elif (named := default_draft(model)) is not None:
        return model, target_path, named
    elif mode == "draft":
        raise MlxspecError(f"mode '{mode}' needs a draft model (draft=..., --draft-model, or "
                           f"one trained for it: mlxspec train --draft-for -m {model})")
    return model, target_path, None


def load(model: str | None = None, *, mode: str = "none", draft: str | None = None,
         num_draft: int | None = None, max_context: int | None = None, adaptive: bool = False,
         gguf_weights: str | None = None, no_draft: bool = False,
         announce: Callable[[str], None] | None = None, **mode_options) -> Engine:
    """Load a target (path, GGUF file, `ollama:NAME`, `smollm2`, repo id, or None for the
    bundled model) and an optional draft. `gguf_weights` ("auto", "quantized", "float32",
    "float16") sets how a GGUF file's weights are converted (default: float32 on the CPU
    backend, kept quantized on Metal and CUDA).

    With the bundled target and no `draft`, the bundled draft is loaded when a mode first needs
    it (`mode="draft"` now, or `set_mode("draft")` later), as `mlxspec chat`'s /mode does; so
    is a named target's default draft (`qwen2.5-coder-1.5b`: `qwen2.5-coder-0.5b`).
    `no_draft` (or MLXSPEC_NO_DRAFT=1, what `--no-draft` sets): no draft at all. `announce`
    gets one line saying what is loaded and the memory it takes, before loading."""
    from .engine import Engine

    check_mode(mode)
    if num_draft is not None:
        check_num_draft(num_draft)
    if adaptive and mode == "none":
        raise MlxspecError("adaptive=True adapts k of a speculative mode, but mode 'none' never "
                           "speculates: pass mode='auto' (or another mode) with it")
    import os

    no_draft = no_draft or os.environ.get("MLXSPEC_NO_DRAFT", "") not in ("", "0")
    model, target_path, draft_path = resolve_paths(model, draft, mode, gguf_weights, no_draft)
    check_fits_in_memory([Path(p) for p in (target_path, draft_path)
                          if p is not None and Path(p).is_dir()])
    drafting = draft_path is not None and (draft is not None or mode in ("draft", "auto"))
    target_bytes = weights_bytes(target_path)
    draft_bytes = weights_bytes(draft_path) if drafting else 0
    draft_name = (draft or (draft_path.name if isinstance(draft_path, Path) else draft_path)
                  if drafting else None)
    if announce is not None:
        with_draft = f" with the draft {draft_name} ({draft_bytes / 1e9:.1f} GB)" if drafting else ""
        announce(f"loading {model or 'the bundled model'} ({target_bytes / 1e9:.1f} GB)"
                 f"{with_draft}, backend {backend.device_name()}, BLAS {backend.blas_in_use}")
    check_pair_fits(target_bytes, draft_bytes, model or "the bundled model", draft_name)
    # The resolved folder (a GGUF source's conversion), named as the user named it.
    net, tokenizer, config, name = load_model(str(target_path) if model else None)
    name = model or name
    # Engine settings (the KV-cache kind) go to the engine, the rest to the mode's proposer.
    engine_options = {k: mode_options.pop(k) for k in ("kv", "kv_group_size", "kv_buffer_size",
                                                      "prefill_step_size") if k in mode_options}
    engine = Engine(net, tokenizer, mode="none", num_draft=num_draft, config=config, name=name,
                    max_context=max_context, adaptive=adaptive, draft_source=draft_path,
                    load_draft=load_draft, **engine_options)
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
