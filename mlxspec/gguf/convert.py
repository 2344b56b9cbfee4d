"""A GGUF file → a plain mlx-lm model folder (config.json, model.safetensors, tokenizer files).

Everything that knows llama.cpp's layout lives here: the metadata → mlx-lm config mapping per
architecture, tensor names, llama's permuted Q/K rows (llama.cpp stores them for its interleaved
RoPE; we undo it so the folder is what mlx-lm would convert from Hugging Face), and Gemma's norm
weights (stored as 1 + w). Weights are written in one of three forms:

- "quantized": Q4_0, Q4_1 and Q8_0 kept as MLX affine triples (group 32, bits from the tensor, as
  `mx.load` reads them); F32/F16/BF16 as stored; other types dequantized with the `gguf` package
  and re-quantized (4 or 8 bits, group 32). The fast path on Metal and CUDA.
- "float32" / "float16": every tensor dequantized in numpy (exactly as ggml dequantizes). float32
  is the fast path on MLX's CPU backend, whose quantized matmul costs k× for k rows.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import MlxspecError

WEIGHTS_MODES = ("auto", "quantized", "float32", "float16")
# Bump when the folder written for the same file changes, so caches are rebuilt.
CONVERTER_VERSION = 1
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
# GGML types `mx.load` returns as MLX affine triples (group 32).
MLX_NATIVE_QUANTS = ("Q4_0", "Q4_1", "Q8_0")
FLOAT_TYPES = ("F32", "F16", "BF16")
MAGIC = b"GGUF"


def _say(message: str, quiet: bool) -> None:
    if not quiet:
        print(f"mlxspec: {message}", file=sys.stderr, flush=True)


def resolve_weights_mode(weights: str | None) -> str:
    """'auto' → float32 on the CPU backend, quantized elsewhere."""
    weights = weights or os.environ.get("MLXSPEC_GGUF_WEIGHTS") or "auto"
    if weights not in WEIGHTS_MODES:
        raise MlxspecError(f"GGUF weights must be one of {', '.join(WEIGHTS_MODES)}, "
                           f"got {weights!r}")
    if weights != "auto":
        return weights
    from ..backend import device_name

    return "float32" if device_name() == "cpu" else "quantized"


def is_gguf_file(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def open_gguf(path: Path):
    """A `gguf.GGUFReader`, with every failure of a bad file as one clear MlxspecError."""
    import gguf

    if not is_gguf_file(path):
        raise MlxspecError(f"{path}: not a GGUF file (it does not start with 'GGUF')")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # truncated headers raise whatever numpy's memmap raises
        raise MlxspecError(f"{path}: cannot read the GGUF file ({type(e).__name__}: {e}); "
                           "is it truncated or damaged?") from None
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise MlxspecError(f"{path}: truncated: tensor {t.name} ends at byte "
                               f"{t.data_offset + t.n_bytes} but the file has {size} bytes")
    return reader


def field_value(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return value


# ---------------------------------------------------------------- config


def model_config(reader, tensor_names: set[str]) -> dict:
    """The mlx-lm config.json of the file's architecture, from its metadata."""
    arch = field_value(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise MlxspecError(f"GGUF architecture {arch!r} is not supported (supported: "
                           f"{', '.join(SUPPORTED_ARCHS)})")

    def get(key: str, default: Any = None, required: bool = False) -> Any:
        value = field_value(reader, f"{arch}.{key}", default)
        if value is None and required:
            raise MlxspecError(f"GGUF file lacks the metadata key {arch}.{key}")
        return value

    heads = get("attention.head_count", required=True)
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(heads, list) or isinstance(kv_heads, list):
        raise MlxspecError("GGUF files with a different head count per layer are not supported")
    hidden = get("embedding_length", required=True)
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    vocab = int(embd.shape[-1])  # GGUF shapes are (in, out): the embedding's rows are last
    config = {
        "model_type": {"gemma3": "gemma3_text"}.get(arch, arch),
        "hidden_size": hidden,
        "num_hidden_layers": get("block_count", required=True),
        "intermediate_size": get("feed_forward_length", required=True),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "vocab_size": vocab if tokens is None else max(vocab, len(tokens)),
        "rope_theta": get("rope.freq_base", 10000.0),
        "max_position_embeddings": get("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    head_dim = get("attention.key_length", hidden // heads)
    if head_dim != hidden // heads or arch in ("qwen3", "gemma3"):
        config["head_dim"] = head_dim
    scaling = get("rope.scaling.type")
    if scaling in ("linear", "yarn") and get("rope.scaling.factor"):
        config["rope_scaling"] = {"type": scaling, "rope_type": scaling,
                                  "factor": get("rope.scaling.factor")}
        if scaling == "yarn":
            config["rope_scaling"]["original_max_position_embeddings"] = get(
                "rope.scaling.original_context_length", config["max_position_embeddings"])
    elif scaling not in (None, "none"):
        raise MlxspecError(f"GGUF rope scaling {scaling!r} is not supported (supported: "
                           "linear, yarn)")
    if arch == "llama" and "rope_freqs.weight" in tensor_names:
        config["rope_scaling"] = _llama3_rope_scaling(reader, config, head_dim)
    if arch == "qwen2":
        config["attention_bias"] = True  # qwen2 always has q/k/v biases
    if arch == "gemma3":
        window = get("attention.sliding_window") or 0
        if get("final_logit_softcapping") and not window:
            raise MlxspecError("Gemma 3 files with final_logit_softcapping are not supported")
        config.update({
            # llama.cpp hard-codes these for Gemma 3: every 6th layer global (none slides
            # without a window), local RoPE base 10 000, Q scaled by 1/sqrt(head_dim) except
            # the 62-layer 27B's 1/sqrt(hidden / heads).
            "sliding_window": window or config["max_position_embeddings"],
            "sliding_window_pattern": 6 if window else 1,
            "rope_local_base_freq": 10000.0,
            "query_pre_attn_scalar": (hidden // heads if config["num_hidden_layers"] == 62
                                      else head_dim),
        })
        config["rope_theta"] = get("rope.freq_base", 1_000_000.0)
    return config


def _llama3_rope_scaling(reader, config: dict, head_dim: int) -> dict:
    """Llama 3.1+ files carry the RoPE frequency factors as a tensor, not the parameters
    mlx-lm's llama3 RoPE takes: recover the parameters and check they give that tensor."""
    import gguf

    t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    factors = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64).reshape(-1)
    factor = float(factors.max())
    original = field_value(reader, "llama.rope.scaling.original_context_length", 8192)
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": original}
    # Llama 3's rule (mlx-lm's Llama3RoPE), as factors on the frequencies.
    freqs = config["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim)
    wavelens = 2 * np.pi * freqs
    low_wavelen = original / scaling["low_freq_factor"]
    high_wavelen = original / scaling["high_freq_factor"]
    expected = np.where(wavelens > low_wavelen, factor, 1.0)
    smooth = (original / wavelens - 1.0) / (4.0 - 1.0)
    medium = (wavelens <= low_wavelen) & (wavelens >= high_wavelen)
    expected = np.where(medium, 1.0 / ((1 - smooth) / factor + smooth), expected)
    if expected.shape != factors.shape or not np.allclose(expected, factors, rtol=1e-3):
        raise MlxspecError("GGUF rope_freqs tensor does not follow Llama 3's RoPE scaling: "
                           "this file's RoPE is not supported")
    return scaling


# ---------------------------------------------------------------- tensors

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GEMMA_LAYER_NAMES = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
              "output": "lm_head"}
_IGNORED = ("rope_freqs",)  # read into the config instead


def mlx_name(gguf_name: str, arch: str) -> str | None:
    """blk.3.attn_q.weight → model.layers.3.self_attn.q_proj.weight (None: not a weight)."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _IGNORED:
        return None
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk":
        names = {**_LAYER_NAMES, **_GEMMA_LAYER_NAMES} if arch == "gemma3" else _LAYER_NAMES
        if parts[2] in names:
            return f"model.layers.{parts[1]}.{names[parts[2]]}.{suffix}"
    raise MlxspecError(f"GGUF tensor {gguf_name!r} is not known for architecture {arch!r}")


def unpermute_rows(w, n_head: int):
    """Undo llama.cpp's `permute` of Q/K rows (for interleaved RoPE) on any array whose first
    axis is the output rows: a weight, its quantization scales/biases, a bias."""
    rows = w.shape[0]
    shaped = w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
    return shaped.swapaxes(1, 2).reshape(w.shape)


def _dequantized(t) -> np.ndarray:
    """A tensor in float32 and numpy's (out, in) order, as ggml dequantizes it."""
    import gguf

    try:
        data = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise MlxspecError(
            f"GGUF tensor {t.name} has type {t.tensor_type.name}, which cannot be dequantized "
            f"(supported: {', '.join(FLOAT_TYPES + MLX_NATIVE_QUANTS)}, Q5_0/Q5_1, the k-quants "
            "Q2_K-Q8_K and the IQ types the gguf package reads)") from None
    shape = tuple(int(d) for d in reversed(t.shape))
    return np.asarray(data, dtype=np.float32).reshape(shape)


def _requantized_bits(kind: str) -> int:
    """8 bits for types of 5 bits or more (Q5_K, Q6_K, ...), else 4: never below the file."""
    digits = [c for c in kind.split("_")[0] if c.isdigit()]
    return 8 if digits and int(digits[0]) >= 5 else 4


def _affine_triple(t) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_0, Q4_1 or Q8_0 tensor as MLX's affine (packed uint32, scales, biases), group 32,
    exactly (w = scale · code + bias), read from the raw blocks."""
    rows = int(t.shape[1]) if len(t.shape) > 1 else 1
    kind = t.tensor_type.name
    raw = np.asarray(t.data, dtype=np.uint8).reshape(rows, -1)
    block = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
    blocks = raw.reshape(rows, -1, block)
    d = blocks[..., :2].copy().view(np.float16)[..., 0]
    if kind == "Q8_0":
        codes = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        scales, biases = d, (d.astype(np.float32) * -128).astype(np.float16)
        packed = codes.reshape(rows, -1).view(np.uint32)  # 4 codes per word, element i at 8i
        return packed, scales, biases
    if kind == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
        nibbles = blocks[..., 4:]
        scales, biases = d, m
    else:
        nibbles = blocks[..., 2:]
        scales, biases = d, (d.astype(np.float32) * -8).astype(np.float16)
    # ggml: byte j holds element j (low nibble) and element j + 16 (high nibble)
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, -1, 8)
    shifts = np.arange(8, dtype=np.uint32) * 4
    packed = (codes.astype(np.uint32) << shifts).sum(axis=-1, dtype=np.uint32)
    return packed.reshape(rows, -1), scales, biases


def read_tensors(reader, weights: str, quiet: bool) -> dict[str, Any]:
    """GGUF name → mx.array (a quantized tensor as name.weight/.scales/.biases)."""
    import mlx.core as mx

    out: dict[str, Any] = {}
    if weights in ("float32", "float16"):
        dtype = mx.float32 if weights == "float32" else mx.float16
        for t in reader.tensors:
            out[t.name] = mx.array(_dequantized(t)).astype(dtype)
        return out
    requantized: dict[str, int] = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        stem = t.name.rpartition(".")[0]
        if kind in MLX_NATIVE_QUANTS:
            packed, scales, biases = _affine_triple(t)
            out[f"{stem}.weight"] = mx.array(packed)
            out[f"{stem}.scales"], out[f"{stem}.biases"] = mx.array(scales), mx.array(biases)
        elif kind in FLOAT_TYPES:
            w = _dequantized(t)
            out[t.name] = mx.array(w).astype(mx.float32 if kind == "F32" else mx.float16)
        else:
            w = mx.array(_dequantized(t))
            if w.ndim == 2 and w.shape[1] % 32 == 0:
                bits = _requantized_bits(kind)
                q, scales, biases = mx.quantize(w, group_size=32, bits=bits)
                out[f"{stem}.weight"], out[f"{stem}.scales"], out[f"{stem}.biases"] = (
                    q, scales.astype(mx.float16), biases.astype(mx.float16))
                requantized[f"{kind}→{bits}-bit"] = requantized.get(f"{kind}→{bits}-bit", 0) + 1
            else:
                out[t.name] = w.astype(mx.float16)
                requantized[f"{kind}→float16"] = requantized.get(f"{kind}→float16", 0) + 1
    if requantized:
        done = ", ".join(f"{n} × {k}" for k, n in sorted(requantized.items()))
        _say(f"GGUF tensors MLX cannot keep as stored were dequantized and re-quantized "
             f"(group 32): {done}", quiet)
    return out


def to_mlx_weights(tensors: dict[str, Any], config: dict, arch: str) -> dict[str, Any]:
    """Rename to mlx-lm's names; undo llama's Q/K permutation and Gemma's 1 + w norms."""
    import mlx.core as mx

    weights = {}
    for name, w in tensors.items():
        new = mlx_name(name, arch)
        if new is None:
            continue
        if arch == "llama":
            if ".attn_q." in name:
                w = unpermute_rows(w, config["num_attention_heads"])
            elif ".attn_k." in name:
                w = unpermute_rows(w, config["num_key_value_heads"])
        if arch == "gemma3" and "norm" in name and name.endswith(".weight"):
            w = w.astype(mx.float32) - 1.0
        weights[new] = w
    return weights


# ---------------------------------------------------------------- folders


def convert_gguf(src: str | os.PathLike, out: str | os.PathLike, *, weights: str = "auto",
                 quiet: bool = False) -> Path:
    """Write `src` (a GGUF file) as an mlx-lm model folder `out`; returns `out`."""
    import mlx.core as mx

    from .tokenizer import stop_token_ids, write_tokenizer

    src, out = Path(src), Path(out)
    weights = resolve_weights_mode(weights)
    reader = open_gguf(src)
    names = {t.name for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise MlxspecError(f"{src}: GGUF file has no token_embd.weight tensor: not a language "
                           "model")
    arch = field_value(reader, "general.architecture")
    config = model_config(reader, names)
    kinds = sorted({t.tensor_type.name for t in reader.tensors})
    _say(f"converting {src.name} ({arch}, {config['num_hidden_layers']} layers, "
         f"{'/'.join(kinds)}) to {weights} weights in {out}", quiet)
    start = time.perf_counter()
    meta = {k: field_value(reader, k) for k in reader.fields
            if k.startswith("tokenizer.") or k in ("general.architecture",
                                                   f"{arch}.context_length")}
    eos = stop_token_ids(meta)  # EOS and the end-of-turn tokens llama.cpp stops at
    if eos:
        config["eos_token_id"] = eos if len(eos) > 1 else eos[0]
    if meta.get("tokenizer.ggml.bos_token_id") is not None:
        config["bos_token_id"] = meta["tokenizer.ggml.bos_token_id"]
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write_tokenizer(meta, tmp)
        mlx_weights = to_mlx_weights(read_tensors(reader, weights, quiet), config, arch)
        if weights == "quantized" and any(k.endswith(".scales") for k in mlx_weights):
            config["quantization"] = {"group_size": 32, "bits": 4}  # bits per layer inferred
        mx.save_safetensors(str(tmp / "model.safetensors"), mlx_weights,
                            metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "source.json").write_text(json.dumps(
            {"source": str(src.resolve()), "weights": weights,
             "converter_version": CONVERTER_VERSION}, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _say(f"converted in {time.perf_counter() - start:.1f} s", quiet)
    return out


def file_sha256(path: Path) -> str:
    """The file's SHA-256, remembered per (path, size, mtime) so a second start reads nothing."""
    import hashlib

    from .sources import cache_root

    stat = path.stat()
    index_path = cache_root() / "gguf" / "hashes.json"
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    if key in index:
        return index[key]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    index[key] = digest.hexdigest()
    index_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = index_path.with_name(f"hashes.json.tmp{os.getpid()}")
    tmp.write_text(json.dumps(index, indent=1))
    tmp.replace(index_path)
    return index[key]


def cached_conversion(src: str | os.PathLike, *, weights: str | None = None,
                      quiet: bool = False) -> Path:
    """The mlx-lm folder converted from `src`, under the cache (keyed by the file's SHA-256 and
    the weights form); converted on first use."""
    from .sources import cache_root

    src = Path(src)
    if not is_gguf_file(src):  # before hashing it; the full checks run on converting
        raise MlxspecError(f"{src}: not a GGUF file (it does not start with 'GGUF')")
    weights = resolve_weights_mode(weights)
    key = f"{file_sha256(src)[:24]}-{weights}-v{CONVERTER_VERSION}"
    out = cache_root() / "gguf" / key
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    convert_gguf(src, out, weights=weights, quiet=quiet)
    return out
