"""A request's stop strings, watched token by token (pure): where its text ends, and how
much of the text so far is final, i.e. can no longer turn out to be part of a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopScan:
    """Feed it every generated token in order. `end_chars` is None until a stop string
    appears, then the length of the text before the earliest one; `final_chars` is the
    prefix that may be streamed now (the last `len(longest stop) - 1` characters wait
    while a stop string could still be completing). Memory stays O(longest stop)."""

    def __init__(self, stops: Sequence[str] | None) -> None:
        self._stops = tuple(stops or ())
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._tail = ""
        """The text's last `_hold` characters: where a stop string that ends in the next
        token can start."""
        self.chars = 0
        """Characters generated so far (all of them, also past a stop)."""
        self.end_chars: int | None = None

    def feed(self, token: str) -> bool:
        """Take one token; True once the text has reached a stop string."""
        if self.end_chars is not None or not self._stops:
            self.chars += len(token)
            return self.end_chars is not None
        tail = self._tail + token
        tail_start = self.chars + len(token) - len(tail)
        self.chars += len(token)
        # A stop string that ends in this token starts at most `_hold` characters before it,
        # so searching the tail finds the earliest one; earlier text was searched before.
        hits = [at for s in self._stops if (at := tail.find(s)) >= 0]
        if hits:
            self.end_chars = tail_start + min(hits)
            return True
        self._tail = tail[-self._hold:] if self._hold else ""
        return False

    @property
    def final_chars(self) -> int:
        return self.end_chars if self.end_chars is not None else max(0, self.chars - self._hold)
