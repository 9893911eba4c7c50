"""The bus fanned out to every open event stream: each event encoded once, no client ever waited on.

One subscription to the bus serves every stream, so an event costs the run
that publishes it one queue append however many clients listen. The events
that come within FLUSH_S of the last write are encoded once each and gathered;
then each stream is handed the ones it asked for as one write to its socket,
never awaited: what a client has not read waits in its own connection's
buffer. A stream with more than STREAM_BACKLOG_BYTES unread is stalled and
not written to: it counts what it misses and, once it has read its backlog,
gets one `lagged` event saying how many. A stream stalled for STALL_S is
dropped (its connection cut). A stream's kernel send buffer is held to SNDBUF,
so a stall shows, and costs, that much rather than megabytes. Nothing here
awaits a client, so neither the runs nor the server's shutdown can be held up
by one.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from contextlib import suppress
from typing import NamedTuple

import msgspec
from aiohttp import web

from coordinator.api.server import STREAM_BACKLOG_BYTES
from coordinator.events import HISTORY, SUBSCRIBER_QUEUE, Event, EventBus, Lagged, Subscription

log = logging.getLogger("coordinator.api.events")

# Seconds events are gathered after a write before the next: each stream gets one write for all of them
# (200 listening clients then cost a few writes per second each, not one per event), at the price of at
# most this much delay.
FLUSH_S = 0.1
# Seconds a stream may stay stalled (its client reads nothing) before it is dropped.
STALL_S = 10.0
# Seconds a stream's last bytes may take to leave when it ends; then its connection is cut.
END_S = 1.0
# Bytes the kernel may hold for a stream's client (its socket's send buffer). Left to itself Linux grows it
# up to tcp_wmem's largest (4 MiB) for a client that reads nothing: that much memory per stalled stream,
# and that much sent into the void before the stall shows. An event stream never needs more than this.
SNDBUF = 64 * 1024
# Events the fan-out may fall behind the bus (the event loop held up elsewhere) before its streams lag.
HUB_QUEUE = SUBSCRIBER_QUEUE + HISTORY
KEEPALIVE = b": keep-alive\n\n"

_encoder = msgspec.json.Encoder()


class Wanted(NamedTuple):
    """What a stream asked for: kinds (None for all) and one run's events (None for every run's)."""

    kinds: frozenset[str] | None
    run: int | None


class Frame(NamedTuple):
    """One event as it is sent, with what a stream's filter looks at."""

    seq: int
    kind: str
    run: int | None
    data: bytes


def frame(event: Event, epoch: str) -> Frame:
    """One bus event as an SSE event: `event:` its kind, `id:` epoch-seq, `data:` its JSON."""
    kind = type(event).__struct_config__.tag
    data = b"event: %s\nid: %s-%d\ndata: %s\n\n" % (
        kind.encode(),
        epoch.encode(),
        event.seq,
        _encoder.encode(event),
    )
    return Frame(event.seq, kind, getattr(event, "run", None), data)


def selected(frames: list[Frame], wanted: Wanted, after: int) -> list[Frame]:
    """The frames a stream wants that come after event `after`; a lagged one always comes through."""
    kinds, run = wanted
    return [
        f
        for f in frames
        if f.seq > after
        and (f.kind == "lagged" or ((kinds is None or f.kind in kinds) and run in (None, f.run)))
    ]


