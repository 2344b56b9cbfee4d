"""The one small protocol every proposal source implements."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx

from ..sampling import SamplingParams


@dataclass
class Proposal:
    """Tokens proposed for the target to verify in one forward pass.

    `tokens` is a chain (each token follows the previous one) unless `parents` is given, in which
    case it is a tree in topological order and parents[i] is the index of node i's parent
    (-1: the last committed token). `draft_probs` is q for each token, after the same sampling
    transforms as p, shape (len(tokens), vocab); None means a deterministic proposal (q one-hot).
    """

    tokens: mx.array | list[int]
    draft_probs: mx.array | None = None
    parents: list[int] | None = None
    source: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.tokens) if isinstance(self.tokens, list) else int(self.tokens.size)


class Proposer(Protocol):
    """A mode. The engine calls reset once per generation, then propose/update once per step.

    Optional hook: `make_target_cache(model) -> list` when the target must use a cache the
    proposer provides (QuantSpec shares its hierarchical cache between draft and target).
    """

    name: str

    def reset(self, prompt: list[int], sampling: SamplingParams) -> None:
        """Start a generation; the target has prefilled all prompt tokens but the last."""

    def propose(self, context: list[int], num_draft: int, key: mx.array | None) -> Proposal | None:
        """Up to num_draft tokens to follow `context` (prompt + all committed tokens).

        Must leave any cache shared with the target as it found it. None or an empty proposal
        means "nothing worth verifying": the engine then takes a plain one-token step.
        """

    def update(self, context: list[int], num_accepted: int) -> None:
        """After verification: `context` is the committed sequence, `num_accepted` of the
        proposal's tokens were accepted. Roll back any private state past the accepted part."""
