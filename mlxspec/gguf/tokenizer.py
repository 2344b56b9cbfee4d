"""A Hugging Face `tokenizers` tokenizer built from a GGUF file's metadata.

transformers' own GGUF path imports torch, so the tokenizer is rebuilt here from
`tokenizer.ggml.*` keys with the `tokenizers` library, following what llama.cpp
(src/llama-vocab.cpp) does with the same keys: byte-level BPE for `gpt2` vocabularies
(pre-tokenizer chosen by `tokenizer.ggml.pre`), score-ordered BPE with byte fallback for
SentencePiece (`llama`) vocabularies. `write_tokenizer` writes tokenizer.json,
tokenizer_config.json and generation_config.json (the stop ids) into a folder that
`mlx_lm.load` / `mlx_lm.tokenizer_utils.load` read.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mlxspec.errors import MlxspecError

# llama.cpp's token types (gguf.TokenType)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# llama.cpp's regexes (src/llama-vocab.cpp). Case-insensitive contractions are spelled out
# as llama.cpp does ('[sS]'), because (?i:) in Oniguruma would also fold e.g. U+017F into 's'.
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3_RE = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = _LLAMA3_RE.replace(r"\p{N}{1,3}", r"\p{N}")
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_GPT4O_RE = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
             rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
             r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_RE = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
              r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK_CODER_RES = [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}"]
_FALCON_RES = [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_RE, "[0-9][0-9][0-9]"]

# `tokenizer.ggml.pre` tag -> (kind, regexes); the tag lists are llama.cpp's.
_GPT2_TAGS = {"default", "gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais", "jina-es", "jina-de",
              "jina-v2-es", "jina-v2-de", "jina-v1-en", "jina-v2-code", "roberta-bpe",
              "gigachat", "a.x-4.0", "mellum", "exaone4", "trillion", "granite-docling"}
_DIGITS_TAGS = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                "minerva-7b"}
_LLAMA3_TAGS = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                "midm-2.0", "lfm2"}
_QWEN2_TAGS = {"qwen2", "qwen2.5", "qwen-2.5", "deepseek-r1-qwen", "kormo", "megrez",
               "stablelm2", "hunyuan", "grok-2"}
_SPLIT_TAGS = {"chatglm-bpe": [_LLAMA3_RE], "glm4": [_LLAMA3_RE],
               "deepseek-coder": _DEEPSEEK_CODER_RES, "falcon": _FALCON_RES,
               "gpt-4o": [_GPT4O_RE], "llama4": [_GPT4O_RE], "tekken": [_TEKKEN_RE]}
# llama.cpp turns BPE merges off for these (a whole pre-token in the vocab is one id) and
# adds BOS by default.
_IGNORE_MERGES_TAGS = _LLAMA3_TAGS | {"tekken"}
_BOS_DEFAULT_TAGS = _LLAMA3_TAGS | {"tekken", "chameleon"}

# llama.cpp ends generation on these texts besides the eos/eot/eom ids (its EOG list).
_EOG_TEXTS = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
              "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>",
              "<end_of_utterance>"}

# llama.cpp finds these special tokens by their text where the file has no id for them
# (src/llama-vocab.cpp); the FIM pad, repository and file-separator tokens end generation too,
# so a fill-in-the-middle answer stops where the model starts another file.
_EOT_FIND = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
             "<|end_of_text|>", "<EOT>", "_<EOT>", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
_EOM_FIND = ("<|eom_id|>",)
_FIM_PAD_FIND = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>")
_FIM_REP_FIND = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
_FIM_SEP_FIND = ("<|file_sep|>",)

SUPPORTED_MODELS = ("gpt2", "llama")


def eog_token_ids(vocab: Mapping[str, int], ids: Mapping[str, int | None] | None = None
                  ) -> list[int]:
    """The ids that end generation, as llama.cpp computes its `special_eog_ids`: the FIM pad,
    repository and file-separator tokens, every token whose text is on its end-of-generation
    list, and the eos, eot and eom tokens. `ids`: the ids a GGUF file names (`eos`, `eot`,
    `eom`, `fim_pad`, `fim_rep`, `fim_sep`; None or missing: found by text as llama.cpp does).
    In that order: the named eos, eot, eom, the texts by id, the tokens found by text."""
    ids = dict(ids or {})
    out: list[int] = []

    def add(i: int | None) -> None:
        if i is not None and i not in out:
            out.append(i)

    for key in ("eos", "eot", "eom"):  # the ids the file names
        add(ids.get(key))
    for i in sorted(i for t, i in vocab.items() if t in _EOG_TEXTS):
        add(i)
    for key, texts in (("eot", _EOT_FIND), ("eom", _EOM_FIND), ("fim_pad", _FIM_PAD_FIND),
                       ("fim_rep", _FIM_REP_FIND), ("fim_sep", _FIM_SEP_FIND)):
        add(ids[key] if ids.get(key) is not None
            else next((vocab[t] for t in texts if t in vocab), None))
    # llama.cpp: with gpt-oss's <|return|> and <|call|>, <|end|> does not end generation
    if all(t in vocab and vocab[t] in out for t in ("<|return|>", "<|call|>", "<|end|>")):
        out.remove(vocab["<|end|>"])
    return out


def add_eog_tokens(tokenizer) -> list[int]:
    """Make llama.cpp's end-of-generation tokens (`eog_token_ids`) end generation for an
    mlx-lm tokenizer (a Hugging Face model's, or a converted GGUF file's); the ids added."""
    add = getattr(tokenizer, "add_eos_token", None)
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if add is None or get_vocab is None:
        return []
    have = set(getattr(tokenizer, "eos_token_ids", None) or [])
    added = []
    for i in eog_token_ids(get_vocab()):
        if i not in have:
            add(i)
            added.append(i)
    return added


def read_metadata(path: str | Path) -> dict[str, Any]:
    """Every key/value of a GGUF file's metadata as Python values (arrays as lists)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path), "r")
    except (OSError, ValueError) as e:
        raise MlxspecError(f"{path}: cannot read GGUF file: {e}") from None
    # GGUF.version / tensor_count / kv_count are the reader's header pseudo-fields, not keys.
    return {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("GGUF.")}


