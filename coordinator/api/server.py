"""Serve an aiohttp app with bounds on its connections: how many, and how long each may keep us waiting.

aiohttp closes an idle keep-alive connection, but does not bound the time a
client takes to send a request's head, nor how many connections it holds. Here
each connection is watched from accept to close:

- a connection waiting for a request must deliver its complete head within
  `header_s` of being opened, or `idle_s` of the previous response, else it is
  closed (a slowloris sending a byte a second is cut off at that bound);
- a body the app does not read is drained for at most `drain_s`, then the
  connection is closed (the app bounds the bodies it reads itself);
- at most `connections` are open at once: one more first evicts the connection
  that has waited longest for a request, and when every connection is busy
  with a request it is answered 503 and closed at once;
- a response that streams for as long as the client listens (GET /events)
  moves its connection out of that count into a budget of its own,
  `streams`: however many streams are open, the API and the probes answer.
  A stream over the budget first drops one whose client has stopped reading
  (STREAM_BACKLOG_BYTES unread), else it is refused (503);
- on the way out, responses still running get SHUTDOWN_GRACE_S to finish,
  then they are cancelled and their connections cut: a client that never
  reads cannot hold the process up.

Errors aiohttp answers by itself (a malformed request line, header or length)
come back as JSON `{"error": ...}` like the app's own.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from http import HTTPStatus

import msgspec
from aiohttp import web

log = logging.getLogger("coordinator.http")

# Seconds a new connection has to send a complete request head; then it is closed.
HEADER_TIMEOUT_S = 10.0
# Seconds a kept-alive connection may wait for its next complete request head; then it is closed.
IDLE_TIMEOUT_S = 30.0
# Seconds a request body the app did not read is drained before the connection is closed.
DRAIN_TIMEOUT_S = 10.0
# Connections open at once; one more evicts the longest-waiting idle one, or is refused (503) if none is idle.
MAX_CONNECTIONS = 256
# Seconds a client refused for too many connections is told to wait (Retry-After).
REFUSED_RETRY_AFTER_S = 1
# Streams open at once (GET /events), counted apart from MAX_CONNECTIONS: streams never lock the API out.
MAX_STREAMS = 256
# Bytes a stream's client may leave unread, beyond what the kernel's socket buffers hold, before it counts
# as stalled: a stalled stream is not written to (it is told it lagged once it reads again), is dropped
# after a while, and is the first dropped when a new stream finds the budget full.
STREAM_BACKLOG_BYTES = 64 * 1024
# Seconds the responses still running when the server stops get to finish (a streamed chat writes the end
# of its interrupted run, an event stream its last events); then they are cancelled and their connections
# closed. aiohttp's own default is 60 s, which a client that never reads would wait out in full.
SHUTDOWN_GRACE_S = 2.0


@dataclass(frozen=True)
class HttpLimits:
    """How many connections the server holds and how long each may keep it waiting.

    header_s: seconds a new connection has to deliver a complete request head.
    idle_s: seconds a connection may wait after a response for the next request's complete head.
    drain_s: seconds a request body the app did not read is drained before closing.
    connections: connections open at once (see the module docstring for what happens past it).
    streams: streams open at once, apart from `connections`.
    """

    header_s: float = HEADER_TIMEOUT_S
    idle_s: float = IDLE_TIMEOUT_S
    drain_s: float = DRAIN_TIMEOUT_S
    connections: int = MAX_CONNECTIONS
    streams: int = MAX_STREAMS

    def __post_init__(self) -> None:
        for name in ("header_s", "idle_s", "drain_s"):
            value = getattr(self, name)
            if not 0 < value < math.inf:
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
        for name in ("connections", "streams"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _refusal() -> bytes:
    """The whole answer to a connection over the limit: 503, JSON, and the connection closed."""
    body = msgspec.json.encode({"error": "too many connections; try again shortly"})
    head = (
        f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: {REFUSED_RETRY_AFTER_S}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


REFUSAL = _refusal()


class Guard:
    """The connections of one server: counts them, caps them, and closes one that keeps it waiting."""

    def __init__(self, server: web.Server, limits: HttpLimits) -> None:
        self.server = server
        self.limits = limits
        self.port = 0
        # In the order each began to wait for a request: the first not busy has waited longest.
        self.open: dict[Connection, None] = {}
        # Connections serving a stream, oldest first: outside `open` and its limit.
        self.streams: dict[Connection, None] = {}

    def connection(self) -> Connection:
        """Make the protocol for one accepted connection (the server's protocol factory)."""
        limits = self.limits
        # aiohttp's own idle timer set no shorter than ours: the guard's deadlines are the ones that apply.
        return Connection(
            self, self.server, loop=asyncio.get_running_loop(), access_log=None,
            keepalive_timeout=max(limits.idle_s, limits.header_s), lingering_time=limits.drain_s,
        )  # fmt: skip

    def admit(self, conn: Connection) -> bool:
        """Take `conn` in, evicting the longest-waiting connection at the limit; False when all are busy."""
        if len(self.open) >= self.limits.connections:
            victim = next((c for c in self.open if not c.busy), None)
            if victim is None:
                return False
            log.info("at the limit of %d connections: closing the longest idle", len(self.open))
            self.forget(victim)
            victim.force_close()
        self.open[conn] = None
        return True

    def stream(self, conn: Connection) -> bool:
        """Move `conn` from the connection limit to the stream budget; False when it is full of live ones."""
        if len(self.streams) >= self.limits.streams:
            victim = next((c for c in self.streams if c.stalled()), None)
            if victim is None:
                return False
            log.info(
                "at the limit of %d streams: dropping one whose client stopped reading", len(self.streams)
            )
            self.forget(victim)
            victim.cut()
        self.open.pop(conn, None)
        self.streams[conn] = None
        return True

    def forget(self, conn: Connection) -> None:
        self.open.pop(conn, None)
        self.streams.pop(conn, None)

    def waiting(self, conn: Connection) -> None:
        """Move `conn` to the back of the eviction order: it starts waiting now."""
        if conn in self.open:
            del self.open[conn]
            self.open[conn] = None


class Connection(web.RequestHandler):
    """aiohttp's handler of one connection, with a deadline for each request head and JSON errors."""

    __slots__ = ("busy", "deadline", "guard")

    def __init__(self, guard: Guard, manager: web.Server, **kwargs) -> None:
        super().__init__(manager, **kwargs)
        self.guard = guard
        self.busy = False
        self.deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self.guard.admit(self):
            assert isinstance(transport, asyncio.Transport)
            transport.write(REFUSAL)
            transport.close()
            return
        super().connection_made(transport)
        self._wait(self.guard.limits.header_s)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.guard.forget(self)
        self._disarm()
        super().connection_lost(exc)

    def begin(self) -> None:
        """A request's head is in: no deadline while it is handled."""
        self.busy = True
        self._disarm()

    def end(self) -> None:
        """The request is handled: the next one's head is due within idle_s."""
        self.busy = False
        if self.transport is not None:
            self.guard.waiting(self)
            self._wait(self.guard.limits.idle_s)

    def stalled(self) -> bool:
        """True when the client left over STREAM_BACKLOG_BYTES unread (beyond the kernel's buffers)."""
        return self.transport is not None and self.transport.get_write_buffer_size() > STREAM_BACKLOG_BYTES

    def cut(self) -> None:
        """Close the connection now, dropping what it has not sent."""
        if self.transport is not None:
            self.transport.abort()

    def _wait(self, seconds: float) -> None:
        self._disarm()
        self.deadline = asyncio.get_running_loop().call_later(seconds, self._expire, seconds)

    def _disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _expire(self, seconds: float) -> None:
        self.deadline = None
        log.info("closing a connection that sent no complete request head in %g s", seconds)
        self.force_close()

    def handle_error(
        self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:  # fmt: skip
        """Answer an error met before the app (a malformed request line, header or length) as JSON."""
        if request.writer.output_size > 0:
            raise ConnectionError("an error after the response began: the connection is dropped")
        if status == HTTPStatus.INTERNAL_SERVER_ERROR:
            log.error("error handling a request from %s", request.remote, exc_info=exc)
            text = HTTPStatus(status).phrase
        else:
            # A client's malformed request is its mistake, not ours: one line, no traceback.
            text = message or HTTPStatus(status).phrase
            log.info("refused a malformed request from %s: %s", request.remote, text)
        resp = web.Response(
            body=msgspec.json.encode({"error": text}), status=status, content_type="application/json"
        )
        resp.force_close()
        return resp


def begin_stream(request: web.Request) -> bool:
    """Count the request's connection in the stream budget from now on; False when there is no room.

    A request served other than by `serve` (a test server) has no budget: always True.
    """
    conn = request.protocol
    return conn.guard.stream(conn) if isinstance(conn, Connection) else True


@web.middleware
async def track_requests(request: web.Request, handler) -> web.StreamResponse:
    """Tell the request's connection when it is busy, so its head deadline pauses while it is handled."""
    conn = request.protocol
    if not isinstance(conn, Connection):
        return await handler(request)
    conn.begin()
    try:
        return await handler(request)
    finally:
        conn.end()


class Reserved:
    """An address bound for a server that is not ready yet: it listens, and accepts, only once served.

    Bound as the server itself would be (every address the host resolves to,
    SO_REUSEADDR set), but not listening: a client is refused until
    `serve(..., reserved=)` starts it, as when nothing is bound. A port another
    server listens on fails the bind at once; a plain bind of it meanwhile
    fails too, though one that also sets SO_REUSEADDR succeeds on Linux until
    one of the two listens (then the other's listen fails: an OSError here).
    """

    def __init__(self) -> None:
        self.listener: asyncio.Server | None = None
        self._connection: Callable[[], asyncio.Protocol] | None = None

    @classmethod
    async def bind(cls, host: str, port: int) -> Reserved:
        """Bind host:port now; an OSError when it cannot be (in use, not this host's, not allowed)."""
        reserved = cls()
        loop = asyncio.get_running_loop()
        reserved.listener = await loop.create_server(reserved._protocol, host, port, start_serving=False)
        return reserved

    async def start(self, connection: Callable[[], asyncio.Protocol]) -> asyncio.Server:
        """Listen and accept, each connection's protocol made by `connection`; return the server."""
        assert self.listener is not None, "start a reservation that was bound"
        self._connection = connection
        await self.listener.start_serving()
        return self.listener

    def _protocol(self) -> asyncio.Protocol:
        assert self._connection is not None, "a reserved address accepts nobody before it is served"
        return self._connection()

    def close(self) -> None:
        """Let the address go (again, harmlessly, when the server has closed it)."""
        if self.listener is not None:
            self.listener.close()


@asynccontextmanager
async def serve(
    app: web.Application,
    host: str,
    port: int,
    limits: HttpLimits = HttpLimits(),
    reserved: Reserved | None = None,
) -> AsyncIterator[Guard]:
    """Serve `app` on host:port under `limits` for the block; yields the guard (its `port` and `open`).

    `reserved`: host:port bound earlier (Reserved.bind), else it is bound here, the same way.
    Adds `track_requests` as the app's first middleware, so call it before the
    app is started anywhere else.
    """
    app.middlewares.insert(0, track_requests)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S)
    await runner.setup()
    try:
        assert runner.server is not None
        guard = Guard(runner.server, limits)
        reserved = reserved or await Reserved.bind(host, port)
        listener = await reserved.start(guard.connection)
        guard.port = listener.sockets[0].getsockname()[1]
        try:
            yield guard
        finally:
            listener.close()
    finally:
        await runner.cleanup()
