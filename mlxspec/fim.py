"""Fill-in-the-middle special tokens: which a model's vocabulary has (the server builds FIM
prompts from them; the suffix source reads a FIM request as the document it edits)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FimTokens:
    """A model family's fill-in-the-middle special tokens (ids), found in its vocabulary."""

    style: str
    prefix: int
    suffix: int
    middle: int
    file_sep: int | None = None
    repo_name: int | None = None
    suffix_first: bool = False  # SPM order: suffix before prefix


_FIM_STYLES = [
    # (style, prefix, suffix, middle, file separator, repo name, suffix first)
    ("qwen", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>",
     "<|repo_name|>", False),
    ("starcoder", "<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<file_sep>", "<reponame>",
     False),
    ("codellama", "▁<PRE>", "▁<SUF>", "▁<MID>", None, None, False),
    ("codellama", "<PRE>", "<SUF>", "<MID>", None, None, False),
    ("deepseek", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", None, None, False),
]


def detect_fim(vocab: dict[str, int]) -> FimTokens | None:
    """The FIM tokens of the first style whose prefix/suffix/middle tokens are all present."""
    for style, pre, suf, mid, sep, repo, spm in _FIM_STYLES:
        if pre in vocab and suf in vocab and mid in vocab:
            return FimTokens(style, vocab[pre], vocab[suf], vocab[mid],
                             vocab.get(sep) if sep else None, vocab.get(repo) if repo else None,
                             spm)
    return None
