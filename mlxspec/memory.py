"""Will the pair fit? The weights as they will be loaded, the KV cache at the requested context
and the working set of a prefill chunk, estimated from the files before anything loads, against
the memory MLX can wire (Metal's recommended working set) or the memory available (CPU).

The estimate counts what MLX allocates (`mx.get_peak_memory()`); the process adds its runtime
(Python, the libraries, the tokenizers: `RUNTIME_BYTES`) on top, already resident when the check
runs. docs/MODELS.md gives the measured figures it was checked against."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

from .errors import MlxspecError
from .model_info import ModelInfo, model_info, shape_params

GB = 1e9
KV_STEP = 256  # mlx-lm's KVCache grows in steps of 256 tokens
RUNTIME_BYTES = 200_000_000  # Python, MLX, mlx-lm, two 150 k-token tokenizers (measured)


@dataclass(frozen=True)
class Estimate:
    """Bytes one model takes at a context: weights, KV cache, a prefill chunk's working set."""

    name: str
    weights: int
    kv: int
    work: int
    context: int
    quantized: bool

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.work

    @property
    def resident(self) -> int:
        """What stays allocated between forwards: weights and KV cache."""
        return self.weights + self.kv

    def describe(self, named: bool = True) -> str:
        return (f"{self.name + ' ' if named else ''}{self.weights / GB:.1f} GB weights + "
                f"{self.kv / GB:.2f} GB KV cache at {self.context} tokens")


def _act_bytes(info: ModelInfo, gpu: bool) -> int:
    """Bytes per activation/KV element: float32 on the CPU (the loader casts to it), else the
    weights' float type (float16/bfloat16 for MLX and converted quantized models)."""
    if not gpu:
        return 4
    return 4 if set(info.stored) <= {"f32"} else 2


def weights_bytes(info: ModelInfo, *, gpu: bool, gguf_weights: str | None = None,
                  is_gguf: bool = False) -> int:
    """The bytes of the weights once loaded: a folder's stored types (floats cast to float32 on
    the CPU backend), or a GGUF file's conversion in the `gguf_weights` form."""
    if is_gguf:
        from .gguf.convert import resolve_weights_mode

        mode = resolve_weights_mode(gguf_weights)
        if mode == "float32":
            return info.params * 4
        if mode == "float16":
            return info.params * 2
        # quantized: 4/8-bit MLX triples of group 32 (float16 scales and biases), floats kept
        q4, q8 = info.stored.get("q4", 0), info.stored.get("q8", 0)
        floats = info.params - q4 - q8
        return int(q4 * (0.5 + 4 / 32) + q8 * (1 + 4 / 32) + floats * 2)
    total = 0.0
    for kind, n in info.stored.items():
        if kind.startswith("q"):
            bits = int(kind[1:] or 4)
            total += n * bits / 8
        elif gpu:
            total += n * (4 if kind == "f32" else 2)
        else:
            total += n * 4
    if info.quantized and not gpu:  # scales/biases (stored as floats above) become float32
        total += sum(n for k, n in info.stored.items() if k.startswith("q")) * 2 * 2 / 64
    return int(total)


def kv_bytes(info: ModelInfo, context: int, act: int) -> int:
    """K and V of every layer at `context` tokens, in mlx-lm's 256-token steps."""
    tokens = math.ceil(max(context, 1) / KV_STEP) * KV_STEP
    return info.layers * 2 * info.kv_heads * info.head_dim * tokens * act


def work_bytes(info: ModelInfo, context: int, act: int, chunk: int, gpu: bool = False) -> int:
    """The working set of one prefill chunk at the end of the context: the attention scores
    (chunk x heads x context, materialized by the CPU backend's attention; Metal's fused
    attention kernel keeps them in tiles, not counted there), the MLP's three intermediates and
    a few hidden-state copies; the logits of one step."""
    chunk = max(1, min(chunk, context))
    scores = 0 if gpu else chunk * info.heads * context * act
    mlp = 3 * chunk * info.ffn * act
    hidden = 4 * chunk * info.hidden * act
    logits = 16 * info.vocab_rows * 4
    return scores + mlp + hidden + logits


def estimate(info: ModelInfo, context: int, *, gpu: bool, name: str = "",
             gguf_weights: str | None = None, is_gguf: bool = False,
             chunk: int = 2048) -> Estimate:
    """The Estimate for a model of `info` at `context` tokens."""
    act = _act_bytes(info, gpu) if not is_gguf else (
        4 if not gpu else 2)
    w = weights_bytes(info, gpu=gpu, gguf_weights=gguf_weights, is_gguf=is_gguf)
    return Estimate(name or info.name, w, kv_bytes(info, context, act),
                    work_bytes(info, context, act, chunk, gpu), context,
                    quantized=any(k.startswith("q") for k in info.stored) and (
                        not is_gguf or "quant" in str(gguf_weights or "")))


