"""StopStrings: where the first stop string starts in a growing output text, and how much of
that text may be streamed while a stop string could still be forming at its end."""

from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    """The stop strings of one request (empty strings are ignored).

    A stream must not show text that a later token turns into the start of a stop string,
    since the output is cut before it: the last `hold` = (longest stop string - 1) characters
    are kept back until they cannot begin one, or the request ends."""

    def __init__(self, stops: Sequence[str] = ()) -> None:
        self.stops = tuple(dict.fromkeys(s for s in stops if s))
        self.hold = max((len(s) for s in self.stops), default=1) - 1

    def find(self, text: str, searched: int = 0) -> tuple[int, str] | None:
        """The earliest (position, stop string) in `text`, looking only where a match could not
        already have been found while the text was `searched` characters long."""
        start = max(0, searched - self.hold)
        hits = [(i, s) for s in self.stops if (i := text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def streamable(self, text_len: int) -> int:
        """How many leading characters of an unfinished text of `text_len` may be shown."""
        return max(0, text_len - self.hold)