class Stream:
    """One open event stream: its client's connection, what it asked for, and how far behind it is."""

    def __init__(self, request: web.Request, wanted: Wanted, after: int, epoch: str) -> None:
        assert request.transport is not None, "a stream opens on a live connection"
        self.transport = request.transport
        if (sock := self.transport.get_extra_info("socket")) is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF)
        self.wanted, self.after, self.epoch = wanted, after, epoch
        self.chunked = request.version >= (1, 1)
        self.missed = 0
        self.stalled_since: float | None = None
        self.wrote = time.monotonic()
        self.ended = asyncio.Event()
        self.cut = False

    def live(self) -> bool:
        return not self.transport.is_closing()

    def stalled(self) -> bool:
        return self.transport.get_write_buffer_size() > STREAM_BACKLOG_BYTES

    def write(self, data: bytes) -> None:
        """Hand `data` to the connection now (an HTTP chunk when chunked); what it cannot send, it buffers."""
        self.transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)
        self.wrote = time.monotonic()

    def offer(self, frames: list[Frame], data: bytes) -> None:
        """Send `data` (the bytes of `frames`), or count them as missed while the client is stalled."""
        self.after = frames[-1].seq
        if self.stalled():
            self.missed += len(frames)
            self.stalled_since = self.stalled_since or time.monotonic()
            if time.monotonic() - self.stalled_since > STALL_S:
                self.end(cut=True)
            return
        self.stalled_since = None
        self.write(self._lagged() + data)

    def tick(self, keepalive_s: float) -> None:
        """Between events: end one gone or stalled too long, tell one it lagged, keep an idle one alive."""
        if not self.live():
            self.end(cut=True)
        elif self.stalled():
            self.stalled_since = self.stalled_since or time.monotonic()
            if time.monotonic() - self.stalled_since > STALL_S:
                self.end(cut=True)
        elif self.missed:
            self.stalled_since = None
            self.write(self._lagged())
        elif time.monotonic() - self.wrote >= keepalive_s:
            self.write(KEEPALIVE)

    def _lagged(self) -> bytes:
        """The lagged event due before the next write (empty when nothing was missed)."""
        if not self.missed:
            return b""
        missed, self.missed = self.missed, 0
        return frame(Lagged(missed=missed, seq=self.after, time=time.time()), self.epoch).data

    def end(self, cut: bool = False) -> None:
        """End the stream; `cut`: close its connection at once, dropping what it has not sent."""
        if cut and not self.cut:
            self.cut = True
            if self.live():
                log.info("dropping an event stream whose client stopped reading")
            self.transport.abort()
        self.ended.set()

    async def finish(self, response: web.StreamResponse) -> None:
        """Write the end of the response, within END_S, else cut the connection."""
        if self.cut or not self.live():
            return
        try:
            async with asyncio.timeout(END_S):
                await response.write_eof()
        except TimeoutError:
            self.end(cut=True)
        except ConnectionResetError:  # the client went away meanwhile: nothing to end
            pass


class Hub:
    """Reads the bus once for every stream and hands each the events it asked for (module docstring)."""

    def __init__(self) -> None:
        self.bus: EventBus | None = None
        self.streams: set[Stream] = set()
        self._sub: Subscription | None = None
        self._task: asyncio.Task | None = None
        self._flushed = 0.0

    def start(self, bus: EventBus) -> None:
        self.bus = bus
        self._sub = bus.subscribe(maxsize=HUB_QUEUE)
        self._task = asyncio.create_task(self._run(self._sub))

    def open(self, request: web.Request, wanted: Wanted, since: int | None) -> tuple[Stream, list[Frame]]:
        """A stream for `request`, and the remembered events after `since` it wants (LookupError: gone)."""
        assert self.bus is not None, "streams open once the hub has started"
        # No await between reading the ring and joining: every later event reaches the stream once.
        replay = [frame(e, self.bus.epoch) for e in self.bus.after(since)] if since is not None else []
        stream = Stream(request, wanted, self.bus.seq, self.bus.epoch)
        self.streams.add(stream)
        return stream, selected(replay, wanted, since or 0)

    def close_stream(self, stream: Stream) -> None:
        self.streams.discard(stream)

    async def _run(self, sub: Subscription) -> None:
        """Gather the bus's events until FLUSH_S after the last write, then write them; end with the bus."""
        loop = asyncio.get_running_loop()
        while (event := await sub.get()) is not None:
            # A sleep even of 0 lets the events published in the same turn of the loop join this write.
            await asyncio.sleep(max(0.0, self._flushed + FLUSH_S - loop.time()))
            self._flushed = loop.time()
            self.flush([event, *sub.drain()])
        self.end_all()

    def flush(self, events: list[Event]) -> None:
        """Encode `events` once each; hand every stream the ones it wants, one write each."""
        if not events or self.bus is None:
            return
        frames = [frame(e, self.bus.epoch) for e in events]
        shared: dict[Wanted, tuple[list[Frame], bytes]] = {}
        for stream in list(self.streams):
            if stream.ended.is_set():
                continue
            if not stream.live():
                stream.end(cut=True)
                continue
            if stream.after >= frames[0].seq:  # joined mid-batch: its own selection
                mine = selected(frames, stream.wanted, stream.after)
                data = b"".join(f.data for f in mine)
            else:
                if stream.wanted not in shared:
                    picked = selected(frames, stream.wanted, 0)
                    shared[stream.wanted] = (picked, b"".join(f.data for f in picked))
                mine, data = shared[stream.wanted]
            if mine:
                stream.offer(mine, data)

    def end_all(self) -> None:
        """Write what is queued, then end every stream: stalled ones cut, the others given their end."""
        if self._sub is not None:
            self.flush(self._sub.drain())
        for stream in list(self.streams):
            if not stream.ended.is_set():
                stream.end(cut=stream.stalled())

    async def close(self) -> None:
        """Stop reading the bus (on cleanup)."""
        if self._sub is not None:
            self._sub.close()
        if self._task is not None:
            self._task.cancel()
            with suppress(asyncio.CancelledError):
                await self._task
