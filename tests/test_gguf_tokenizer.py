"""mlxspec.gguf.tokenizer: tokenizer.json / tokenizer_config.json from GGUF metadata.

Small synthetic GGUF files (tokenizer metadata only) check each vocabulary type and
pre-tokenizer with id sequences derived by hand; SmolLM2's real file, when present, checks
the whole path through mlx-lm.
"""

from __future__ import annotations

import inspect
import json
import textwrap
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

from mlx_lm.tokenizer_utils import SPMStreamingDetokenizer, load  # noqa: E402

from mlxspec.errors import MlxspecError  # noqa: E402
from mlxspec.gguf.tokenizer import (  # noqa: E402
    read_metadata,
    stop_token_ids,
    write_tokenizer,
)

CONTROL, USER_DEFINED, NORMAL, BYTE, UNKNOWN = 3, 4, 1, 6, 2
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ROUND_TRIP = ["hello world", "  two  spaces\tand\ttabs\n\n\nlines  ", "héllo wörld — ünïcödé 日本語 🦙",
              "def f(x):\n    return x ** 2  # comment\n", "a 12 b 345 c6789", "", " "]


def write_gguf(path: Path, kv: dict) -> Path:
    """A GGUF file holding `kv` (tokenizer keys) and one dummy tensor."""
    w = gguf.GGUFWriter(str(path), "llama")
    for key, (kind, value) in kv.items():
        if kind == "str":
            w.add_string(key, value)
        elif kind == "u32":
            w.add_uint32(key, value)
        elif kind == "bool":
            w.add_bool(key, value)
        elif kind == "i32s":
            w.add_array(key, [int(v) for v in value])
        else:
            w.add_array(key, value)
    w.add_uint32("llama.context_length", 4096)
    w.add_tensor("dummy", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# -- byte-level BPE ("gpt2") --------------------------------------------------------------

BPE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BPE_MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d",
              "1 2", "Ġ 1"]


def bpe_vocab() -> tuple[list[str], list[int]]:
    from tokenizers.pre_tokenizers import ByteLevel

    tokens = BPE_SPECIALS + sorted(ByteLevel.alphabet())
    for m in BPE_MERGES:
        tokens.append(m.replace(" ", ""))
    tokens += ["Ġxyz", "<tool>"]  # Ġxyz: in the vocab but no merge builds it
    types = [CONTROL] * 3 + [NORMAL] * (len(tokens) - 4) + [USER_DEFINED]
    return tokens, types


def bpe_kv(pre: str | None, **extra) -> dict:
    tokens, types = bpe_vocab()
    kv = {"tokenizer.ggml.model": ("str", "gpt2"),
          "tokenizer.ggml.tokens": ("arr", tokens),
          "tokenizer.ggml.token_type": ("i32s", types),
          "tokenizer.ggml.merges": ("arr", BPE_MERGES),
          "tokenizer.ggml.bos_token_id": ("u32", 1),
          "tokenizer.ggml.eos_token_id": ("u32", 2),
          "tokenizer.ggml.padding_token_id": ("u32", 2),
          "tokenizer.chat_template": ("str", TEMPLATE)}
    if pre is not None:
        kv["tokenizer.ggml.pre"] = ("str", pre)
    kv.update(extra)
    return kv


def build(tmp_path: Path, kv: dict, name: str = "t"):
    meta = read_metadata(write_gguf(tmp_path / f"{name}.gguf", kv))
    out = tmp_path / name
    write_tokenizer(meta, out)
    return load(out), meta, out


def ids(tokens: list[str], *pieces: str) -> list[int]:
    return [tokens.index(p) for p in pieces]


def test_read_metadata_values(tmp_path):
    meta = read_metadata(write_gguf(tmp_path / "m.gguf", bpe_kv("smollm")))
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["tokenizer.ggml.merges"] == BPE_MERGES
    assert meta["tokenizer.ggml.token_type"][:4] == [3, 3, 3, 1]
    assert meta["tokenizer.ggml.bos_token_id"] == 1
    assert meta["llama.context_length"] == 4096
    assert not any(k.startswith("GGUF.") for k in meta)


