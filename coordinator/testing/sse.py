"""Server-sent events of /events as the test handles read them."""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Iterable
from typing import NamedTuple

# Seconds `events` reads the stream for, in all.
EVENTS_S = 10.0


class SseEvent(NamedTuple):
    """One server-sent event from /events: its kind, id (EPOCH-SEQ: resume after it with `since=`), data."""

    kind: str
    id: str | None
    data: dict


def events_path(run: int | None, kinds: Iterable[str], since: str | int | None) -> str:
    """The /events path with its query."""
    query = {"run": run, "kind": ",".join(kinds) or None, "last_event_id": since}
    text = urllib.parse.urlencode({k: v for k, v in query.items() if v is not None})
    return "/events" + ("?" + text if text else "")


def parse_event(frame: list[bytes]) -> SseEvent | None:
    """One SSE frame's lines as an event; None for a comment (a keep-alive)."""
    fields: dict[str, str] = {}
    for line in frame:
        name, _, value = line.decode().rstrip("\r\n").partition(":")
        if name:
            fields[name] = value.removeprefix(" ")
    if "event" not in fields:
        return None
    return SseEvent(fields["event"], fields.get("id") or None, json.loads(fields.get("data") or "{}"))


class Frames:
    """Lines of an SSE stream in, one event out at each blank line that ends a frame."""

    def __init__(self) -> None:
        self.lines: list[bytes] = []

    def feed(self, line: bytes) -> SseEvent | None:
        """Take one line; the event it completes, if any (None for a keep-alive comment)."""
        if line.strip():
            self.lines.append(line)
            return None
        event, self.lines = parse_event(self.lines), []
        return event