def info_for(source: str | Path) -> tuple[ModelInfo, bool] | None:
    """(ModelInfo, is a GGUF file still to convert) for a model folder, a GGUF file or a family
    name not fetched yet (its published shape); None where nothing is known."""
    from .hub import CODER_MODELS, QWEN25_TOKENIZER

    text = str(source)
    if text in CODER_MODELS:
        m = CODER_MODELS[text]
        from .hub import cached_sources

        for _, path in cached_sources(m):  # the copy that will load, when there is one
            try:
                return model_info(path), path.is_file()
            except (MlxspecError, OSError, ValueError, KeyError):
                continue
        layers, hidden, heads, kv, ffn, rows, tied = m.shape
        params = shape_params(layers, hidden, heads, kv, hidden // heads, ffn, rows, tied)
        info = ModelInfo(architecture="qwen2", layers=layers, hidden=hidden, heads=heads,
                         kv_heads=kv, head_dim=hidden // heads, ffn=ffn, vocab_rows=rows,
                         context=32768, params=params, stored={"q4": params},
                         tokenizer=QWEN25_TOKENIZER, vocab=151665, quantized=True, name=m.name)
        return info, True
    path = Path(text).expanduser()
    if path.is_file() or (path.is_dir() and (path / "config.json").is_file()):
        try:
            return model_info(path), path.is_file()
        except (MlxspecError, OSError, ValueError, KeyError):
            return None
    return None


def budget() -> tuple[int | None, str]:
    """(bytes the models may take, what that is): Metal's recommended working set (what MLX
    can wire), else the memory available now (Linux MemAvailable, macOS free + inactive)."""
    from . import backend

    if backend.device_name() == "metal":
        import mlx.core as mx

        try:
            info = mx.device_info()
        except AttributeError:  # older MLX
            info = mx.metal.device_info()
        return int(info["max_recommended_working_set_size"]), "Metal can wire"
    return available_memory(), "is available"


def available_memory() -> int | None:
    """Bytes of memory available now, None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:  # macOS: free + inactive pages
        import subprocess

        out = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=5).stdout
        page = int(out.split("page size of")[1].split()[0])
        pages = {k.strip(): int(v.strip().rstrip(".")) for k, v in
                 (ln.split(":", 1) for ln in out.splitlines()[1:] if ":" in ln)}
        return (pages.get("Pages free", 0) + pages.get("Pages inactive", 0)) * page
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def pair_total(target: Estimate, draft: Estimate | None) -> int:
    """The pair's peak: both models' weights and KV caches, and the larger of the two working
    sets (the target and the draft never run a forward at the same time)."""
    if draft is None:
        return target.total
    return target.resident + draft.resident + max(target.work, draft.work)


def check_pair(target: Estimate, draft: Estimate | None, limit: int | None, what: str,
               *, target_info: ModelInfo | None = None, draft_info: ModelInfo | None = None,
               gpu: bool = False) -> None:
    """Refuse a target (and draft) whose estimate exceeds `limit`, in one line naming what
    would fit: --no-draft, a smaller draft, a shorter --max-context, a 4-bit variant (each at
    the requested context, else with the longest --max-context at which it fits)."""
    need = pair_total(target, draft)
    if limit is None or need <= limit:
        return
    ctx = target.context
    act = _act_of(target, target_info)
    options = []

    def offer(label: str, weights: int, infos: list[ModelInfo], act: int = act) -> bool:
        """Add `label` if the pair so changed fits, at the context or a shorter one."""
        if target_info is None:
            return False
        fits = _longest(limit, weights, infos, target_info, act, ctx, gpu)
        if fits is None:
            return False
        total = _need(weights, infos, target_info, act, fits, gpu)
        options.append(label + (f" ({total / GB:.1f} GB)" if fits >= ctx else
                                f" with --max-context {fits} ({total / GB:.1f} GB)"))
        return True

    both = [i for i in (target_info, draft_info) if i is not None]
    if draft is not None:
        offer("--no-draft", target.weights, [target_info] if target_info else [])
        if draft_info is not None:
            smaller = _smaller_draft(draft_info)
            if smaller is not None:
                name, e = smaller
                offer(f"--draft-model {name}", target.weights + e.weights,
                      [target_info, smaller[1].info] if target_info else [])
    if target_info is not None:
        fits = _longest(limit, target.weights + (draft.weights if draft else 0), both,
                        target_info, act, ctx, gpu)
        if fits is not None:
            options.append(f"--max-context {fits}")
    if not target.quantized and target_info is not None:
        q_act = 2 if gpu else 4
        weights = int(target_info.params * 0.625) + (
            (int(draft_info.params * 0.625) if not draft.quantized else draft.weights)
            if draft is not None and draft_info is not None else 0)
        offer("a 4-bit variant (--gguf-weights quantized for a GGUF file, an MLX -4bit repo)",
              weights, both, q_act)
    # (the target is `what`, named already: its resolved path would read as a hash)
    parts = target.describe(named=False) + (f", draft {draft.describe()}" if draft else "")
    fits_text = ("what would fit: " + "; ".join(options)) if options else (
        "nothing smaller of these fits: use a smaller model")
    raise MlxspecError(f"{what} needs about {need / GB:.1f} GB ({parts}) but "
                       f"{limit / GB:.1f} GB {budget_word(gpu)}: {fits_text}")


def fitting_context(target: Estimate, draft: Estimate | None, target_info: ModelInfo,
                    draft_info: ModelInfo | None, limit: int, gpu: bool) -> int | None:
    """The longest context (a power of two from 1024) shorter than the estimate's at which the
    pair fits in `limit`; None if none does."""
    infos = [target_info] + ([draft_info] if draft is not None and draft_info else [])
    weights = target.weights + (draft.weights if draft is not None else 0)
    fits = _longest(limit, weights, infos, target_info, _act_of(target, target_info),
                    target.context, gpu)
    return fits if fits is not None and fits < target.context else None


def budget_word(gpu: bool) -> str:
    return "is what Metal can wire" if gpu else "of memory is available"


def _act_of(target: Estimate, info: ModelInfo | None) -> int:
    """The bytes per KV element the estimate used."""
    if info is None:
        return 4
    return max(1, target.kv // max(kv_bytes(info, target.context, 1), 1))


def _need(weights: int, infos: list[ModelInfo], target_info: ModelInfo, act: int, ctx: int,
          gpu: bool) -> int:
    """Weights plus every model's KV cache at `ctx`, plus the larger prefill working set."""
    work = max(work_bytes(i, ctx, act, 2048 if i is target_info else 512, gpu=gpu)
               for i in infos) if infos else 0
    return weights + sum(kv_bytes(i, ctx, act) for i in infos) + work


def _longest(limit: int, weights: int, infos: list[ModelInfo], target_info: ModelInfo,
             act: int, ctx: int, gpu: bool) -> int | None:
    """`ctx` if the models fit at it, else the longest power of two from 1024 below it at
    which they fit; None if none does."""
    if _need(weights, infos, target_info, act, ctx, gpu) <= limit:
        return ctx
    best, c = None, 1024
    while c < ctx:
        if _need(weights, infos, target_info, act, c, gpu) > limit:
            break
        best, c = c, c * 2
    return best


@dataclass(frozen=True)
class _Smaller:
    weights: int
    info: ModelInfo


def _smaller_draft(draft_info: ModelInfo) -> tuple[str, _Smaller] | None:
    """The smallest family member with the draft's tokenizer, if smaller than the draft."""
    from .hub import CODER_MODELS

    for name, m in sorted(CODER_MODELS.items(), key=lambda kv: kv[1].params):
        if m.params >= draft_info.params * 0.8:
            return None
        found = info_for(name)
        if found is None or found[0].tokenizer != draft_info.tokenizer:
            continue
        e = estimate(found[0], 1, gpu=False, is_gguf=found[1], chunk=512)
        return name, _Smaller(e.weights, found[0])
    return None


def measure(model: str, context: int, *, draft: bool = True, new_tokens: int = 48) -> dict:
    """Load `model` (with its default draft, mode `draft` at k = 4, unless `draft` is False),
    generate `new_tokens` after a prompt filling the context with mlxspec's own source, and
    return the estimate beside MLX's peak memory and the process's peak RSS."""
    import resource

    import mlx.core as mx

    from . import loading

    engine = loading.load(model, mode="draft" if draft else "none", num_draft=4,
                          max_context=context, no_draft=not draft)
    source = "".join(p.read_text() for p in sorted(Path(__file__).parent.glob("*.py")))
    prompt = engine.encode(source)[: context - new_tokens - 16]
    out = engine.generate(prompt, max_tokens=new_tokens)
    used = len(prompt) + len(out.tokens)
    draft_source = engine.draft_source if draft else None
    t, d, *_ = loading.estimate_pair(loading.resolve_model_path(model), draft_source, used)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss *= 1 if sys.platform == "darwin" else 1024  # bytes on macOS, kB on Linux
    est = pair_total(t, d)
    peak = mx.get_peak_memory()
    return {"model": model, "draft": str(draft_source) if draft_source else None,
            "context": used, "estimate": est, "estimate_parts": {
                "target": [t.weights, t.kv, t.work], "draft": [d.weights, d.kv, d.work]
                if d else None},
            "mx_peak": peak, "rss_peak": rss, "estimate_over_mx_peak": round(est / peak, 3),
            "estimate_over_rss_peak": round(est / rss, 3)}


if __name__ == "__main__":  # python -m mlxspec.memory MODEL CONTEXT [--no-draft]
    import json

    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    print(json.dumps(measure(args[0], int(args[1]) if len(args) > 1 else 4096,
                             draft="--no-draft" not in sys.argv), indent=1))