def test_smollm_digits_one_by_one_and_specials(tmp_path):
    tok, meta, out = build(tmp_path, bpe_kv("smollm"))
    t, _ = bpe_vocab()
    assert tok.encode("hello world") == ids(t, "hello", "Ġworld")
    # "1 2" is a merge, but smollm splits digits first; " 1" stays apart from the digit
    assert tok.encode("12") == ids(t, "1", "2")
    assert tok.encode("a 12") == ids(t, "a", "Ġ", "1", "2")
    assert tok.encode(" xyz") == ids(t, "Ġ", "x", "y", "z")
    assert tok.encode("<|im_start|>hello<|im_end|>") == [1, *ids(t, "hello"), 2]
    assert tok.encode("<tool>hello") == ids(t, "<tool>", "hello")
    # no add_bos_token key: llama.cpp adds no BOS for byte-level vocabularies but llama3's
    assert tok.encode("hello")[0] != 1
    for s in ROUND_TRIP:
        assert tok.decode(tok.encode(s)) == s
    assert tok.decode([1, *ids(t, "hello"), 2], skip_special_tokens=True) == "hello"
    pre = json.loads((out / "tokenizer.json").read_text())["pre_tokenizer"]
    assert pre == {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
         "use_regex": True}]}


def test_llama_bpe_digit_groups_ignore_merges_and_bos(tmp_path):
    tok, _, _ = build(tmp_path, bpe_kv("llama-bpe"))
    t, _ = bpe_vocab()
    # llama3 regex: up to 3 digits together (then merged), no space before a digit run
    assert tok.encode("12", add_special_tokens=False) == ids(t, "12")
    assert tok.encode("a 12", add_special_tokens=False) == ids(t, "a", "Ġ", "12")
    # ignore_merges: a pre-token that is a vocab entry is one id even with no merge for it
    assert tok.encode(" xyz", add_special_tokens=False) == ids(t, "Ġxyz")
    # llama.cpp adds BOS by default for llama3 vocabularies
    assert tok.encode("hello") == [1, *ids(t, "hello")]
    for s in ROUND_TRIP:
        assert tok.decode(tok.encode(s, add_special_tokens=False)) == s


def test_qwen2_single_digits(tmp_path):
    tok, _, _ = build(tmp_path, bpe_kv("qwen2"))
    t, _ = bpe_vocab()
    assert tok.encode("12") == ids(t, "1", "2")
    assert tok.encode("a 12") == ids(t, "a", "Ġ", "1", "2")
    assert tok.encode(" xyz") == ids(t, "Ġ", "x", "y", "z")  # merges apply
    assert tok.encode("hello world") == ids(t, "hello", "Ġworld")
    for s in ROUND_TRIP:
        assert tok.decode(tok.encode(s)) == s


def test_gpt2_regex_for_default_and_unknown_tag(tmp_path, capsys):
    tok, _, _ = build(tmp_path, bpe_kv("gpt-2"), "gpt2")
    t, _ = bpe_vocab()
    assert tok.encode("12") == ids(t, "12")
    # " 12" is one pre-token; merge "1 2" ranks before "Ġ 1"
    assert tok.encode("a 12") == ids(t, "a", "Ġ", "12")
    tok2, _, _ = build(tmp_path, bpe_kv("no-such-pre"), "unknown")
    assert "unknown GGUF pre-tokenizer 'no-such-pre'" in capsys.readouterr().err
    assert tok2.encode("a 12") == tok.encode("a 12")


