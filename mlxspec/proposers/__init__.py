"""Proposal sources, one module per mode, all behind the protocol in `base.py`."""

from __future__ import annotations

from ..errors import MlxspecError

MODES = ("none", "ngram", "draft", "quantspec", "lookahead", "auto")


def make_proposer(mode: str, model, draft_model=None, **options):
    """The proposer for `mode` (None for plain decoding)."""
    if mode == "none":
        return None
    if mode == "ngram":
        from .ngram import NgramProposer

        return NgramProposer(**options)
    if mode == "draft":
        if draft_model is None:
            raise MlxspecError("mode 'draft' needs a draft model (--draft-model)")
        from .draft import DraftModelProposer

        return DraftModelProposer(draft_model, **options)
    if mode == "quantspec":
        try:
            from .quantspec import QuantSpecProposer
        except ImportError:
            raise MlxspecError("mode 'quantspec' is not available in this build") from None
        return QuantSpecProposer(model, **options)
    if mode == "lookahead":
        try:
            from .lookahead import LookaheadProposer
        except ImportError:
            raise MlxspecError("mode 'lookahead' is not available in this build") from None
        return LookaheadProposer(model, **options)
    if mode == "auto":
        try:
            from .auto import AutoProposer
        except ImportError:
            raise MlxspecError("mode 'auto' is not available in this build") from None
        return AutoProposer(model, draft_model, **options)
    raise MlxspecError(f"unknown mode {mode!r}; choose one of: {', '.join(MODES)}")
