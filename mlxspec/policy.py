"""How many tokens to propose per step. A policy object, so adaptive k can replace it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FixedK:
    """Always propose `num_draft` tokens (fewer near max_tokens)."""

    num_draft: int = 4

    def choose(self, source: str) -> int:
        return self.num_draft

    def observe(self, source: str, drafted: int, accepted: int, seconds: float) -> None:
        pass