def test_bos_eos_flags_and_chat_template(tmp_path):
    kv = bpe_kv("smollm", **{"tokenizer.ggml.add_bos_token": ("bool", True),
                             "tokenizer.ggml.add_eos_token": ("bool", True)})
    tok, _, out = build(tmp_path, kv)
    t, _ = bpe_vocab()
    assert tok.encode("hello") == [1, *ids(t, "hello"), 2]
    assert tok.encode("hello", add_special_tokens=False) == ids(t, "hello")
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg["add_bos_token"] is True and cfg["add_eos_token"] is True
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"]) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert cfg["model_max_length"] == 4096 and cfg["chat_template"] == TEMPLATE
    msgs = [{"role": "user", "content": "hello"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    got = tok.apply_chat_template(msgs, add_generation_prompt=True)
    assert got[:2] == [1, *ids(t, "u")] and got.count(1) == 2 and 2 in got


def test_stop_ids_include_eot_and_reach_mlx_lm(tmp_path):
    tokens, types = bpe_vocab()
    tokens = tokens + ["<|eot_id|>", "<|eom_id|>"]
    types = types + [CONTROL, CONTROL]
    kv = bpe_kv("llama-bpe", **{"tokenizer.ggml.tokens": ("arr", tokens),
                                "tokenizer.ggml.token_type": ("i32s", types),
                                "tokenizer.ggml.eot_token_id": ("u32", len(tokens) - 2)})
    tok, meta, out = build(tmp_path, kv)
    eot, eom = len(tokens) - 2, len(tokens) - 1
    # eos, eot, then the texts llama.cpp ends generation on (<|endoftext|>=0, <|eom_id|>)
    assert stop_token_ids(meta) == [2, eot, 0, eom]
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen == {"eos_token_id": [2, eot, 0, eom], "bos_token_id": 1}
    # mlx_lm.load reads generation_config.json's eos_token_id over config.json's
    from mlx_lm.utils import load_config
    (out / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 2}))
    config = load_config(out)
    assert config["eos_token_id"] == [2, eot, 0, eom]
    assert load(out, eos_token_ids=config["eos_token_id"]).eos_token_ids == {2, eot, 0, eom}
    assert tok.encode("<|eot_id|>", add_special_tokens=False) == [eot]


def test_errors(tmp_path):
    kv = bpe_kv("smollm")
    del kv["tokenizer.ggml.tokens"]
    meta = read_metadata(write_gguf(tmp_path / "a.gguf", kv))
    with pytest.raises(MlxspecError, match=r"no tokenizer metadata \(tokenizer.ggml.tokens\)"):
        write_tokenizer(meta, tmp_path / "a")
    meta = read_metadata(write_gguf(tmp_path / "b.gguf", bpe_kv(
        None, **{"tokenizer.ggml.model": ("str", "rwkv")})))
    with pytest.raises(MlxspecError, match=r"tokenizer model 'rwkv' is not supported "
                                           r"\(supported: gpt2, llama\)"):
        write_tokenizer(meta, tmp_path / "b")
    kv = bpe_kv("smollm")
    del kv["tokenizer.ggml.merges"]
    meta = read_metadata(write_gguf(tmp_path / "c.gguf", kv))
    with pytest.raises(MlxspecError, match=r"tokenizer.ggml.merges"):
        write_tokenizer(meta, tmp_path / "c")
    with pytest.raises(MlxspecError, match="cannot read GGUF file"):
        read_metadata(tmp_path / "missing.gguf")
    with pytest.raises(MlxspecError, match="duplicate token 'a'"):
        write_tokenizer({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "a"],
                         "tokenizer.ggml.merges": ["a a"]}, tmp_path / "d")


# -- SentencePiece ("llama") ------------------------------------------------------------

# normal pieces, best score first
SPM_PIECES = ["▁hello", "▁world", "▁hell", "▁wor", "▁he", "▁h", "ll", "▁w", "or", "ld",
              "ab", "bc", "▁", "h", "e", "l", "o", "w", "r", "d", "a", "b", "c", "x"]


