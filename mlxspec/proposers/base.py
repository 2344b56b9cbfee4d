"""The one small protocol every proposal source implements, with every hook declared."""

from __future__ import annotations

from ..proposal import Proposal
from ..sampling import SamplingParams

__all__ = ["Proposal", "Proposer"]


class Proposer:
    """A mode. The engine calls `reset` once per generation, then per step: `available` (what
    each source could propose now), the policy's `plan`, `propose` with the chosen source and
    k, one target forward, then `update`. Every hook has a default."""

    name = "base"
    # Proposals cost nothing to make (host lookups): the policy may see them before choosing k.
    cheap = True
    # Proposals are trees (need attention-only caches; see caches.check_tree_support).
    uses_trees = False
    # Prompt caches are reused only between proposers of the same kind.
    cache_kind = "kv"

    def make_target_cache(self, model) -> list | None:
        """A cache the target must use instead of its own (QuantSpec shares its hierarchical
        cache between draft and target); None: the target's ordinary cache."""
        return None

    def bind_cache(self, cache: list) -> None:
        """The target's cache for this generation, after prefill."""

    def set_prediction(self, tokens: list[int] | None) -> None:
        """A predicted output to copy from in the next generation (ignored by most modes)."""

    def reset(self, prompt: list[int], sampling: SamplingParams) -> None:
        """Start a generation; the target has prefilled all prompt tokens but the last."""

    def available(self, context: list[int], cap: int) -> dict[str, int]:
        """Per source, how many tokens it could propose now (at most `cap`). The keys are the
        policy's arms, handed back to `propose` as `source`: a source may split its offers by
        quality (`ngram:4` for a 4-gram match) so that each gets its own estimates. Called
        after every token of a plain stretch too: keep it cheap (host lookups)."""
        return {self.name: cap}

    def propose(self, context: list[int], num_draft: int, seed: int | None,
                source: str | None = None) -> Proposal | None:
        """Up to num_draft tokens to follow `context` (prompt + all committed tokens), from
        `source` (one of `available`'s keys; None: the proposer's own choice).

        Must leave any cache shared with the target as it found it. None or an empty proposal
        means "nothing worth verifying": the engine then takes a plain step."""
        return None

    def peek(self, context: list[int], num_draft: int, source: str) -> list[int] | None:
        """The tokens `propose` would return from `source` now, on the host, where that costs
        nothing (a lookup); None otherwise (a model's draft). The batched step compares them
        with what the row then commits, to keep measuring a source it does not propose from
        (`RowPolicy.watch`)."""
        return None

    def update(self, context: list[int], num_accepted: int) -> None:
        """After verification: `context` is the committed sequence, `num_accepted` of the
        proposal's tokens were accepted. Roll back any private state past the accepted part.
        Also called (num_accepted = 0, no proposal) after every token of a plain stretch."""

    def finish(self) -> None:
        """The generation has ended (its last `update` had the committed sequence): a source
        that learns across requests (`suffix`) keeps its text now. Also done, for the previous
        generation, by the next `reset`."""

    def stats(self) -> dict:
        return {}
