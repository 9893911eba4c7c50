"""GET /events: the cluster's event bus as server-sent events.

One SSE event per bus event: `event:` its kind, `id:` its sequence number,
`data:` its JSON. `?run=ID` keeps one run's events, `?kind=a,b` only those
kinds; a `lagged` event (the count of events this stream missed because its
client read too slowly) always comes through. `Last-Event-ID` (the header an
EventSource sends when it reconnects, or `?last_event_id=` for clients that
cannot set headers) resumes after that event from the bus's ring buffer.
When those events are no longer remembered, or the id is from before the
coordinator restarted, the answer is 410 Gone saying so: an EventSource stops
reconnecting on a non-200 answer, so its page reloads the state it shows
(GET /runs, /nodes) and opens a fresh stream instead of retrying in a loop.

A comment line every KEEPALIVE_S keeps an idle stream from being timed out by
a proxy and finds clients that are gone. On shutdown every stream ends at
once (on_shutdown), so the server does not wait for them.
"""

from __future__ import annotations

import asyncio

import msgspec
from aiohttp import web

from coordinator.api.common import CLUSTER, ascii_int, int_param
from coordinator.events import HISTORY, KINDS, SUBSCRIBER_QUEUE, Event, Subscription

# Seconds between keep-alive comments on an idle stream.
KEEPALIVE_S = 15.0
KEEPALIVE = b": keep-alive\n\n"
STREAMS = web.AppKey("event_streams", set[Subscription])

_encoder = msgspec.json.Encoder()


def frame(event: Event) -> bytes:
    """One bus event as an SSE event."""
    kind = type(event).__struct_config__.tag
    return b"event: %s\nid: %d\ndata: %s\n\n" % (kind.encode(), event.seq, _encoder.encode(event))


def _kinds(request: web.Request) -> set[str] | None:
    """The kinds `?kind=` asks for (None for all); 400 naming the valid ones for any other."""
    raw = request.query.get("kind")
    if raw is None:
        return None
    kinds = {k.strip() for k in raw.split(",")}
    unknown = sorted(kinds - set(KINDS))
    if unknown:
        names = ", ".join(repr(k) for k in unknown)
        raise web.HTTPBadRequest(text=f"unknown kind {names}: kinds are {', '.join(KINDS)}")
    return kinds


def _resume_after(request: web.Request) -> int | None:
    """The event id to resume after (Last-Event-ID, else ?last_event_id=), or None; 400 when not an id."""
    raw = request.headers.get("Last-Event-ID", request.query.get("last_event_id"))
    if raw is None or not raw.strip():
        return None
    seq = ascii_int(raw.strip())
    if seq is None:
        raise web.HTTPBadRequest(text=f"Last-Event-ID must be an event id (a whole number), got {raw[:40]!r}")
    return seq


async def events(request: web.Request) -> web.StreamResponse:
    """Stream the bus's events, filtered and resumed as the query and Last-Event-ID ask."""
    kinds = _kinds(request)
    run = int_param(request, "run", None, 1, 2**62)

    def accept(event: Event) -> bool:
        wanted_kind = kinds is None or type(event).__struct_config__.tag in kinds
        return wanted_kind and (run is None or getattr(event, "run", None) == run)

    since = _resume_after(request)
    bus = request.app[CLUSTER].bus
    try:
        # Room for the whole ring buffer on top of the usual backlog: a resume does not lag at once.
        sub = bus.subscribe(since=since, accept=accept, maxsize=SUBSCRIBER_QUEUE + HISTORY)
    except LookupError as exc:
        raise web.HTTPGone(
            text=f"cannot resume after event {since}: {exc}; reload the state (GET /runs, /nodes) "
            "and open the stream again without Last-Event-ID"
        ) from None
    streams = request.app[STREAMS]
    streams.add(sub)
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    try:
        await response.prepare(request)
        await _pump(sub, response)
    except ConnectionResetError:  # the client went away: nothing to answer
        pass
    finally:
        streams.discard(sub)
        sub.close()
    return response


async def _pump(sub: Subscription, response: web.StreamResponse) -> None:
    """Write each event as it comes, a keep-alive comment when none came for KEEPALIVE_S; end with the bus."""
    while True:
        try:
            async with asyncio.timeout(KEEPALIVE_S):
                event = await sub.get()
        except TimeoutError:
            await response.write(KEEPALIVE)
            continue
        if event is None:
            return
        await response.write(frame(event))


async def _end_streams(app: web.Application) -> None:
    """End every stream, so shutting down does not wait for clients that never hang up."""
    for sub in list(app[STREAMS]):
        sub.close()


def setup(app: web.Application) -> None:
    """Add GET /events and end its streams on shutdown."""
    app[STREAMS] = set()
    app.on_shutdown.append(_end_streams)
    app.router.add_get("/events", events)
