"""The GGUF fixtures are right without any converter: the numpy reference over a tiny file
equals mlx-lm run on the HF-layout weights the file was made from."""

from __future__ import annotations

# conftest.py has already imported mlxspec (OpenBLAS before mlx.core).
import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf_fixtures import (
    ARCHS,
    hf_weights,
    llama_permute,
    read_tensors,
    reference_logits,
    write_tiny_gguf,
)

TOKENS = [1, 5, 7, 9, 11, 200, 3, 250, 42, 17]
DIMS = dict(vocab=300, hidden=64, heads=4, kv_heads=2, ffn=128)


def mlx_lm_config(arch: str, layers: int, tied: bool, **over) -> dict:
    """The mlx-lm config that matches what llama.cpp computes for a file of `arch`."""
    hd = DIMS["hidden"] // DIMS["heads"]
    cfg = {"model_type": arch, "hidden_size": DIMS["hidden"], "num_hidden_layers": layers,
           "intermediate_size": DIMS["ffn"], "num_attention_heads": DIMS["heads"],
           "num_key_value_heads": DIMS["kv_heads"], "vocab_size": DIMS["vocab"],
           "max_position_embeddings": 4096, "tie_word_embeddings": tied}
    if arch == "llama":
        cfg.update(rms_norm_eps=1e-5, rope_theta=10000.0, rope_traditional=False)
    elif arch in ("qwen2", "qwen3"):
        cfg.update(rms_norm_eps=1e-6, rope_theta=1e6, head_dim=hd)
    elif arch == "gemma3":
        # llama.cpp: global base = gemma3.rope.freq_base, local base 10000 (hard-coded), every
        # 6th layer global (il % 6 == 5), window = gemma3.attention.sliding_window, Q scaled by
        # 1/sqrt(key_length). mlx-lm reads the same from these fields.
        cfg.update(model_type="gemma3_text", rms_norm_eps=1e-6, rope_theta=1e6,
                   rope_local_base_freq=10000.0, head_dim=hd, query_pre_attn_scalar=hd,
                   sliding_window=4, sliding_window_pattern=6)
    cfg.update(over)
    return cfg


def mlx_lm_logits(cfg: dict, weights: dict[str, np.ndarray], tokens: list[int]) -> np.ndarray:
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    w = model.sanitize({k: mx.array(v) for k, v in weights.items()})
    model.load_weights(list(w.items()), strict=True)
    model.set_dtype(mx.float32)
    out = model(mx.array([tokens]))
    return np.array(out[0].astype(mx.float32))


@pytest.mark.parametrize("arch,layers,tied", [("llama", 2, True), ("llama", 2, False),
                                              ("qwen2", 2, True), ("qwen3", 2, False),
                                              ("gemma3", 7, True)])
def test_reference_equals_mlx_lm(tmp_path, arch, layers, tied):
    """F32 file through the numpy reference == mlx-lm on the HF weights the file came from.
    gemma3 with 7 layers and window 4 over 10 tokens: layers 0-4 and 6 slide, 5 is global."""
    kw = dict(DIMS, layers=layers, tied=tied, seed=3, scale=2.0)
    tok = "llama" if arch == "gemma3" else "gpt2"
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch, tokenizer=tok, **kw)
    ref = reference_logits(path, TOKENS)
    assert ref.shape == (len(TOKENS), DIMS["vocab"])
    got = mlx_lm_logits(mlx_lm_config(arch, layers, tied), hf_weights(arch, **kw), TOKENS)
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


def test_llama_permuted_weights_run_with_traditional_rope(tmp_path):
    """DESIGN §9: the file's permuted q/k weights run as they are under rope_traditional."""
    kw = dict(DIMS, layers=2, tied=True, seed=4)
    path = write_tiny_gguf(tmp_path / "llama.gguf", "llama", **kw)
    hf = hf_weights("llama", **kw)
    for i in range(2):
        q, k = f"model.layers.{i}.self_attn.q_proj.weight", f"model.layers.{i}.self_attn.k_proj.weight"
        hf[q] = llama_permute(hf[q], DIMS["heads"])
        hf[k] = llama_permute(hf[k], DIMS["kv_heads"])
    got = mlx_lm_logits(mlx_lm_config("llama", 2, True, rope_traditional=True), hf, TOKENS)
    np.testing.assert_allclose(got, reference_logits(path, TOKENS), atol=1e-4, rtol=0)


