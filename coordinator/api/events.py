"""GET /events: the cluster's event bus as server-sent events.

One SSE event per bus event: `event:` its kind, `id:` EPOCH-SEQ (the bus's
epoch, random per coordinator process, and the event's sequence number),
`data:` its JSON. `?run=ID` keeps one run's events, `?kind=a,b` only those
kinds; a `lagged` event (the count of events this stream missed because its
client read too slowly) always comes through. `Last-Event-ID` (the header an
EventSource sends when it reconnects, or `?last_event_id=` for clients that
cannot set headers) resumes after that event from the bus's ring buffer; `0`
resumes from the oldest remembered. When those events are no longer
remembered, or the id is another coordinator process's (it restarted since),
the answer is 410 Gone saying so: an EventSource stops reconnecting on a
non-200 answer, so its page reloads the state it shows (GET /runs, /nodes)
and opens a fresh stream instead of retrying in a loop.

Streams are written by one fan-out (coordinator.api.streams): a slow client
never slows a run, and one that stops reading is dropped. They have their own
budget of connections (server.MAX_STREAMS): past it a new stream is 503,
while the rest of the API answers. A comment line every KEEPALIVE_S keeps an
idle stream from being timed out by a proxy and finds clients that are gone.
On shutdown every stream ends at once (on_shutdown), so the server does not
wait for them.
"""

from __future__ import annotations

import asyncio
from contextlib import suppress

from aiohttp import web

from coordinator.api import streams
from coordinator.api.common import CLUSTER, ascii_int, error, int_param
from coordinator.api.server import REFUSED_RETRY_AFTER_S, begin_stream
from coordinator.api.streams import Hub, Wanted
from coordinator.events import KINDS

# Seconds between keep-alive comments on an idle stream.
KEEPALIVE_S = 15.0
HUB = web.AppKey("event_hub", Hub)
HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
EPOCH_CHARS = 8  # hex digits of a bus's epoch


def _kinds(request: web.Request) -> frozenset[str] | None:
    """The kinds `?kind=` asks for (None for all); 400 naming the valid ones for any other."""
    raw = request.query.get("kind")
    if raw is None:
        return None
    kinds = frozenset(k.strip() for k in raw.split(","))
    unknown = sorted(kinds - set(KINDS))
    if unknown:
        names = ", ".join(repr(k) for k in unknown)
        raise web.HTTPBadRequest(text=f"unknown kind {names}: kinds are {', '.join(KINDS)}")
    return kinds


def _resume_after(request: web.Request, epoch: str) -> int | None:
    """The sequence number to resume after (Last-Event-ID, else ?last_event_id=), or None.

    400 when it is not an event id; 410 when it is another coordinator process's.
    """
    raw = request.headers.get("Last-Event-ID", request.query.get("last_event_id"))
    if raw is None or not raw.strip():
        return None
    text = raw.strip()
    if text == "0":  # before any event, whichever process: everything remembered
        return 0
    theirs, dash, digits = text.rpartition("-")
    seq = ascii_int(digits)
    if seq is None or (dash and not _is_epoch(theirs)):
        raise web.HTTPBadRequest(
            text=f"Last-Event-ID must be an event id as this stream sends them (EPOCH-SEQ, e.g. "
            f"{epoch}-12, or 0 for the oldest remembered), got {raw[:40]!r}"
        )
    # A bare number (as coordinators sent before ids had an epoch) names no event of this process either.
    if theirs != epoch:
        raise web.HTTPGone(
            text=f"event {text[:40]} does not exist in this coordinator process (its event ids are "
            f"{epoch}-SEQ): the coordinator restarted since, or the id was never sent; reload the state "
            "(GET /runs, /nodes) and open the stream again without Last-Event-ID"
        )
    return seq


def _is_epoch(text: str) -> bool:
    return len(text) == EPOCH_CHARS and all(c in "0123456789abcdef" for c in text.lower())


async def events(request: web.Request) -> web.StreamResponse:
    """Stream the bus's events, filtered and resumed as the query and Last-Event-ID ask."""
    wanted = Wanted(_kinds(request), int_param(request, "run", None, 1, 2**62))
    hub, bus = request.app[HUB], request.app[CLUSTER].bus
    since = _resume_after(request, bus.epoch)
    try:
        if since is not None:
            bus.after(since)  # refused before the answer begins, if it must be
    except LookupError as exc:
        raise web.HTTPGone(
            text=f"cannot resume after event {bus.epoch}-{since}: {exc}; reload the state (GET /runs, "
            "/nodes) and open the stream again without Last-Event-ID"
        ) from None
    if not begin_stream(request):
        why = "too many event streams are open; try again shortly"
        return error(503, why, {"Retry-After": str(REFUSED_RETRY_AFTER_S)}, request.path)
    response = web.StreamResponse(headers=HEADERS)
    response.force_close()  # a stream's connection is not reused: it leaves the stream budget by closing
    if request.version >= (1, 1):
        response.enable_chunked_encoding()  # the fan-out writes chunks itself
    await response.prepare(request)
    try:
        stream, replay = hub.open(request, wanted, since)
    except LookupError:  # gone from the ring while the answer began: the client reconnects and is told
        return response
    try:
        if replay:
            stream.write(b"".join(f.data for f in replay))
        while not stream.ended.is_set():
            with suppress(TimeoutError):
                async with asyncio.timeout(min(KEEPALIVE_S, streams.STALL_S)):
                    await stream.ended.wait()
            stream.tick(KEEPALIVE_S)
    finally:
        hub.close_stream(stream)
    await stream.finish(response)
    return response


async def _start(app: web.Application) -> None:
    app[HUB].start(app[CLUSTER].bus)


async def _end_streams(app: web.Application) -> None:
    """End every stream, so shutting down does not wait for clients that never hang up."""
    app[HUB].end_all()


async def _stop(app: web.Application) -> None:
    await app[HUB].close()


def setup(app: web.Application) -> None:
    """Add GET /events; its fan-out starts with the app, and its streams end on shutdown."""
    app[HUB] = Hub()
    app.on_startup.append(_start)
    app.on_shutdown.append(_end_streams)
    app.on_cleanup.append(_stop)
    app.router.add_get("/events", events)
