"""Stop strings: where generated text ends (one matcher for every path that cuts text).

The rule is the earliest match in the text: of all stop strings, the one whose first
occurrence starts first ends the answer there (at equal starts the shortest is the one
reported: it is the one complete first, whatever the pieces the text arrives in). Text that might be the start of a stop string is held back until
the next piece arrives, so a stop string split across tokens is found all the same.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .stats import Stats


def find_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """(where the answer ends, the stop string found there) for the earliest match, or None."""
    best: tuple[int, str] | None = None
    for s in stops:
        if not s:
            continue
        at = text.find(s, 0, len(text) if best is None else best[0] + len(s))
        if at >= 0 and (best is None or at < best[0]
                        or (at == best[0] and len(s) < len(best[1]))):
            best = (at, s)
    return best


class StopMatcher:
    """Incremental stop-string matching over pieces of detokenized text.

    `feed(piece)` returns (text that can be emitted now, the stop string that ended the answer
    or None); after a stop nothing more is emitted. `flush()` returns what was held back (the
    answer ended for another reason)."""

    def __init__(self, stops: list[str] | str | None):
        self.stops = [stops] if isinstance(stops, str) else [s for s in (stops or []) if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.held = ""
        self.stopped: str | None = None

    def feed(self, piece: str) -> tuple[str, str | None]:
        if self.stopped is not None:
            return "", self.stopped
        text = self.held + piece
        hit = find_stop(text, self.stops)
        if hit is not None:
            self.held, self.stopped = "", hit[1]
            return text[: hit[0]], hit[1]
        cut = max(0, len(text) - self.hold) if self.hold else len(text)
        self.held = text[cut:]
        return text[:cut], None

    def flush(self) -> str:
        text, self.held = ("" if self.stopped is not None else self.held), ""
        return text


class TextStream:
    """Tokens to text, cut at stop strings (`Detokenizer`'s). Text that might start a stop
    string is held back, and the earliest match in the text ends the answer
    (`stopping_word`)."""

    def __init__(self, tokenizer, stops: list[str]):
        self.detok = tokenizer.detokenizer
        self.detok.reset()
        self.matcher = StopMatcher(stops)
        self.stopping_word = ""

    def add(self, token: int) -> tuple[str, bool]:
        self.detok.add_token(token)
        if not self.matcher.stops:  # (nothing to hold back or cut: the text as it comes)
            return self.detok.last_segment, False
        return self._emit(self.detok.last_segment)

    def finish(self) -> str:
        """The rest of the text when the answer ends for another reason than a stop string."""
        self.detok.finalize()
        text, hit = self._emit(self.detok.last_segment)
        return text if hit else text + self.matcher.flush()

    def cut_short(self) -> str:
        """The rest of the text when the answer is cut short (timeout, shutdown): what was
        held back for a possible stop string, not a character still incomplete."""
        return self.matcher.flush()

    def _emit(self, segment: str) -> tuple[str, bool]:
        was = self.matcher.stopped
        text, hit = self.matcher.feed(segment)
        if hit is not None and was is None:
            self.stopping_word = hit
        return text, hit is not None


@dataclass
class StepOutput:
    """What a generation yields after each target forward (`Engine.stream_steps`, a batch
    row's `read`)."""

    text: str  # new text since the previous step (may be empty while a stop string is pending)
    tokens: list[int]  # tokens emitted by this step
    stats: Stats
    finish_reason: str | None = None  # set on the last output
    stop_string: str = ""  # the stop string that ended the answer, if one did
    # per token of `tokens` its `constrain.TokenLogprob` (a request asking for them)
    logprobs: list | None = None
    # per token of `tokens` where it came from: the proposal's source ("ngram", "draft",
    # "suffix", ...) for a proposed token the target accepted, "target" for its own
    sources: list[str] | None = None


def merged(outs: list[StepOutput]) -> StepOutput:
    """Consecutive outputs of one row as one."""
    last = outs[-1]
    logprobs = (None if any(o.logprobs is None for o in outs)
                else [e for o in outs for e in o.logprobs])
    sources = (None if any(o.sources is None for o in outs)
               else [s for o in outs for s in o.sources])
    return StepOutput("".join(o.text for o in outs), [t for o in outs for t in o.tokens],
                      last.stats, last.finish_reason, last.stop_string, logprobs, sources)


class Detokenizer:
    """A generation's committed tokens to `StepOutput`s, the one detokenizer of every path:
    text up to an end-of-sequence token or a stop string (`stats`: what each output carries,
    counted by the row, `BatchRow.commit`)."""

    def __init__(self, tokenizer, stops: list[str], stats: Stats):
        self.eos = set(getattr(tokenizer, "eos_token_ids", None) or [])
        self.text = TextStream(tokenizer, stops)
        self.stats = stats
        self.start = time.perf_counter()  # decoding started (`restart`)
        self.done = False

    def restart(self) -> None:
        """Decoding starts now (a row joins its batch: its prefill is done)."""
        self.start = time.perf_counter()

    def feed(self, tokens: list[int], last: bool = False, logprobs: list | None = None,
             sources: list[str] | None = None) -> StepOutput:
        """The output of a step that committed `tokens`; `last`: the answer ends after them
        (max_tokens reached) unless an end-of-sequence token or a stop string ended it;
        `logprobs`, `sources`: one entry per token (`SamplingParams.take_logprobs`; where
        each came from), kept for the tokens emitted."""
        emitted = []
        for t in tokens:
            if t in self.eos:
                break
            emitted.append(t)
        pieces = []
        text = self.text
        if text.matcher.stops:
            for t in emitted:
                pieces.append(text.add(t)[0])
        else:  # (`TextStream.add` without stop strings, inline: a call less per token)
            detok = text.detok
            for t in emitted:
                detok.add_token(t)
                pieces.append(detok.last_segment)
        finish = "stop" if self.text.stopping_word else None
        if len(emitted) < len(tokens):  # an end-of-sequence token
            pieces.append(self.text.finish())
            finish = "stop"
        elif last and finish is None:
            pieces.append(self.text.finish())
            finish = "length"
        self.done = finish is not None
        return StepOutput("".join(pieces), emitted, self.stats, finish, self.text.stopping_word,
                          None if logprobs is None else list(logprobs[: len(emitted)]),
                          None if sources is None else sources[: len(emitted)])
