"""What a model is, read cheaply from its files without loading it: its shape (layers, widths,
heads, parameters) and its tokenizer's identity, for a GGUF file or an mlx-lm / Hugging Face
folder. Used to pair a draft with a target by tokenizer and to estimate memory before loading.

GGUF headers are parsed here directly (the `gguf` package's reader parses every tensor and
array eagerly: seconds for a 150 k-token vocabulary; this reads only what is asked), and the
results are remembered in the cache per (path, size, mtime)."""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .errors import MlxspecError

# llama.cpp's token types (tokenizer.ggml.token_type).
_CONTROL, _USER_DEFINED, _UNUSED = 3, 4, 5
# llama.cpp pads a vocabulary to the embedding's rows with these (type UNUSED); a Hugging Face
# tokenizer of the same model has no such entries, and no text ever encodes to them.
_PAD = re.compile(r"\[PAD\d+\]")
# The texts llama.cpp treats as control tokens whatever their type says (see gguf/tokenizer.py).
_EOG_TEXTS = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
              "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>",
              "<end_of_utterance>"}
INFO_VERSION = 1  # bump when what is remembered changes


# ----------------------------------------------------------------------------- GGUF header

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# Bytes per block and elements per block of the GGML tensor types (for sizes only).
_GGML_BLOCKS = {0: (4, 1), 1: (2, 1), 2: (18, 32), 3: (20, 32), 6: (22, 32), 7: (24, 32),
                8: (34, 32), 9: (36, 32), 10: (84, 256), 11: (110, 256), 12: (144, 256),
                13: (176, 256), 14: (210, 256), 15: (292, 256), 30: (2, 1)}


class _Reader:
    def __init__(self, buf) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str):
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def skip_string(self) -> None:
        self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]

    def value(self, kind: int, keep: bool):
        if kind == _STRING:
            if keep:
                return self.string()
            self.skip_string()
            return None
        if kind == _ARRAY:
            item, n = self.take("<I"), self.take("<Q")
            if item in _SCALARS and not keep:
                self.pos += n * struct.calcsize(_SCALARS[item])
                return None
            if item in _SCALARS:
                fmt = _SCALARS[item]
                size = struct.calcsize(fmt)
                values = list(struct.unpack_from(f"<{n}{fmt[1]}", self.buf, self.pos))
                self.pos += n * size
                return values
            values = [self.value(item, keep) for _ in range(n)]
            return values if keep else None
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {kind}")
        return self.take(_SCALARS[kind])