def spm_kv(*, prefix: bool | None = None, order: list[str] | None = None, **extra) -> dict:
    pieces = order or SPM_PIECES
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256
    scores = [0.0] * len(tokens)
    tokens += pieces
    types += [NORMAL] * len(pieces)
    scores += [-float(i) for i in range(len(pieces))]
    tokens += ["<start_of_turn>", "<end_of_turn>", "<tag>"]
    types += [CONTROL, CONTROL, USER_DEFINED]
    scores += [0.0] * 3
    kv = {"tokenizer.ggml.model": ("str", "llama"),
          "tokenizer.ggml.tokens": ("arr", tokens),
          "tokenizer.ggml.scores": ("arr", [float(s) for s in scores]),
          "tokenizer.ggml.token_type": ("i32s", types),
          "tokenizer.ggml.bos_token_id": ("u32", 1),
          "tokenizer.ggml.eos_token_id": ("u32", 2),
          "tokenizer.ggml.unknown_token_id": ("u32", 0),
          "tokenizer.ggml.eot_token_id": ("u32", tokens.index("<end_of_turn>"))}
    if prefix is not None:
        kv["tokenizer.ggml.add_space_prefix"] = ("bool", prefix)
    kv.update(extra)
    return kv


def test_spm_prefix_bos_bytes_and_specials(tmp_path):
    kv = spm_kv()
    tok, meta, out = build(tmp_path, kv)
    t = meta["tokenizer.ggml.tokens"]
    # llama.cpp's SentencePiece defaults: space prefix and BOS
    assert tok.encode("hello world") == [1, *ids(t, "▁hello", "▁world")]
    assert tok.encode("hello world", add_special_tokens=False) == ids(t, "▁hello", "▁world")
    # byte fallback: é and \n are not pieces
    assert tok.encode("é\n", add_special_tokens=False) == ids(t, "▁", "<0xC3>", "<0xA9>",
                                                              "<0x0A>")
    # control tokens are one id; the text after one gets a space prefix again (llama.cpp)
    got = tok.encode("<start_of_turn>hello<end_of_turn>", add_special_tokens=False)
    assert got == ids(t, "<start_of_turn>", "▁hello", "<end_of_turn>")
    assert tok.encode("<tag>world", add_special_tokens=False) == ids(t, "<tag>", "▁world")
    for s in ROUND_TRIP:
        assert tok.decode(tok.encode(s, add_special_tokens=False)) == s
        assert tok.decode(tok.encode(s), skip_special_tokens=True) == s
    assert isinstance(tok._detokenizer, SPMStreamingDetokenizer)
    assert stop_token_ids(meta) == [2, t.index("<end_of_turn>")]
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert (cfg["bos_token"], cfg["eos_token"], cfg["unk_token"]) == ("<s>", "</s>", "<unk>")
    assert cfg["add_bos_token"] is True


def test_spm_merge_order_follows_scores(tmp_path):
    tok, meta, _ = build(tmp_path, spm_kv(), "ab_first")
    t = meta["tokenizer.ggml.tokens"]
    assert tok.encode("abc", add_special_tokens=False) == ids(t, "▁", "ab", "c")
    order = [p for p in SPM_PIECES if p != "ab"]
    order.insert(order.index("bc") + 1, "ab")
    tok, meta, _ = build(tmp_path, spm_kv(order=order), "bc_first")
    t = meta["tokenizer.ggml.tokens"]
    assert tok.encode("abc", add_special_tokens=False) == ids(t, "▁", "a", "bc")


def test_spm_without_space_prefix(tmp_path):
    # Gemma's files set add_space_prefix false
    kv = spm_kv(prefix=False, **{"tokenizer.ggml.add_bos_token": ("bool", False)})
    tok, meta, out = build(tmp_path, kv)
    t = meta["tokenizer.ggml.tokens"]
    assert tok.encode("hello world") == ids(t, "h", "e", "ll", "o", "▁world")
    for s in ROUND_TRIP:
        assert tok.decode(tok.encode(s)) == s
    dec = json.loads((out / "tokenizer.json").read_text())["decoder"]
    assert [d["type"] for d in dec["decoders"]] == ["Replace", "ByteFallback", "Fuse"]


