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
    chunk: int = 2048  # the prefill chunk its working set is counted at

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
                        not is_gguf or "quant" in str(gguf_weights or "")), chunk=chunk)


@dataclass(frozen=True)
class ServingMemory:
    """The server's memory (`server/worker.py` admits requests by it): the process's limit, the
    loaded weights, and what requests hold at their tokens (prompt + max_tokens): every
    model's KV cache in 256-token steps, and the working set of a prefill chunk (forwards run
    one at a time, so only the largest of the open requests' counts)."""

    limit: int
    source: str  # what the limit is: "the --memory-limit", "the control group's limit (FILE)"
    weights: int
    infos: tuple[ModelInfo, ...]  # the target's shape, then the draft's
    act: int  # bytes per KV element
    chunk: int  # the server's prefill chunk
    gpu: bool = False

    @property
    def margin(self) -> int:
        """Kept free: the runtime twice over (Python, the libraries, the tokenizer, OpenBLAS's
        buffers: 0.32 GB beside MLX's memory serving the 0.5B) and 5% for what is not
        counted."""
        return 2 * RUNTIME_BYTES + self.limit // 20

    @property
    def room(self) -> int:
        """The bytes requests and the prompt caches kept may take together."""
        return self.limit - self.margin - self.weights

    def kv(self, tokens: int) -> int:
        return sum(kv_bytes(i, tokens, self.act) for i in self.infos)

    def work(self, tokens: int) -> int:
        return max(work_bytes(i, tokens, self.act, self.chunk, self.gpu) for i in self.infos)

    def need(self, shared: list[int], own: list[int]) -> int:
        """What requests of these tokens hold: rows of the shared batch each as wide as its
        longest (the batch's buffers are), twice (a row joining copies them: the old and the
        new buffers, or its own cache and its row, are alive together); rows on caches of
        their own, their own; and the largest prefill working set."""
        kv = 2 * len(shared) * self.kv(max(shared, default=0)) + sum(self.kv(t) for t in own)
        return kv + max((self.work(t) for t in shared + own), default=0)

    def alone(self, tokens: int, shared: bool = True) -> int:
        """What a request of `tokens` needs with nothing else running."""
        return self.need([tokens], []) if shared else self.need([], [tokens])

    def longest_max_tokens(self, prompt: int, shared: bool = True) -> int:
        """The largest max_tokens with which a request of `prompt` tokens fits alone; -1 where
        its prompt alone does not."""
        def fits(tokens: int) -> bool:
            return self.alone(tokens, shared) <= self.room

        if not fits(prompt):
            return -1
        most, over = 0, KV_STEP
        while fits(prompt + over):
            most, over = over, over * 2
        while over - most > 1:
            mid = (most + over) // 2
            most, over = (mid, over) if fits(prompt + mid) else (most, mid)
        return most

    def describe(self) -> str:
        tokens = self.room // max(2 * self.kv(KV_STEP) // KV_STEP, 1)  # (`need`: twice)
        return (f"memory: limit {self.limit / GB:.1f} GB ({self.source}); "
                f"weights {self.weights / GB:.1f} GB, margin {self.margin / GB:.1f} GB: "
                f"{max(self.room, 0) / GB:.1f} GB for requests and prompt caches (about "
                f"{max(tokens, 0)} tokens of prompts + max_tokens of the requests running "
                f"together); more wait in the queue")


