"""Per-generation statistics: what every mode reports."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

# A step's kind in the account of the decoding time: "plain" (nothing proposed), "accepted"
# (a proposal of which at least one token was accepted), "rejected" (all rejected), "probe" (a
# proposal from an arm the policy had switched off, tried to see whether it pays again), and
# "catch-up" (a draft model reading context it skipped before proposing: time, no tokens).
STEP_KINDS = ("plain", "accepted", "rejected", "probe", "catch-up")


@dataclass
class Stats:
    mode: str = "none"
    # how tokens were drawn: "greedy", "keyed" (a seed: every mode draws `none`'s tokens) or
    # "rejection" (sampled without a seed: exact in distribution)
    sampling_rule: str = "greedy"
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens reused from the prompt cache (not prefilled again)
    generated_tokens: int = 0
    target_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    accepted_by_source: dict[str, int] = field(default_factory=dict)
    drafted_by_source: dict[str, int] = field(default_factory=dict)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    peak_memory_gb: float = 0.0
    # Where the decoding time went, by kind of step (`STEP_KINDS`): each step's wall time
    # (from the commit before it), the tokens it emitted, and how many such steps ran; they
    # sum to `decode_seconds` and `generated_tokens` (`mlxspec bench --explain` reads them).
    seconds_by_step: dict[str, float] = field(default_factory=dict)
    tokens_by_step: dict[str, int] = field(default_factory=dict)
    steps_by_kind: dict[str, int] = field(default_factory=dict)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Generated tokens per target forward (1.0 for plain decoding)."""
        return self.generated_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

    @property
    def prompt_tps(self) -> float:
        prefilled = self.prompt_tokens - self.cached_tokens
        return prefilled / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def generation_tps(self) -> float:
        return self.generated_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def prediction_counts(self) -> tuple[int, int]:
        """(accepted, rejected) tokens proposed from the predicted output."""
        accepted = self.accepted_by_source.get("prediction", 0)
        return accepted, self.drafted_by_source.get("prediction", 0) - accepted

    def record_step(self, source: str, drafted: int, accepted: int, emitted: int,
                    decode_seconds: float | None = None,
                    peak_memory_gb: float | None = None, probe: bool = False,
                    setup_seconds: float = 0.0) -> None:
        """A step's target forward, the tokens it emitted (`emitted`: not those after an
        end-of-sequence token), its drafted and accepted tokens (by position and by source);
        the decoding time so far, and the peak memory where the answer ends. `probe`: its
        proposal tried an arm switched off; `setup_seconds`: the proposer's catch-up in it."""
        self.target_forwards += 1
        self.generated_tokens += emitted
        if decode_seconds is not None:
            kind = ("plain" if not drafted else "probe" if probe
                    else "accepted" if accepted else "rejected")
            wall = decode_seconds - self.decode_seconds
            if setup_seconds:
                self._account("catch-up", setup_seconds, 0)
                wall -= setup_seconds
            # (inline, not `_account`: a call less per token on the plain path)
            seconds, tokens, steps = self.seconds_by_step, self.tokens_by_step, self.steps_by_kind
            seconds[kind] = seconds.get(kind, 0.0) + wall
            tokens[kind] = tokens.get(kind, 0) + emitted
            steps[kind] = steps.get(kind, 0) + 1
            self.decode_seconds = decode_seconds
        if peak_memory_gb is not None:
            self.peak_memory_gb = peak_memory_gb
        if not drafted:
            return
        self.drafted += drafted
        self.accepted += accepted
        grow = drafted - len(self.drafted_by_position)
        if grow > 0:
            self.drafted_by_position += [0] * grow
            self.accepted_by_position += [0] * grow
        for i in range(drafted):
            self.drafted_by_position[i] += 1
        for i in range(accepted):
            self.accepted_by_position[i] += 1
        self.drafted_by_source[source] = self.drafted_by_source.get(source, 0) + drafted
        self.accepted_by_source[source] = self.accepted_by_source.get(source, 0) + accepted

    def _account(self, kind: str, seconds: float, tokens: int) -> None:
        self.seconds_by_step[kind] = self.seconds_by_step.get(kind, 0.0) + seconds
        self.tokens_by_step[kind] = self.tokens_by_step.get(kind, 0) + tokens
        self.steps_by_kind[kind] = self.steps_by_kind.get(kind, 0) + 1

    def prefilled(self, seconds: float, cached: int) -> None:
        """The prompt was prefilled in `seconds`, `cached` of its tokens reused."""
        self.prefill_seconds, self.cached_tokens = seconds, cached

    def add(self, other: Stats) -> None:
        """Add another generation's counts to these (statistics summed over generations): the
        lists position by position, the dicts key by key; peak memory is the larger, the mode
        stays."""
        for f in fields(Stats):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if f.name in ("mode", "sampling_rule"):
                continue
            if f.name == "peak_memory_gb":
                mine = max(mine, theirs)
            elif isinstance(mine, list):
                mine = [a + b for a, b in zip(mine + [0] * (len(theirs) - len(mine)),
                                              theirs + [0] * (len(mine) - len(theirs)))]
            elif isinstance(mine, dict):
                mine = {k: mine.get(k, 0) + theirs.get(k, 0) for k in {**mine, **theirs}}
            else:
                mine += theirs
            setattr(self, f.name, mine)

    def to_dict(self) -> dict:
        d = asdict(self)
        for name in (
            "acceptance_rate",
            "mean_accepted_length",
            "acceptance_by_position",
            "prompt_tps",
            "generation_tps",
        ):
            d[name] = getattr(self, name)
        return d

    def summary(self) -> str:
        """The one-line stats summary the CLI prints."""
        parts = [
            f"{self.generated_tokens} tokens",
            f"{self.generation_tps:.1f} tok/s",
            f"prompt {self.prompt_tokens} tok ({self.prompt_tps:.0f} tok/s"
            + (f", {self.cached_tokens} cached)" if self.cached_tokens else ")"),
        ]
        if self.drafted:
            parts.append(
                f"drafted {self.drafted} accepted {self.accepted} ({100 * self.acceptance_rate:.0f}%)"
            )
        parts.append(f"{self.mean_accepted_length:.2f} tok/forward")
        parts.append(f"mode {self.mode}")
        parts.append(f"peak {self.peak_memory_gb:.2f} GB")
        return " | ".join(parts)