def spm_reference(text: str, tokens: list[str], scores: list[float]) -> list[int]:
    """llama.cpp's SentencePiece tokenizer (llm_tokenizer_spm), for normal pieces only:
    merge the adjacent pair whose concatenation is a piece with the best score (leftmost on
    ties) until none is left; a symbol that is no piece becomes its bytes."""
    vocab = {t: i for i, t in enumerate(tokens) if t in SPM_PIECES}
    syms = list(text)
    while True:
        best = None
        for k in range(len(syms) - 1):
            i = vocab.get(syms[k] + syms[k + 1])
            if i is not None and (best is None or scores[i] > scores[best[1]]):
                best = (k, i)
        if best is None:
            break
        k = best[0]
        syms[k:k + 2] = [syms[k] + syms[k + 1]]
    out = []
    for s in syms:
        if s in vocab:
            out.append(vocab[s])
        else:
            out += [tokens.index(f"<0x{b:02X}>") for b in s.encode()]
    return out


def test_spm_matches_llama_cpp_algorithm_on_random_text(tmp_path):
    tok, meta, _ = build(tmp_path, spm_kv())
    t, scores = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"]
    rng = np.random.default_rng(0)
    alphabet = list("abcdehlorwx ") + ["é", "\n", "ll", "or", "hello ", "world "]
    for _ in range(200):
        text = "".join(rng.choice(alphabet, size=int(rng.integers(1, 12))))
        want = spm_reference("▁" + text.replace(" ", "▁"), t, scores)
        assert tok.encode(text, add_special_tokens=False) == want, text


def test_spm_needs_scores(tmp_path):
    kv = spm_kv()
    del kv["tokenizer.ggml.scores"]
    meta = read_metadata(write_gguf(tmp_path / "s.gguf", kv))
    with pytest.raises(MlxspecError, match=r"tokenizer.ggml.scores"):
        write_tokenizer(meta, tmp_path / "s")


# -- SmolLM2's real file ----------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_tok(smollm2_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2")
    meta = read_metadata(smollm2_gguf)
    write_tokenizer(meta, out)
    return load(out), meta, out


def test_smollm2_specials_and_digits(smollm2_tok):
    tok, meta, out = smollm2_tok
    t = meta["tokenizer.ggml.tokens"]
    got = tok.encode("<|im_start|>user\nHello 12345<|im_end|>")
    assert got[0] == 1 and got[-1] == 2
    assert got[-6:-1] == [t.index(d) for d in "12345"]
    assert tok.decode(got) == "<|im_start|>user\nHello 12345<|im_end|>"
    # <|im_end|>, <|endoftext|>, then <reponame>: llama.cpp's FIM repository token (an EOG)
    assert stop_token_ids(meta) == [2, 0, 4]
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg["add_bos_token"] is False and cfg["eos_token"] == "<|im_end|>"
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}],
                                   add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")


def test_smollm2_round_trips_python_source(smollm2_tok):
    tok, _, _ = smollm2_tok
    src = "".join(inspect.getsource(textwrap).splitlines(keepends=True)[:400])
    ids_ = tok.encode(src)
    assert tok.decode(ids_) == src
    assert len(src) / len(ids_) > 2.5  # code compresses well in a code-trained vocab


def test_smollm2_english_token_count_plausible(smollm2_tok):
    tok, _, _ = smollm2_tok
    para = ("The committee met on Tuesday to discuss the budget for next year. After a long "
            "debate, the members agreed to increase funding for public libraries and to "
            "reduce spending on administrative travel, which had grown steadily since the "
            "previous review. A final report will be published in the spring.")
    n = len(tok.encode(para))
    assert 3.5 <= len(para) / n <= 6.0, (len(para), n)
