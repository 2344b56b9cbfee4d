"""Tiny GGUF model files written the way llama.cpp's convert_hf_to_gguf.py writes them, and an
independent numpy reference forward over any such file (no mlx, no mlx-lm).

What llama.cpp does, per architecture (read from convert_hf_to_gguf.py, src/llama-model.cpp,
src/llama-hparams.cpp, src/models/gemma3.cpp):

- llama: `LlamaModel.modify_tensors` permutes q_proj (n_head) and k_proj (n_head_kv) with
  `w.reshape(n_head, 2, out // n_head // 2, in).swapaxes(1, 2).reshape(out, in)`, because the
  llama graph uses RoPE type NORM (interleaved pairs (0,1),(2,3)...) where HF uses halves.
  Writes `llama.rope.dimension_count` = head_dim and `llama.vocab_size`.
- qwen2, qwen3, gemma3: RoPE type NEOX (halves), weights not permuted. qwen2 has q/k/v biases
  (`attn_q.bias`...). qwen3 writes `attention.key_length`/`value_length` (its config has
  head_dim) and has per-head `attn_q_norm`/`attn_k_norm`, applied before RoPE.
- gemma3: every tensor whose HF name ends in "norm.weight" (input/post_attention/
  pre_feedforward/post_feedforward layernorms, q_norm, k_norm, final norm) is written as
  (w + 1), since Gemma3RMSNorm computes x * (1 + w) and ggml's RMSNorm multiplies by the stored
  weight. The GGUF names are `attn_norm`, `post_attention_norm`, `ffn_norm`, `post_ffw_norm`,
  `attn_q_norm`, `attn_k_norm`, `output_norm`.
  Sliding window: the file only holds `gemma3.attention.sliding_window` (written unless the HF
  config's sliding_window_pattern is 1). The pattern is hard-coded in llama.cpp:
  `set_swa_pattern(6)` makes layer il local iff il % 6 < 5 (every sixth layer global). The mask
  is LLAMA_SWA_TYPE_STANDARD: key p0 is hidden from query p1 iff p1 - p0 >= n_swa. Without the
  key (or 0) no layer slides.
  RoPE bases: `gemma3.rope.freq_base` is the global base (HF rope_theta, 1e6); local layers use
  `rope_freq_base_train_swa = 10000.0`, hard-coded (HF rope_local_base_freq is not written).
  Attention scale: query_pre_attn_scalar is not written; llama.cpp scales Q by
  1/sqrt(key_length), except the 27B (62 layers) by 1/sqrt(n_embd / n_head), which equals
  query_pre_attn_scalar**-0.5 for every released Gemma 3. kq_scale is then 1.
  Embeddings are scaled by sqrt(n_embd) (float). FFN is GELU (ggml's tanh approximation) on
  the gate, times up. No attention softcap (the converter asserts attn_logit_softcapping is
  None). Final-logit softcap: the key `gemma3.final_logit_softcapping` is written only when the
  HF config sets it (no released Gemma 3 does), and the graph applies it only on the non-SWA
  path (a file without sliding_window); the SWA graph never soft-caps.

mlx-lm equivalents (checked in test_gguf_fixtures.py): llama -> `llama` with rope_traditional
False on HF (unpermuted) q/k, or True on the file's permuted q/k; qwen2/qwen3 -> same names;
gemma3 -> `gemma3_text` with norms (file - 1), rope_theta = freq_base, rope_local_base_freq
10000, sliding_window = the key, sliding_window_pattern 6 (1 when the file has no window),
query_pre_attn_scalar = key_length (n_embd / n_head for 62 layers). Two mlx-lm differences:
gemma3_text needs num_hidden_layers >= sliding_window_pattern (it indexes cache[pattern - 1]),
so a file of < 6 layers (all local in llama.cpp) has no exact mlx-lm config; and it rounds the
embedding scale sqrt(hidden) to bfloat16 (exact for hidden 64, not for e.g. 1152).
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np

ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
TENSOR_TYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0")

CHATML_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                   "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                   "{% endif %}")
GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>"
                  "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}"
                  "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
                  "{% endif %}")

# Per-arch defaults as the HF configs of these families have them.
_ROPE_BASE = {"llama": 10000.0, "qwen2": 1e6, "qwen3": 1e6, "gemma3": 1e6}
_RMS_EPS = {"llama": 1e-5, "qwen2": 1e-6, "qwen3": 1e-6, "gemma3": 1e-6}
_FILE_TYPE = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8}
GEMMA3_LOCAL_ROPE_BASE = 10000.0
GEMMA3_SWA_PATTERN = 6


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: HF (halves) rows -> interleaved-pair rows."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def hf_weights(arch: str, *, vocab: int = 300, hidden: int = 64, layers: int = 2, heads: int = 4,
               kv_heads: int = 2, ffn: int = 128, tied: bool = True, seed: int = 0,
               scale: float = 1.0) -> dict[str, np.ndarray]:
    """Random float32 weights in HF/mlx-lm naming and layout, (out, in) matrices.

    Gemma3 norms are HF's w (the model computes x * (1 + w)); the others' are the multiplier.
    `scale` multiplies the final norm's effective multiplier, so logits scale by it exactly
    (tied or not) without touching the quantized matrices."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}")
    rng = np.random.default_rng(seed)
    hd = hidden // heads

    def mat(out: int, inp: int) -> np.ndarray:
        return (rng.standard_normal((out, inp)) / math.sqrt(inp)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        # Gemma stores the offset from 1; the others the multiplier itself.
        w = 0.1 * rng.standard_normal(n)
        return (w if arch == "gemma3" else 1.0 + w).astype(np.float32)

    w: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": mat(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(hidden)
        w[p + "self_attn.q_proj.weight"] = mat(heads * hd, hidden)
        w[p + "self_attn.k_proj.weight"] = mat(kv_heads * hd, hidden)
        w[p + "self_attn.v_proj.weight"] = mat(kv_heads * hd, hidden)
        w[p + "self_attn.o_proj.weight"] = mat(hidden, heads * hd)
        if arch == "qwen2":
            for n, rows in (("q", heads * hd), ("k", kv_heads * hd), ("v", kv_heads * hd)):
                w[p + f"self_attn.{n}_proj.bias"] = (
                    0.1 * rng.standard_normal(rows)).astype(np.float32)
        if arch in ("qwen3", "gemma3"):
            w[p + "self_attn.q_norm.weight"] = norm(hd)
            w[p + "self_attn.k_norm.weight"] = norm(hd)
        w[p + "post_attention_layernorm.weight"] = norm(hidden)
        if arch == "gemma3":
            w[p + "pre_feedforward_layernorm.weight"] = norm(hidden)
            w[p + "post_feedforward_layernorm.weight"] = norm(hidden)
        w[p + "mlp.gate_proj.weight"] = mat(ffn, hidden)
        w[p + "mlp.up_proj.weight"] = mat(ffn, hidden)
        w[p + "mlp.down_proj.weight"] = mat(hidden, ffn)
    final = norm(hidden)
    if arch == "gemma3":
        final = (scale * (1.0 + final) - 1.0).astype(np.float32)
    else:
        final = (scale * final).astype(np.float32)
    w["model.norm.weight"] = final
    if not tied:
        w["lm_head.weight"] = mat(vocab, hidden)
    return w


def _gguf_tensors(arch: str, hf: dict[str, np.ndarray], heads: int,
                  kv_heads: int) -> dict[str, np.ndarray]:
    """HF names/layout -> GGUF names, with llama's q/k permutation and gemma3's norm + 1."""
    ffn_norm = "pre_feedforward_layernorm" if arch == "gemma3" else "post_attention_layernorm"
    names = {
        "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
        "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
        "self_attn.v_proj.bias": "attn_v.bias",
        "self_attn.q_norm.weight": "attn_q_norm.weight",
        "self_attn.k_norm.weight": "attn_k_norm.weight",
        "input_layernorm.weight": "attn_norm.weight",
        f"{ffn_norm}.weight": "ffn_norm.weight",
        "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    if arch == "gemma3":
        names["post_attention_layernorm.weight"] = "post_attention_norm.weight"
    out: dict[str, np.ndarray] = {}
    for name, t in hf.items():
        if name == "model.embed_tokens.weight":
            new = "token_embd.weight"
        elif name == "model.norm.weight":
            new = "output_norm.weight"
        elif name == "lm_head.weight":
            new = "output.weight"
        else:
            i, rest = name[len("model.layers."):].split(".", 1)
            new = f"blk.{i}.{names[rest]}"
        if arch == "llama" and new.endswith("attn_q.weight"):
            t = llama_permute(t, heads)
        elif arch == "llama" and new.endswith("attn_k.weight"):
            t = llama_permute(t, kv_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            t = t + 1.0
        out[new] = np.ascontiguousarray(t, dtype=np.float32)
    return out


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-unicode map, in GPT-2's vocabulary order."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _write_gpt2_vocab(w: gguf.GGUFWriter, vocab: int, chat_template: str | None) -> None:
    tokens = list(_bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "i n", "e r", "a n", "o n", "Ġ a", "r e", "Ġ s"]
    tokens += [m.replace(" ", "") for m in merges]
    types = [gguf.TokenType.NORMAL] * len(tokens)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    if vocab < len(tokens) + len(specials):
        raise ValueError(f"vocab {vocab} too small for the gpt2 tokenizer")
    tokens += specials
    types += [gguf.TokenType.CONTROL] * len(specials)
    # convert_hf_to_gguf pads the vocabulary to the model's rows the same way.
    for i in range(len(tokens), vocab):
        tokens.append(f"[PAD{i}]")
        types.append(gguf.TokenType.UNUSED)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(chat_template or CHATML_TEMPLATE)


def _write_spm_vocab(w: gguf.GGUFWriter, vocab: int, chat_template: str | None) -> None:
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    tokens = specials[:]
    types = [gguf.TokenType.CONTROL] * len(specials)
    types[3] = gguf.TokenType.UNKNOWN
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    scores = [0.0] * len(tokens)
    pieces = ["▁", "▁t", "▁a", "he", "▁the", "in", "er", "on"] + [chr(c) for c in range(97, 123)]
    if vocab < len(tokens):
        raise ValueError(f"vocab {vocab} too small for the llama tokenizer")
    for i, p in enumerate(pieces[:vocab - len(tokens)]):
        tokens.append(p)
        types.append(gguf.TokenType.NORMAL)
        scores.append(-float(i))
    for i in range(len(tokens), vocab):
        tokens.append(f"[PAD{i}]")
        types.append(gguf.TokenType.UNUSED)
        scores.append(-1000.0)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
    w.add_chat_template(chat_template or GEMMA_TEMPLATE)


def write_tiny_gguf(path: Path, arch: str, *, tensor_type: str = "F32", vocab: int = 300,
                    hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                    ffn: int = 128, tied: bool = True, seed: int = 0, scale: float = 1.0,
                    tokenizer: str = "gpt2", chat_template: str | None = None,
                    sliding_window: int = 4, context: int = 4096) -> Path:
    """Write a random-weight `arch` model as llama.cpp's converter (+ llama-quantize) would.

    The HF-layout weights are `hf_weights(arch, ...)` with the same arguments. `tensor_type`
    applies to the 2-D matrices (token_embd included); norms and biases stay F32.
    `sliding_window` is gemma3's (0: none written)."""
    if tensor_type not in TENSOR_TYPES:
        raise ValueError(f"tensor_type must be one of {TENSOR_TYPES}")
    hf = hf_weights(arch, vocab=vocab, hidden=hidden, layers=layers, heads=heads,
                    kv_heads=kv_heads, ffn=ffn, tied=tied, seed=seed, scale=scale)
    tensors = _gguf_tensors(arch, hf, heads, kv_heads)
    path = Path(path)
    hd = hidden // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(layers)
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(_ROPE_BASE[arch])
    w.add_layer_norm_rms_eps(_RMS_EPS[arch])
    if arch in ("qwen3", "gemma3"):
        w.add_key_length(hd)
        w.add_value_length(hd)
    if arch == "llama":
        w.add_vocab_size(vocab)
        w.add_rope_dimension_count(hd)
    if arch == "gemma3" and sliding_window:
        w.add_sliding_window(sliding_window)
    w.add_file_type(_FILE_TYPE[tensor_type])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if tokenizer == "gpt2":
        _write_gpt2_vocab(w, vocab, chat_template)
    elif tokenizer == "llama":
        _write_spm_vocab(w, vocab, chat_template)
    else:
        raise ValueError("tokenizer must be 'gpt2' or 'llama'")
    qtype = gguf.GGMLQuantizationType[tensor_type]
    for name, t in tensors.items():
        if t.ndim == 1 or tensor_type == "F32":
            w.add_tensor(name, t)
        elif tensor_type == "F16":
            w.add_tensor(name, t.astype(np.float16))
        else:
            # Bytes (rows, blocks * block_bytes); the writer derives the element shape.
            w.add_tensor(name, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---------------------------------------------------------------------------------------------
# Reference forward


def _field(reader: gguf.GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_tensors(reader: gguf.GGUFReader) -> dict[str, np.ndarray]:
    """Every tensor dequantized to float32, numpy (out, in) order (GGUF's shape reversed)."""
    out = {}
    for t in reader.tensors:
        a = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape))
        out[t.name] = np.asarray(a, dtype=np.float32).reshape(shape)
    return out


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, n_rot: int, base: float, neox: bool) -> np.ndarray:
    """x (T, H, D): RoPE over the first n_rot dims. NORM rotates (0,1),(2,3)...; NEOX rotates
    (i, i + n_rot/2)."""
    t = np.arange(x.shape[0], dtype=np.float64)[:, None]
    theta = t * base ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)  # (T, n_rot/2)
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    out = x.copy()
    if neox:
        a, b = x[..., :n_rot // 2], x[..., n_rot // 2:n_rot]
        out[..., :n_rot // 2] = a * cos - b * sin
        out[..., n_rot // 2:n_rot] = a * sin + b * cos
    else:
        a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        out[..., 0:n_rot:2] = a * cos - b * sin
        out[..., 1:n_rot:2] = a * sin + b * cos
    return out


def _linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    return x @ w.T if b is None else x @ w.T + b


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def reference_logits(path: Path, tokens: list[int]) -> np.ndarray:
    """Full causal forward (no cache) of a llama/qwen2/qwen3/gemma3 GGUF file in float64 numpy,
    every rule read from the file's metadata; returns (len(tokens), vocab) float64 logits."""
    r = gguf.GGUFReader(str(path))
    arch = _field(r, "general.architecture")
    if arch not in ARCHS:
        raise ValueError(f"reference_logits: unsupported architecture {arch!r}")

    def kv(key: str, default=None):
        return _field(r, f"{arch}.{key}", default)

    n_layer = int(kv("block_count"))
    n_embd = int(kv("embedding_length"))
    n_head = int(kv("attention.head_count"))
    n_head_kv = int(kv("attention.head_count_kv", n_head))
    head_k = int(kv("attention.key_length", n_embd // n_head))
    n_rot = int(kv("rope.dimension_count", head_k))
    eps = float(kv("attention.layer_norm_rms_epsilon"))
    base = float(kv("rope.freq_base", 10000.0))
    neox = arch != "llama"  # llama.cpp: LLAMA_ROPE_TYPE_NORM for llama, NEOX for the others
    n_swa = int(kv("attention.sliding_window", 0)) if arch == "gemma3" else 0
    softcap = float(kv("final_logit_softcapping", 0.0)) if arch == "gemma3" and not n_swa else 0.0
    if arch == "gemma3":
        # llama.cpp scales Q itself (f_attention_scale) and passes kq_scale 1.
        q_scale = (1.0 / math.sqrt(n_embd / n_head) if n_layer == 62
                   else 1.0 / math.sqrt(head_k))
    else:
        q_scale = 1.0 / math.sqrt(head_k)

    W = read_tensors(r)

    def g(name: str) -> np.ndarray | None:
        a = W.get(name)
        return None if a is None else a.astype(np.float64)

    T = len(tokens)
    x = g("token_embd.weight")[np.asarray(tokens)]
    if arch == "gemma3":
        x = x * math.sqrt(n_embd)
    pos = np.arange(T)
    causal = pos[None, :] <= pos[:, None]
    group = n_head // n_head_kv
    for il in range(n_layer):
        p = f"blk.{il}."
        local = bool(n_swa) and il % GEMMA3_SWA_PATTERN < GEMMA3_SWA_PATTERN - 1
        mask = causal & (pos[:, None] - pos[None, :] < n_swa) if local else causal
        base_l = GEMMA3_LOCAL_ROPE_BASE if local else base
        h = _rms(x, g(p + "attn_norm.weight"), eps)
        q, k, v = (_linear(h, g(p + f"attn_{n}.weight"), g(p + f"attn_{n}.bias")) for n in "qkv")
        q = q.reshape(T, n_head, head_k)
        k = k.reshape(T, n_head_kv, head_k)
        v = v.reshape(T, n_head_kv, -1)
        if (qn := g(p + "attn_q_norm.weight")) is not None:
            q = _rms(q, qn, eps)
        if (kn := g(p + "attn_k_norm.weight")) is not None:
            k = _rms(k, kn, eps)
        q = _rope(q, n_rot, base_l, neox) * q_scale
        k = _rope(k, n_rot, base_l, neox)
        att = np.empty((T, n_head, v.shape[-1]))
        for hh in range(n_head):
            kh = hh // group  # ggml broadcasts kv head hh // (n_head / n_head_kv)
            s = q[:, hh] @ k[:, kh].T
            s = np.where(mask, s, -np.inf)
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            att[:, hh] = (s / s.sum(axis=-1, keepdims=True)) @ v[:, kh]
        o = att.reshape(T, -1) @ g(p + "attn_output.weight").T
        if (pn := g(p + "post_attention_norm.weight")) is not None:
            o = _rms(o, pn, eps)
        x = x + o
        h = _rms(x, g(p + "ffn_norm.weight"), eps)
        gate = h @ g(p + "ffn_gate.weight").T
        act = _gelu_tanh(gate) if arch == "gemma3" else gate / (1.0 + np.exp(-gate))
        f = (act * (h @ g(p + "ffn_up.weight").T)) @ g(p + "ffn_down.weight").T
        if (pn := g(p + "post_ffw_norm.weight")) is not None:
            f = _rms(f, pn, eps)
        x = x + f
    x = _rms(x, g("output_norm.weight"), eps)
    head = W.get("output.weight")
    head = W["token_embd.weight"] if head is None else head
    logits = x @ head.astype(np.float64).T
    if softcap:
        logits = np.tanh(logits / softcap) * softcap
    return logits