def stop_token_ids(meta: Mapping[str, Any]) -> list[int]:
    """The ids that end generation, as llama.cpp decides (`eog_token_ids`): eos first, then
    eot/eom, the tokens whose text is on llama.cpp's end-of-generation list (e.g.
    `<|im_end|>`), then the FIM pad, repository and file-separator tokens."""
    tokens = meta.get("tokenizer.ggml.tokens") or []
    ids: dict[str, int | None] = {}
    for key in ("eos", "eot", "eom", "fim_pad", "fim_rep", "fim_sep"):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        ids[key] = int(i) if i is not None and 0 <= int(i) < len(tokens) else None
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    return eog_token_ids(vocab, ids)


def write_tokenizer(meta: Mapping[str, Any], out_dir: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json (bos id, stop
    ids as `eos_token_id` list) for the GGUF metadata `meta` into `out_dir`."""
    tokenizer, config = build_tokenizer(meta)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    gen: dict[str, Any] = {"eos_token_id": stop_token_ids(meta)}
    if meta.get("tokenizer.ggml.bos_token_id") is not None:
        gen["bos_token_id"] = int(meta["tokenizer.ggml.bos_token_id"])
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def build_tokenizer(meta: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The `tokenizers.Tokenizer` and the tokenizer_config.json dict for `meta`."""
    from tokenizers import AddedToken, processors

    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise MlxspecError("GGUF file has no tokenizer metadata (tokenizer.ggml.tokens)")
    model = meta.get("tokenizer.ggml.model")
    if model is None:
        raise MlxspecError("GGUF file has no tokenizer metadata (tokenizer.ggml.model)")
    if model not in SUPPORTED_MODELS:
        raise MlxspecError(f"tokenizer model {model!r} is not supported "
                           f"(supported: {', '.join(SUPPORTED_MODELS)})")
    # llama.cpp names empty tokens this way; the vocab needs unique, non-empty keys.
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    seen: set[str] = set()
    for t in tokens:
        if t in seen:
            raise MlxspecError(f"GGUF tokenizer vocabulary has duplicate token {t!r}")
        seen.add(t)
    types = list(meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise MlxspecError(f"GGUF tokenizer.ggml.token_type has {len(types)} entries for "
                           f"{len(tokens)} tokens")
    # llama.cpp treats end-of-generation texts as control tokens whatever their type says.
    types = [_CONTROL if t in _EOG_TEXTS and ty != _CONTROL else ty
             for t, ty in zip(tokens, types)]

    def special_id(key: str, default: int | None = None) -> int | None:
        i = meta.get(f"tokenizer.ggml.{key}", default)
        return int(i) if i is not None and 0 <= int(i) < len(tokens) else None

    pre = meta.get("tokenizer.ggml.pre")
    if model == "gpt2":
        tok = _bpe_tokenizer(meta, tokens, pre)
        add_bos_default = pre in _BOS_DEFAULT_TAGS
        bos, eos, unk = special_id("bos_token_id"), special_id("eos_token_id"), None
    else:
        unk_default = next((i for i, ty in enumerate(types) if ty == _UNKNOWN), 0)
        unk = special_id("unknown_token_id", unk_default)
        tok = _spm_tokenizer(meta, tokens, types, unk)
        add_bos_default = True
        bos, eos = special_id("bos_token_id", 1), special_id("eos_token_id", 2)
    unk = special_id("unknown_token_id") if unk is None else unk
    pad = special_id("padding_token_id")

    # Control/unknown tokens match only as specials; user-defined ones are plain added tokens.
    # All match the raw text (normalized=False), as llama.cpp partitions the text before it
    # escapes whitespace; a space prefix then goes in front of the text after each one.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty in (_CONTROL, _UNKNOWN)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED])

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        # What transformers' update_post_processor builds from add_bos_token/add_eos_token.
        b = f"{tokens[bos]}:0 " if add_bos else ""
        e = f" {tokens[eos]}:0" if add_eos else ""
        b1 = f" {tokens[bos]}:1" if add_bos else ""
        e1 = f" {tokens[eos]}:1" if add_eos else ""
        used = ([bos] if add_bos else []) + ([eos] if add_eos and eos != bos else [])
        tok.post_processor = processors.TemplateProcessing(
            single=f"{b}$A:0{e}", pair=f"{b}$A:0{e}{b1} $B:1{e1}",
            special_tokens=[(tokens[i], i) for i in used])

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        # decode must give back the text exactly; llama.cpp's streaming pieces are not cleaned.
        "clean_up_tokenization_spaces": False,
    }
    for name, i in (("bos_token", bos), ("eos_token", eos), ("unk_token", unk),
                    ("pad_token", pad)):
        if i is not None:
            config[name] = tokens[i]
    arch = meta.get("general.architecture")
    ctx = meta.get(f"{arch}.context_length") if arch else None
    if ctx:
        config["model_max_length"] = int(ctx)
    template = _chat_template(meta)
    if template is not None:
        config["chat_template"] = template
    return tok, config


def _chat_template(meta: Mapping[str, Any]) -> str | list[dict[str, str]] | None:
    """`tokenizer.chat_template`, or transformers' named-template list when the file also
    has `tokenizer.chat_template.<name>` keys."""
    prefix = "tokenizer.chat_template."
    named = {k[len(prefix):]: v for k, v in meta.items() if k.startswith(prefix)}
    default = meta.get("tokenizer.chat_template")
    if not named:
        return default
    out = [{"name": "default", "template": default}] if default is not None else []
    return out + [{"name": n, "template": t} for n, t in named.items()]


def _bpe_tokenizer(meta: Mapping[str, Any], tokens: list[str], pre: str | None) -> Any:
    """Byte-level BPE (`tokenizer.ggml.model` gpt2) with the pre-tokenizer for `pre`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    merges_raw = meta.get("tokenizer.ggml.merges")
    if not merges_raw:
        raise MlxspecError("GGUF file has no tokenizer merges (tokenizer.ggml.merges)")
    merges = []
    for m in merges_raw:
        # llama.cpp splits at the first space after position 0 (a piece may be a lone space).
        k = m.find(" ", 1)
        if k < 0:
            raise MlxspecError(f"GGUF tokenizer merge {m!r} is not two pieces")
        merges.append((m[:k], m[k + 1:]))
    ignore = pre in _IGNORE_MERGES_TAGS
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                     ignore_merges=ignore)
    tok = Tokenizer(bpe)

    def split(regex: str) -> Any:
        return pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False)

    plain = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)
    if pre in _DIGITS_TAGS:
        # SmolLM2's / StarCoder's tokenizer.json: digits one by one, then GPT-2's regex.
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    elif pre in _LLAMA3_TAGS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([split(_LLAMA3_RE), plain])
    elif pre in _QWEN2_TAGS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([split(_QWEN2_RE), plain])
    elif pre in _SPLIT_TAGS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([split(r) for r in _SPLIT_TAGS[pre]]
                                                    + [plain])
    else:
        if pre is not None and pre not in _GPT2_TAGS:
            print(f"mlxspec: unknown GGUF pre-tokenizer {pre!r}: using GPT-2's regex",
                  file=sys.stderr)
        # add_space_prefix only makes sense here: ByteLevel would prepend the space to every
        # piece of an earlier Split, not once per text.
        prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix,
                                                     trim_offsets=True, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def _spm_tokenizer(meta: Mapping[str, Any], tokens: list[str], types: list[int],
                   unk: int | None) -> Any:
    """SentencePiece vocabulary (`llama`): BPE whose merges come from the scores."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise MlxspecError("GGUF SentencePiece tokenizer has no usable scores "
                           "(tokenizer.ggml.scores)")
    vocab = {t: i for i, t in enumerate(tokens)}
    # SentencePiece merges any two adjacent pieces whose concatenation is a piece, best score
    # first; as BPE merges (transformers' SentencePieceExtractor): every split of a piece into
    # two pieces, ranked by the merged piece's score. Control, byte, unused and user-defined
    # pieces are never produced by merging text (user-defined ones match the raw text first).
    skip = (_UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE)
    mergeable = {t for t, ty in zip(tokens, types) if ty not in skip}
    merges: list[tuple[float, int, int, int, str, str]] = []
    for t in mergeable:
        i = vocab[t]
        for k in range(1, len(t)):
            left, right = t[:k], t[k:]
            if left in mergeable and right in mergeable:
                merges.append((-float(scores[i]), i, vocab[left], vocab[right], left, right))
    merges.sort()
    unk_token = tokens[unk] if unk is not None else None
    bpe = models.BPE(vocab=vocab, merges=[(m[4], m[5]) for m in merges], unk_token=unk_token,
                     fuse_unk=True, byte_fallback=True)
    tok = Tokenizer(bpe)
    # llama.cpp: default true for SentencePiece vocabularies; Gemma's files set it false.
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    replace = normalizers.Replace(" ", "▁")
    tok.normalizer = (normalizers.Sequence([normalizers.Prepend("▁"), replace]) if prefix
                      else replace)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok
