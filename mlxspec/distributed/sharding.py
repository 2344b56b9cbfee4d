"""Loading a sharded target: the strategy (tensor or pipeline parallel) an architecture
allows over the ranks, and `load`, `mlxspec.load` for a rank."""

from __future__ import annotations

import json

import mlx.core as mx

from ..errors import MlxspecError
from .engine import check_mode, engine_class
from .group import Coordinator, init_group

STRATEGIES = ("auto", "tensor", "pipeline")


def choose_strategy(config: dict, size: int, strategy: str) -> str:
    """'tensor' or 'pipeline' for this architecture over `size` ranks, or a clear refusal;
    needs only config.json (nothing is loaded)."""
    from mlx_lm.utils import _get_classes

    if strategy not in STRATEGIES:
        raise MlxspecError(f"--distributed must be one of {', '.join(STRATEGIES)}, "
                           f"got {strategy!r}")
    try:
        model_cls, args_cls = _get_classes(config)
    except ValueError as e:
        raise MlxspecError(f"cannot shard: {e}") from None
    model = model_cls(args_cls.from_dict(config))  # lazy: no weights are computed
    arch = config.get("model_type", "?")
    can_tensor = hasattr(model, "shard")
    can_pipe = hasattr(model, "model") and hasattr(model.model, "pipeline")
    if not can_tensor and not can_pipe:
        raise MlxspecError(
            f"architecture {arch!r} can be neither tensor- nor pipeline-sharded by mlx-lm (it has "
            "no shard() and no pipeline()): run it on one machine, or use an architecture such "
            "as llama, qwen2, qwen3, mistral or deepseek_v3")
    if strategy == "auto":
        strategy = "tensor" if can_tensor else "pipeline"
    if strategy == "tensor" and not can_tensor:
        raise MlxspecError(f"architecture {arch!r} has no tensor parallelism in mlx-lm: use "
                           "--distributed pipeline")
    if strategy == "pipeline" and not can_pipe:
        raise MlxspecError(f"architecture {arch!r} has no pipeline parallelism in mlx-lm: use "
                           "--distributed tensor")
    if strategy == "tensor":
        for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            value = config.get(field)
            if isinstance(value, int) and value % size:
                works = [n for n in range(2, value + 1) if value % n == 0 and all(
                    not isinstance(config.get(f), int) or config[f] % n == 0
                    for f in ("num_attention_heads", "num_key_value_heads", "intermediate_size"))]
                hint = (f"use {', '.join(map(str, works[:4]))} ranks" if works
                        else "no rank count divides it")
                if can_pipe:
                    hint += ", or --distributed pipeline"
                raise MlxspecError(f"{field} = {value} is not divisible by {size} ranks, so the "
                                   f"model cannot be tensor-sharded over them: {hint}")
    else:
        layers = config.get("num_hidden_layers", 0)
        if layers < size:
            raise MlxspecError(f"the model has {layers} layers, fewer than {size} ranks: "
                               "pipeline parallelism needs one layer per rank at least")
    return strategy


def load(model: str | None = None, *, mode: str = "none", draft: str | None = None,
         num_draft: int | None = None, strategy: str = "auto", adaptive: bool = False,
         max_context: int | None = None, coordinator: Coordinator | None = None,
         **mode_options):
    """`mlxspec.load` for a rank of a sharded run. With one process: exactly `load`."""
    from .. import backend, loading
    from ..policy import check_num_draft
    from ..proposers import check_mode as check_known_mode

    check_known_mode(mode)
    check_mode(mode)
    if num_draft is not None:
        check_num_draft(num_draft)
    group = coordinator.group if coordinator is not None else init_group()
    if group.size() == 1:
        return loading.load(model, mode=mode, draft=draft, num_draft=num_draft,
                            adaptive=adaptive, max_context=max_context, **mode_options)
    model, path, draft_path = loading.resolve_paths(model, draft, mode)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise MlxspecError(f"{path}: cannot read config.json: {e}") from None
    strategy = choose_strategy(config, group.size(), strategy)  # refused before loading
    net, tokenizer = sharded_load(path, group, strategy)
    dtype = backend.compute_dtype()
    if dtype is not None:
        net.set_dtype(dtype)
    coord = coordinator or Coordinator(group)
    coord.strategy = strategy
    name = model if model is not None else f"bundled:{path.name}"
    engine = engine_class()(net, tokenizer, mode="none", num_draft=num_draft, config=config,
                            name=name, max_context=max_context, adaptive=adaptive,
                            draft_source=draft_path, load_draft=loading.load_draft,
                            coordinator=coord)
    if draft_path is not None and mode in ("draft", "auto"):
        engine.draft_model = loading.load_draft(draft_path, engine)  # whole, on every rank
    engine.set_mode(mode, **mode_options)
    return engine


def sharded_load(path, group, strategy: str):
    """mlx-lm's `sharded_load`; a pipeline over a checkpoint without a weight index (one
    model.safetensors) is split the same way after a lazy load."""
    from mlx_lm.utils import load_model, load_tokenizer
    from mlx_lm.utils import sharded_load as mlx_sharded_load

    if strategy == "pipeline" and not (path / "model.safetensors.index.json").exists():
        net, config = load_model(path, lazy=True, strict=False)
        net.model.pipeline(group)
        mx.eval(net.parameters())
        tokenizer = load_tokenizer(path, {"trust_remote_code": True},
                                   eos_token_ids=config.get("eos_token_id", None))
        mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu, group=group))
        return net, tokenizer
    groups = {"tensor_group": group} if strategy == "tensor" else {"pipeline_group": group}
    try:
        return mlx_sharded_load(str(path), **groups)
    except ValueError as e:
        raise MlxspecError(f"{path}: cannot shard: {e}") from None