def test_file_layout_as_llama_cpp_writes_it(tmp_path):
    """Metadata keys, tensor names, types and GGUF (reversed) shapes."""
    path = write_tiny_gguf(tmp_path / "g.gguf", "gemma3", tensor_type="Q8_0", layers=2,
                           tokenizer="llama")
    r = gguf.GGUFReader(str(path))
    f = {k: v.contents() for k, v in r.fields.items() if not k.startswith("tokenizer.ggml.t")}
    assert f["general.architecture"] == "gemma3" and f["general.file_type"] == 7
    assert f["gemma3.attention.key_length"] == 16 and f["gemma3.attention.sliding_window"] == 4
    assert f["tokenizer.ggml.model"] == "llama" and f["tokenizer.ggml.add_space_prefix"] is False
    t = {x.name: x for x in r.tensors}
    assert "output.weight" not in t
    assert t["blk.0.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert list(t["blk.0.ffn_down.weight"].shape) == [128, 64]  # ne0 = in, ne1 = out
    assert t["blk.1.post_ffw_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    # The file holds gemma's norms as (w + 1).
    hf = hf_weights("gemma3", layers=2)
    W = read_tensors(r)
    np.testing.assert_allclose(W["blk.1.attn_k_norm.weight"],
                               hf["model.layers.1.self_attn.k_norm.weight"] + 1, atol=1e-6)
    q = gguf.GGUFReader(str(write_tiny_gguf(tmp_path / "q.gguf", "qwen2", tied=False)))
    names = {x.name for x in q.tensors}
    assert {"blk.0.attn_q.bias", "blk.0.attn_v.bias", "output.weight"} <= names
    vocab = q.fields["tokenizer.ggml.tokens"].contents()
    assert vocab[:3] == ["!", '"', "#"] and "<|im_end|>" in vocab and len(vocab) == 300


@pytest.mark.parametrize("qtype,bits", [("Q8_0", 8), ("Q4_0", 4), ("Q4_1", 4), ("Q5_0", None),
                                        ("F16", None)])
def test_quantized_files_and_mx_load(tmp_path, qtype, bits):
    """The reference dequantizes with gguf.quants; mx.load's affine triples (Q4_0, Q4_1, Q8_0)
    hold exactly those values (exact when dequantized in float32; mx.dequantize with the
    float16 scales computes in float16: within float16 rounding of the affine terms). mx.load (mlx 0.32) cannot read Q5_0 at all
    ("gguf_tensor_to_f16 failed"); F16 comes back as float16, exact."""
    path = write_tiny_gguf(tmp_path / f"{qtype}.gguf", "llama", tensor_type=qtype, seed=5)
    r = gguf.GGUFReader(str(path))
    W = read_tensors(r)
    for t in r.tensors:
        np.testing.assert_array_equal(
            W[t.name].ravel(), gguf.quants.dequantize(t.data, t.tensor_type).ravel())
    f32 = read_tensors(gguf.GGUFReader(str(write_tiny_gguf(tmp_path / "f.gguf", "llama",
                                                          seed=5))))
    for name, w in W.items():  # quantization error is bounded, so the file is that model
        assert np.abs(w - f32[name]).max() <= 0.15 * np.abs(f32[name]).max()
    if qtype == "Q5_0":
        with pytest.raises(RuntimeError):
            mx.load(str(path))
        return
    d = mx.load(str(path))
    for name, want in W.items():
        if bits is None or want.ndim == 1:
            np.testing.assert_array_equal(np.array(d[name].astype(mx.float32)), want)
            continue
        base = name[:-len(".weight")]
        w, s, b = d[name], d[base + ".scales"], d[base + ".biases"]
        assert s.dtype == mx.float16 and w.dtype == mx.uint32
        exact = mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=32,
                              bits=bits)
        np.testing.assert_array_equal(np.array(exact), want)
        half = np.array(mx.dequantize(w, s, b, group_size=32, bits=bits).astype(mx.float32))
        # float16 arithmetic on scale * q + bias: the error scales with the terms, which are
        # up to the tensor's largest magnitude, not with the (possibly small) result.
        np.testing.assert_allclose(half, want, rtol=0, atol=2 ** -9 * np.abs(want).max())


def test_scale_sharpens_logits(tmp_path):
    a = reference_logits(write_tiny_gguf(tmp_path / "a.gguf", "qwen3", scale=1.0), TOKENS)
    b = reference_logits(write_tiny_gguf(tmp_path / "b.gguf", "qwen3", scale=4.0), TOKENS)
    np.testing.assert_allclose(b, 4.0 * a, rtol=1e-5, atol=1e-6)


def test_smollm2_reference_answers_paris(smollm2_gguf):
    # "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    # tokenized once with a `tokenizers` BPE built from the file's own tokens and merges
    # (smollm pre-tokenizer); then "The capital of France is" (ids 504 3575 282 4649 314).
    prompt = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
    answer = [504, 3575, 282, 4649, 314]
    logits = reference_logits(smollm2_gguf, prompt + answer)
    greedy = logits[len(prompt) - 1:].argmax(-1).tolist()
    assert greedy[:-1] == answer  # teacher-forced greedy reproduces "The capital of France is"
    assert greedy[-1] == 7042  # " Paris"
    # Regression numbers (float64, stable): the top 5 after the first 8 tokens.
    row = logits[7]
    top = np.argsort(-row)[:5]
    assert top.tolist() == [4649, 933, 260, 1315, 4617]
    np.testing.assert_allclose(row[top], [11.8434, 11.7791, 11.6362, 11.3005, 10.8051], atol=2e-3)


def test_archs_listed():
    assert ARCHS == ("llama", "qwen2", "qwen3", "gemma3")


def test_gemma3_window_and_no_window(tmp_path):
    """The window hides keys p1 - p0 >= 4 on local layers only: against a window longer than the
    input, rows 0-3 are unchanged. A file without the key has no local layer (llama.cpp:
    LLAMA_SWA_TYPE_NONE, freq_base on every layer): that is mlx-lm's gemma3_text with
    sliding_window_pattern 1."""
    kw = dict(DIMS, layers=6, tied=True, seed=6, tokenizer="llama")
    win = reference_logits(write_tiny_gguf(tmp_path / "w.gguf", "gemma3", **kw), TOKENS)
    wide = write_tiny_gguf(tmp_path / "l.gguf", "gemma3", sliding_window=100, **kw)
    wide = reference_logits(wide, TOKENS)
    np.testing.assert_allclose(win[:4], wide[:4], atol=1e-9)
    assert np.abs(win[4:] - wide[4:]).max() > 1e-2
    path = write_tiny_gguf(tmp_path / "n.gguf", "gemma3", sliding_window=0, **kw)
    full = reference_logits(path, TOKENS)
    del kw["tokenizer"]
    cfg = mlx_lm_config("gemma3", 6, True, sliding_window_pattern=1)
    got = mlx_lm_logits(cfg, hf_weights("gemma3", **kw), TOKENS)
    np.testing.assert_allclose(got, full, atol=1e-4, rtol=0)
