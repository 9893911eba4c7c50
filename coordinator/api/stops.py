"""What a streamed completion may send as its text grows: nothing of a stop string or of what may begin one.

The run itself ends its text before the first stop string (coordinator.runs.generation);
a stream must not send ahead what that cut will take away. Each new piece is
checked against only the tail that can still complete a stop string: per stop
string, from the earliest place one may still begin, which is never more than
the string's length before the end. So a token costs the same at the end of a
long text as at its start, and only that tail is kept.
"""

from __future__ import annotations

from collections.abc import Sequence


class Holdback:
    """A streamed text let out as it grows, but for a stop string and any end of it that may begin one.

    sent: the characters let out so far.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.sent = 0
        self._tail = ""  # the text not let out yet
        # Per stop string, where in the tail it may begin at the earliest (none begins before).
        self._from = [0] * len(self.stops)

    def push(self, piece: str) -> str:
        """Add `piece` to the text; what may be sent now that was not before."""
        tail = self._tail = self._tail + piece
        end = len(tail)
        for i, stop in enumerate(self.stops):
            self._from[i] = at = _earliest(tail, stop, self._from[i])
            end = min(end, at)
        self._tail = tail[end:]
        self._from = [at - end for at in self._from]
        self.sent += end
        return tail[:end]


def _earliest(text: str, stop: str, start: int) -> int:
    """Where, from `start` on, `text` holds `stop` or ends in a start of it (the earliest); else len(text)."""
    if (found := text.find(stop, start)) >= 0:
        return found
    # Not in the text: only an end shorter than `stop` can still begin it, the longest first.
    at = text.find(stop[0], max(start, len(text) - len(stop) + 1))
    while at >= 0 and not stop.startswith(text[at:]):
        at = text.find(stop[0], at + 1)
    return len(text) if at < 0 else at


def sendable(text: str, stops: Sequence[str]) -> int:
    """How much of `text` may be sent: none of a stop string and what follows, none that may begin one."""
    return len(Holdback(stops).push(text))
