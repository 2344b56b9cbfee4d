"""Stop strings: where generated text ends (one matcher for every path that cuts text).

The rule is the earliest match in the text: of all stop strings, the one whose first
occurrence starts first ends the answer there (at equal starts the shortest is the one
reported: it is the one complete first, whatever the pieces the text arrives in). Text that might be the start of a stop string is held back until
the next piece arrives, so a stop string split across tokens is found all the same.
"""

from __future__ import annotations


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
