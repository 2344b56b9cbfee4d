"""Proposal sources, one module per mode, all behind the protocol in `base.py`."""

from __future__ import annotations

from ..errors import MlxspecError

MODES = ("none", "ngram", "draft", "quantspec", "lookahead", "suffix", "auto")


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise MlxspecError(f"unknown mode {mode!r}; choose one of: {', '.join(MODES)}")


def make_proposer(mode: str, model, draft_model=None, **options):
    """The proposer for `mode` (None for plain decoding)."""
    check_mode(mode)
    if mode == "none":
        return None
    if mode == "ngram":
        if options.pop("tree", False):
            from .ngram_tree import TreeNgramProposer

            return TreeNgramProposer(**options)
        from .ngram import NgramProposer

        return NgramProposer(**options)
    if mode == "draft":
        if draft_model is None:
            raise MlxspecError("mode 'draft' needs a draft model (--draft-model)")
        from .draft import DraftModelProposer

        return DraftModelProposer(draft_model, **options)
    if mode == "quantspec":
        from .quantspec import QuantSpecProposer

        return QuantSpecProposer(model, **options)
    if mode == "lookahead":
        from .lookahead import LookaheadProposer

        return LookaheadProposer(model, **options)
    if mode == "suffix":
        from .suffix import SuffixProposer

        return SuffixProposer(**options)
    if mode == "auto":
        from .auto import AutoProposer

        return AutoProposer(model, draft_model, **options)
    raise AssertionError(mode)  # every mode in MODES is handled above