def gguf_header(path: str | Path, keys: set[str] | None = None,
                tensors: bool = True) -> tuple[dict[str, Any], list[tuple[str, list[int], int]]]:
    """(metadata, tensors) of a GGUF file: the values of `keys` (every key but the arrays not
    asked for when given; every key when None) and each tensor's (name, shape, type)."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            r = _Reader(buf)
            if bytes(buf[:4]) != b"GGUF":
                raise MlxspecError(f"{path}: not a GGUF file (it does not start with 'GGUF')")
            r.pos = 4
            version = r.take("<I")
            if version < 2:
                raise MlxspecError(f"{path}: GGUF version {version} is not supported")
            n_tensors, n_kv = r.take("<Q"), r.take("<Q")
            meta: dict[str, Any] = {}
            for _ in range(n_kv):
                key = r.string()
                kind = r.take("<I")
                keep = keys is None or key in keys or kind != _ARRAY
                value = r.value(kind, keep)
                if keep:
                    meta[key] = value
            found = []
            if tensors:
                for _ in range(n_tensors):
                    name = r.string()
                    dims = [r.take("<Q") for _ in range(r.take("<I"))]
                    kind = r.take("<I")
                    r.take("<Q")  # offset
                    found.append((name, dims, kind))
            return meta, found
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as e:
        raise MlxspecError(f"{path}: cannot read the GGUF header: {e}") from None


def ggml_bytes(shape: list[int], kind: int) -> int:
    """Bytes a tensor of this GGML type takes stored (an estimate for unknown types)."""
    n = 1
    for d in shape:
        n *= d
    block, per = _GGML_BLOCKS.get(kind, (18, 32))
    return n * block // per


# ----------------------------------------------------------------------------- the shape


@dataclass(frozen=True)
class ModelInfo:
    """A model's shape and tokenizer, as read from its files.

    `params`: parameters (elements of every weight, quantized ones unpacked); `stored`:
    dtype name -> elements stored in it ("q4"/"q8" for quantized weights, "f16"/"bf16"/"f32");
    `tokenizer`: the identity of its tokenizer (`tokenizer_identity`), `vocab`: its real
    tokens, `architecture`: `model_type` (mlx-lm) / `general.architecture` (GGUF)."""

    architecture: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab_rows: int  # rows of the embedding (>= vocab: padded)
    context: int
    params: int
    stored: dict[str, int]
    tokenizer: str
    vocab: int
    quantized: bool  # the weights are kept quantized (a 4/8-bit MLX folder, a GGUF file)
    name: str = ""

    def to_json(self) -> dict:
        return asdict(self)


def identity(tokens: dict[int, str], added: set[int]) -> str:
    """The tokenizer identity: a hash of every real token (id -> text; llama.cpp's `[PADn]`
    fill ignored) and of which ids are added/special tokens. Two tokenizers with the same
    identity encode every text to the same ids and decode every id the same way."""
    h = hashlib.sha256()
    for i in sorted(tokens):
        t = tokens[i]
        if _PAD.fullmatch(t):
            continue
        h.update(f"{i}\t{t}\n".encode("utf-8", errors="surrogatepass"))
    h.update(("added:" + ",".join(str(i) for i in sorted(added))).encode())
    return h.hexdigest()[:32]


def _gguf_info(path: Path) -> ModelInfo:
    meta, tensors = gguf_header(path, keys={"tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                                             "general.name"})
    arch = meta.get("general.architecture") or "?"
    tokens = meta.get("tokenizer.ggml.tokens") or []
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    real = {i: t for i, (t, ty) in enumerate(zip(tokens, types)) if ty != _UNUSED}
    added = {i for i, (t, ty) in enumerate(zip(tokens, types))
             if ty in (_CONTROL, _USER_DEFINED) or t in _EOG_TEXTS}

    def get(key: str, default: int = 0) -> int:
        v = meta.get(f"{arch}.{key}", default)
        return int(v[0] if isinstance(v, list) else v)

    hidden, heads = get("embedding_length"), get("attention.head_count", 1)
    stored: dict[str, int] = {}
    params = 0
    rows = len(tokens)
    for name, shape, kind in tensors:
        n = 1
        for d in shape:
            n *= d
        params += n
        label = {0: "f32", 1: "f16", 30: "bf16"}.get(kind, "q8" if kind in (8, 9, 15) else "q4")
        stored[label] = stored.get(label, 0) + n
        if name == "token_embd.weight" and len(shape) == 2:
            rows = shape[1]
    return ModelInfo(
        architecture=arch, layers=get("block_count"), hidden=hidden, heads=heads,
        kv_heads=get("attention.head_count_kv", heads) or heads,
        head_dim=get("attention.key_length", hidden // max(heads, 1)),
        ffn=get("feed_forward_length"), vocab_rows=rows, context=get("context_length"),
        params=params, stored=stored, tokenizer=identity(real, added) if tokens else "",
        vocab=sum(1 for t in real.values() if not _PAD.fullmatch(t)), quantized=True,
        name=str(meta.get("general.name") or path.stem))


def _safetensors_dtypes(folder: Path) -> dict[str, int]:
    """dtype name -> elements, from the safetensors headers (the weights are not read)."""
    stored: dict[str, int] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
        for name, t in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for d in t["shape"]:
                count *= d
            dtype = t["dtype"].lower()
            stored[dtype] = stored.get(dtype, 0) + count
    return stored


def _folder_tokenizer(folder: Path) -> tuple[str, int]:
    path = folder / "tokenizer.json"
    if not path.is_file():
        return "", 0
    data = json.loads(path.read_text(encoding="utf-8"))
    vocab = (data.get("model") or {}).get("vocab") or {}
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        tokens = {i: v[0] for i, v in enumerate(vocab)}
    else:
        tokens = {int(i): t for t, i in vocab.items()}
    added = set()
    for a in data.get("added_tokens") or []:
        tokens[int(a["id"])] = a["content"]
        added.add(int(a["id"]))
    real = sum(1 for t in tokens.values() if not _PAD.fullmatch(t))
    return identity(tokens, added), real


def _folder_info(folder: Path) -> ModelInfo:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise MlxspecError(f"{folder}: unreadable config.json ({e})") from None
    text = config.get("text_config") or {}
    c = {**text, **config} if isinstance(text, dict) else config

    def get(*keys: str, default: int = 0) -> int:
        for k in keys:
            if c.get(k) is not None:
                return int(c[k])
        return default

    hidden, heads = get("hidden_size", "n_embd", "d_model"), get("num_attention_heads", default=1)
    layers = get("num_hidden_layers", "n_layer", "num_layers")
    ffn = get("intermediate_size")
    vocab_rows = get("vocab_size")
    kv_heads = get("num_key_value_heads", default=heads) or heads
    head_dim = get("head_dim", default=hidden // max(heads, 1))
    raw = _safetensors_dtypes(folder)
    quant = c.get("quantization") or c.get("quantization_config") or {}
    bits = int(quant.get("bits", 4)) if isinstance(quant, dict) else 4
    stored: dict[str, int] = {}
    for dtype, n in raw.items():
        if dtype in ("u32", "uint32", "u8", "uint8") and quant:
            stored[f"q{bits}"] = stored.get(f"q{bits}", 0) + n * (32 // bits if "32" in dtype
                                                                   else 8 // bits)
        else:
            key = {"f16": "f16", "float16": "f16", "bf16": "bf16", "f32": "f32",
                   "float32": "f32"}.get(dtype, dtype)
            stored[key] = stored.get(key, 0) + n
    if quant:  # scales and biases are bookkeeping, not parameters
        q = sum(v for k, v in stored.items() if k.startswith("q"))
        params = q + sum(v for k, v in stored.items() if not k.startswith("q")) - 2 * (
            q // int(quant.get("group_size", 64) if isinstance(quant, dict) else 64))
    else:
        params = sum(stored.values())
    if not params:  # no weights yet (an unfinished download): the shape's estimate
        params = shape_params(layers, hidden, heads, kv_heads, head_dim, ffn, vocab_rows,
                              bool(c.get("tie_word_embeddings", False)))
    tok, vocab = _folder_tokenizer(folder)
    return ModelInfo(
        architecture=str(c.get("model_type", "?")), layers=layers, hidden=hidden, heads=heads,
        kv_heads=kv_heads, head_dim=head_dim, ffn=ffn, vocab_rows=vocab_rows,
        context=get("max_position_embeddings"), params=params, stored=stored,
        tokenizer=tok, vocab=vocab, quantized=bool(quant), name=folder.name)


def shape_params(layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int,
                 vocab: int, tied: bool) -> int:
    """Parameters of a llama-like transformer of this shape (embeddings, attention with
    biases ignored, a gated MLP, norms)."""
    attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    per_layer = attn + 3 * hidden * ffn + 2 * hidden
    return vocab * hidden * (1 if tied else 2) + layers * per_layer + hidden


def _remembered() -> tuple[Path, dict]:
    from .gguf.sources import cache_root

    path = cache_root() / "model_info.json"
    try:
        data = json.loads(path.read_text())
        if data.get("version") != INFO_VERSION:
            data = {}
    except (OSError, ValueError):
        data = {}
    return path, data


def _stamp(path: Path) -> str:
    """What identifies a model's files' state: paths, sizes and mtimes of the files read."""
    files = [path] if path.is_file() else [path / "config.json", path / "tokenizer.json",
                                            *sorted(path.glob("*.safetensors"))]
    parts = []
    for f in files:
        try:
            st = f.stat()
            parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
        except OSError:
            parts.append(f"{f.name}:-")
    return "|".join(parts)


def model_info(path: str | Path) -> ModelInfo:
    """The ModelInfo of a GGUF file or a model folder (remembered in the cache, so a second
    call costs a stat)."""
    path = Path(path).expanduser().resolve()
    key, stamp = str(path), _stamp(path)
    store, data = _remembered()
    entry = data.get("models", {}).get(key)
    if entry and entry.get("stamp") == stamp:
        try:
            return ModelInfo(**entry["info"])
        except TypeError:
            pass
    info = _gguf_info(path) if path.is_file() else _folder_info(path)
    models = data.setdefault("models", {})
    models[key] = {"stamp": stamp, "info": info.to_json()}
    data["version"] = INFO_VERSION
    tmp = store.with_name(f".{store.name}.{os.getpid()}")
    try:  # remembered best-effort: a read-only cache only costs the reading again
        tmp.write_text(json.dumps(data))
        os.replace(tmp, store)
    except OSError:
        tmp.unlink(missing_ok=True)
    return info