def serving_memory(engine, limit: int, source: str, chunk: int) -> ServingMemory:
    """The ServingMemory of a loaded engine under `limit` (`source`: what `budget` said of it):
    its weights as loaded (and its draft's, estimated where it loads on first use), the shapes
    from the models' configs."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from . import backend

    def loaded(model) -> tuple[int, ModelInfo]:
        params = [p for _, p in tree_flatten(model.parameters())]
        args = getattr(model, "args", None)  # mlx-lm's ModelArgs
        config = {**engine.config, **(vars(args) if args is not None else {})}
        return sum(p.nbytes for p in params), config_info(config, sum(p.size for p in params))

    weights, info = loaded(engine.model)
    infos = [info]
    if engine.draft_model is not None:
        w, d = loaded(engine.draft_model)
        weights, infos = weights + w, infos + [d]
    elif getattr(engine, "draft_source", None) is not None:
        found = info_for(engine.draft_source)
        if found is not None:
            weights += estimate(found[0], 1, gpu=False, is_gguf=found[1]).weights
            infos.append(found[0])
    gpu = backend.device_name() != "cpu"
    # (the CPU backend computes in float32; elsewhere half-precision weights mean a half cache)
    halves = (mx.float16, mx.bfloat16)
    act = 2 if gpu and any(p.dtype in halves for _, p in tree_flatten(
        engine.model.parameters())) else 4
    source = source.removeprefix("is ") if source.startswith("is ") else (
        "the memory available at start")
    return ServingMemory(limit, source, weights, tuple(infos), act, chunk, gpu)


def prompt_memory(engine, limit: int | None, source: str) -> ServingMemory | None:
    """The ServingMemory `generate`, `chat` and `edit` check their prompts by (`check_prompt`),
    computed once per engine: its prefill chunk, `limit` and `source` as `budget` gave them
    before loading. None where no limit is known or the engine holds no model of its own."""
    if limit is None or getattr(engine, "model", None) is None:
        return None
    return serving_memory(engine, limit, source, getattr(engine, "prefill_step_size", 2048))


def check_prompt(m: ServingMemory | None, prompt: int, max_tokens: int, *,
                 context: int | None = None, what: str = "this prompt",
                 flag: str = "--max-tokens", hint: str = "") -> None:
    """Refuse, before its prefill, a prompt of `prompt` tokens that with `max_tokens` more
    (within `context`) does not fit alone under `m`'s limit: the server's 400 for a request
    that cannot fit alone (`ServingMemory.alone` of a request on its own cache), as an
    MlxspecError naming the numbers, the longest `flag` that would fit, and `hint`."""
    if m is None:
        return
    if context:
        max_tokens = max(0, min(max_tokens, context - prompt))
    need = m.alone(prompt + max_tokens, shared=False)
    if need <= m.room:
        return
    longest = m.longest_max_tokens(prompt, shared=False)
    raise MlxspecError(
        f"{what} needs about {need / GB:.2f} GB ({prompt} prompt tokens + {flag} {max_tokens}: "
        f"KV cache and prefill working set) but the process leaves {max(m.room, 0) / GB:.2f} GB "
        f"for it (its {m.limit / GB:.1f} GB limit, {m.source}, less {m.weights / GB:.2f} GB of "
        f"weights and a {m.margin / GB:.2f} GB margin): "
        + (f"{flag} {longest} would fit" if longest >= 0 else "its prompt alone does not fit")
        + (f"; {hint}" if hint else ""))


def config_info(config: dict, params: int) -> ModelInfo:
    """A ModelInfo of the shape a model config gives (a loaded model's `args`)."""
    text = config.get("text_config") or {}
    c = {**text, **config} if isinstance(text, dict) else config

    def get(*keys: str, default: int = 0) -> int:
        return next((int(c[k]) for k in keys if c.get(k) is not None), default)

    hidden, heads = get("hidden_size", "n_embd", "d_model"), get("num_attention_heads", default=1)
    return ModelInfo(
        architecture=str(c.get("model_type", "?")), hidden=hidden, heads=heads,
        layers=get("num_hidden_layers", "n_layer", "num_layers"),
        kv_heads=get("num_key_value_heads", default=heads) or heads,
        head_dim=get("head_dim", default=hidden // max(heads, 1)),
        ffn=get("intermediate_size"), vocab_rows=get("vocab_size"),
        context=get("max_position_embeddings"), params=params, stored={}, tokenizer="",
        vocab=get("vocab_size"), quantized=False)


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


# Where the control groups are (tests point these at fake files).
PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")
NO_LIMIT = 1 << 60  # cgroup v1 says "no limit" with a number near 2**63
_limit_set: int | None = None  # --memory-limit


def set_limit(size: int | None) -> None:
    """--memory-limit: the figure `budget` gives from now on (None: detect it again)."""
    global _limit_set
    _limit_set = size


def budget() -> tuple[int | None, str]:
    """(bytes the process may take, what that figure is, as said after "N GB"): --memory-limit,
    else Metal's recommended working set (what MLX can wire), else the control group's limit
    where lower than the memory available now, else that (Linux MemAvailable, macOS free +
    inactive)."""
    from . import backend

    if _limit_set is not None:
        return _limit_set, "is the --memory-limit"
    if backend.device_name() == "metal":
        import mlx.core as mx

        try:
            info = mx.device_info()
        except AttributeError:  # older MLX
            info = mx.metal.device_info()
        return int(info["max_recommended_working_set_size"]), "is what Metal can wire"
    free, group = available_memory(), cgroup_limit()
    if group is not None and (free is None or group[0] < free):
        return group[0], f"is the control group's limit ({group[1]})"
    return free, "of memory is available"


def cgroup_limit() -> tuple[int, str] | None:
    """(bytes, file) of the lowest memory limit of the process's control group and the groups
    above it (v2 `memory.max`, v1 `memory.limit_in_bytes`); None where none is set."""
    try:
        lines = PROC_CGROUP.read_text().splitlines()
    except OSError:
        return None
    files = []
    for line in lines:
        _, controllers, group = line.split(":", 2)
        if controllers == "":  # v2: mounted at the root, or beside v1 as "unified"
            mounts, name = (CGROUP_ROOT, CGROUP_ROOT / "unified"), "memory.max"
        elif "memory" in controllers.split(","):
            mounts, name = (CGROUP_ROOT / "memory",), "memory.limit_in_bytes"
        else:
            continue
        for mount in mounts:
            folder = mount / group.strip("/")
            files += [f / name for f in (folder, *folder.parents) if f.is_relative_to(mount)]
    lowest = None
    for file in files:
        try:
            value = int(file.read_text().strip())
        except (OSError, ValueError):  # absent, or "max"
            continue
        if value < NO_LIMIT and (lowest is None or value < lowest[0]):
            lowest = (value, str(file))
    return lowest


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


PROC_STATM = Path("/proc/self/statm")


def resident_bytes() -> int | None:
    """The process's resident memory now (Linux), None where unknown."""
    import os

    try:
        return int(PROC_STATM.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def cgroup_anon() -> tuple[int, int] | None:
    """(anonymous memory charged, limit) of the control group whose limit is the process's
    (`cgroup_limit`): what every process of the group holds and the kernel cannot reclaim
    (v1 `total_rss`, v2 `anon` of `memory.stat`; the page cache, reclaimed first, left out);
    None where there is no limit."""
    found = cgroup_limit()
    if found is None:
        return None
    limit, file = found
    key = "total_rss" if file.endswith("limit_in_bytes") else "anon"
    try:
        for line in (Path(file).parent / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value), limit
    except (OSError, ValueError):
        pass
    return None


def shortfall(limit: int) -> int:
    """Bytes by which memory runs short now (<= 0: none; the server's worker pauses its newest
    rows while it does), against a reserve of 2.5% of `limit`: the process's resident memory
    (elsewhere: what MLX holds and the runtime) against `limit`, the anonymous memory of its
    control group (every process in it) against the group's limit, and the memory the system
    has available (another process took it). A few small /proc and /sys files (Linux)."""
    reserve = limit // 40
    used = resident_bytes()
    if used is None:
        import mlx.core as mx

        used = mx.get_active_memory() + mx.get_cache_memory() + RUNTIME_BYTES
    short = used + reserve - limit
    if PROC_STATM.exists():  # (macOS: a subprocess; no control groups)
        free, group = available_memory(), cgroup_anon()
        if free is not None:
            short = max(short, reserve - free)
        if group is not None:
            short = max(short, group[0] + reserve - group[1])
    return short


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
        fits = _longest(limit, weights, infos, target_info, act, ctx, gpu, target.chunk)
        if fits is None:
            return False
        total = _need(weights, infos, target_info, act, fits, gpu, target.chunk)
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
                        target_info, act, ctx, gpu, target.chunk)
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
                       f"{limit / GB:.1f} GB {budget()[1]}: {fits_text}")


def fitting_context(target: Estimate, draft: Estimate | None, target_info: ModelInfo,
                    draft_info: ModelInfo | None, limit: int, gpu: bool) -> int | None:
    """The longest context (a power of two from 1024) shorter than the estimate's at which the
    pair fits in `limit`; None if none does."""
    infos = [target_info] + ([draft_info] if draft is not None and draft_info else [])
    weights = target.weights + (draft.weights if draft is not None else 0)
    fits = _longest(limit, weights, infos, target_info, _act_of(target, target_info),
                    target.context, gpu, target.chunk)
    return fits if fits is not None and fits < target.context else None


def _act_of(target: Estimate, info: ModelInfo | None) -> int:
    """The bytes per KV element the estimate used."""
    if info is None:
        return 4
    return max(1, target.kv // max(kv_bytes(info, target.context, 1), 1))


def _need(weights: int, infos: list[ModelInfo], target_info: ModelInfo, act: int, ctx: int,
          gpu: bool, chunk: int) -> int:
    """Weights plus every model's KV cache at `ctx`, plus the larger prefill working set (the
    target's chunk `chunk`, a draft's 512)."""
    work = max(work_bytes(i, ctx, act, chunk if i is target_info else 512, gpu=gpu)
               for i in infos) if infos else 0
    return weights + sum(kv_bytes(i, ctx, act) for i in infos) + work


def _longest(limit: int, weights: int, infos: list[ModelInfo], target_info: ModelInfo,
             act: int, ctx: int, gpu: bool, chunk: int) -> int | None:
    """`ctx` if the models fit at it, else the longest power of two from 1024 below it at
    which they fit; None if none does."""
    if _need(weights, infos, target_info, act, ctx, gpu, chunk) <= limit:
        return ctx
    best, c = None, 1024
    while c < ctx:
        if _need(weights, infos, target_info, act, c, gpu, chunk) > limit:
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
