"""The byte-level BPE tokenizer (the `tokenizers` library), saved in the Hugging Face format
that `mlx_lm.load` reads (tokenizer.json + tokenizer_config.json with a ChatML chat template)."""

from __future__ import annotations

import json
from pathlib import Path

from .corpus import CHAT_TEMPLATE, EOT, IM_END, SPECIAL_TOKENS


def train_tokenizer(docs: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def texts():
        for d in docs:
            for s in SPECIAL_TOKENS:
                d = d.replace(s, "\n")
            yield d

    tok.train_from_iterator(texts(), trainer=trainer, length=len(docs))
    return tok


def save_tokenizer(tok, out: Path, max_length: int) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOT,
        "pad_token": EOT,
        "unk_token": None,
        "additional_special_tokens": [s for s in SPECIAL_TOKENS if s != EOT],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps(
            {
                "eos_token": EOT,
                "pad_token": EOT,
                "additional_special_tokens": [s for s in SPECIAL_TOKENS if s != EOT],
            },
            indent=2,
        )
        + "\n"
    )


def eos_ids(tok) -> list[int]:
    return [tok.token_to_id(EOT), tok.token_to_id(IM_END)]
