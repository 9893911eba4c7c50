"""One OpenAI-style completion under way, chat or text: its run, the run's events, and its answer.

A completion is a run like any other: the runner queues, executes and stores
it, so /run/latest, /runs and the table show it, and the answer names it (and
its per-stage prefill and decode timings) under `rlx`. Text arrives from the
event bus as the run's tokens are generated; the stored record has the last
word, so a subscriber that lagged still answers the whole text. A client that
goes away before the run ends cancels it. Each endpoint only says how its
answers are worded (a Wording); the run, the stream, the holding back of what
may begin a stop string, the usage and the `rlx` field are this module's.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator
from contextlib import suppress
from typing import Any, NamedTuple, Protocol, TypeVar

import msgspec
from aiohttp import web

from coordinator.api.common import INLINE_DECODE_BYTES, error, json_response, openai_error, read_body
from coordinator.api.openai_shapes import FinishReason, RlxRun, Usage
from coordinator.api.stops import Holdback
from coordinator.cluster import Cluster, RunFinishedError, StoreError
from coordinator.errors import DEFAULT_RETRY_AFTER_S as RETRY_AFTER_S
from coordinator.errors import Unavailable
from coordinator.events import Event, Lagged, RunFinished, Subscription, TokenGenerated
from coordinator.runs.requests import RunRequest
from coordinator.stats import ClusterRun

log = logging.getLogger("coordinator.api.openai")

# Seconds between looks at whether a waiting client is still connected.
CLIENT_CHECK_S = 1.0
# Seconds a completion whose client went away waits for its run to stop.
CANCEL_WAIT_S = 10.0
# How a run that did not end ok is answered.
ENDED_STATUS = {"failed": 500, "cancelled": 409, "interrupted": 503}
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
T = TypeVar("T")


class Head(NamedTuple):
    """What every answer of one completion starts with: its id, when its run was queued, the model."""

    id: str
    created: int
    model: str


class Wording(Protocol):
    """How an endpoint words a completion: whole, and as the chunks of a stream (ids `prefix`-<run id>)."""

    prefix: str

    def whole(self, head: Head, text: str, finish: FinishReason, usage: Usage, rlx: RlxRun) -> object:
        """The whole completion."""
        ...

    def opening(self) -> object | None:
        """The choice the stream's first chunk carries before any text, or None for no such chunk."""
        ...

    def choice(self, text: str, finish: FinishReason | None = None) -> object:
        """A chunk's choice adding `text` (and on the last chunk, why generation ended)."""
        ...

    def chunk(self, head: Head, choices: list[Any], **extra: Any) -> object:
        """One chunk of the stream carrying `choices` (and the usage or `rlx`, as `extra`)."""
        ...


class Refused(Exception):
    """A completion answered with an error: its HTTP status, message and extra headers."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.headers = status, headers


class _RunFilter:
    """Accepts runs' token and end events: every run's until `run` is set, then that run's only."""

    def __init__(self) -> None:
        self.run: int | None = None

    def __call__(self, event: Event) -> bool:
        return isinstance(event, (TokenGenerated, RunFinished)) and self.run in (None, event.run)


async def decode(
    request: web.Request, decoder: msgspec.json.Decoder[T], what: str, hints: dict[str, str]
) -> T:  # fmt: skip
    """The request body as `decoder` reads it; 400 saying what is wrong with it.

    hints: said after a validation error whose message holds the key ("got `array` - at `$.prompt`").
    """
    body = await read_body(request)
    try:
        if len(body) > INLINE_DECODE_BYTES:
            return await asyncio.to_thread(decoder.decode, body)
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        said, hint = str(exc), ""
        if "unknown field" in said:
            hint = " (fields this server does not know are refused, not ignored)"
        hint += next((f" ({h})" for key, h in hints.items() if key in said), "")
        raise web.HTTPBadRequest(text=f"invalid {what} request: {exc}{hint}") from None
    except msgspec.DecodeError as exc:
        raise web.HTTPBadRequest(text=f"the body is not valid JSON: {exc}") from None


def check_model(cluster: Cluster, model: str, what: str) -> None:
    """404 when `model` is not the one served; 400 when the one served takes no prompt."""
    served = cluster.info.name
    if model != served:
        raise web.HTTPNotFound(text=f"the model {model!r} does not exist: this server serves {served!r}")
    if cluster.info.input != "tokens":
        raise web.HTTPBadRequest(
            text=f"model {served!r} takes no prompt (it is fed activations): {what} need a "
            'language model; run this one with POST /runs {"seq": N}'
        )


def check_neutral(creq: object, neutral: dict[str, tuple[object, ...]]) -> None:
    """400 naming a field set to a value other than those at which it changes nothing here."""
    for name, values in neutral.items():
        value = getattr(creq, name)
        if value is not None and value not in values:
            allowed = f"; leave it out or send {values[0]!r}" if values else "; leave it out"
            raise web.HTTPBadRequest(text=f"{name} {value!r} is not supported by this server{allowed}")


def sampling(
    temperature: float | None, top_p: float | None, seed: int | None, stop: str | list[str] | None,
    top_k: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """A run's sampling fields from a request's, with OpenAI's defaults where it leaves them out."""
    return {
        "temperature": 1.0 if temperature is None else temperature,  # OpenAI's default
        "top_p": top_p or 1.0,
        "top_k": max(top_k or 0, 0),
        # Without a seed each request draws its own, as OpenAI's API does; RunRequest takes 63 bits.
        "seed": secrets.randbits(63) if seed is None else seed % 2**63,
        "stop": [stop] if isinstance(stop, str) else stop or [],
    }


async def serve(
    request: web.Request, cluster: Cluster, rreq: RunRequest, wording: Wording, stream: bool,
    include_usage: bool = False,
) -> web.StreamResponse:  # fmt: skip
    """Run `rreq`; answer it whole, or stream it as server-sent chunks (the usage last when asked)."""
    only = _RunFilter()
    # Subscribed before the run exists, so none of its events can be missed.
    with cluster.bus.subscribe(accept=only) as sub:
        try:
            run = await cluster.submit(rreq)
        except ValueError as exc:
            raise web.HTTPBadRequest(text=str(exc)) from None
        except Unavailable as exc:
            return error(503, str(exc), {"Retry-After": str(exc.retry_after)}, request.path)
        only.run = run.id
        completion = Completion(request, cluster, wording, rreq, run, sub)
        try:
            return await (_stream(completion, include_usage) if stream else _whole(completion))
        except Refused as exc:
            return error(exc.status, str(exc), exc.headers, request.path)
        except ConnectionResetError:
            return completion.response or web.Response(status=499, text="the client closed the request")
        finally:
            if not completion.ended:
                await completion.cancel()


class Completion:
    """One completion under way: its run, the run's events, and how to answer it."""

    def __init__(
        self, request: web.Request, cluster: Cluster, wording: Wording, rreq: RunRequest, run: ClusterRun,
        sub: Subscription,
    ) -> None:  # fmt: skip
        self.request, self.cluster, self.sub = request, cluster, sub
        self.wording, self.rreq, self.run = wording, rreq, run
        self.head = Head(f"{wording.prefix}-{run.id}", int(run.created_at), run.model)
        self.response: web.StreamResponse | None = None
        self.ended: RunFinished | None = None

    async def events(self) -> AsyncIterator[TokenGenerated | Lagged]:
        """The run's tokens as generated (Lagged where some were missed) until it ends.

        Raises ConnectionResetError once the client has gone, Refused when the bus closes.
        """
        while self.ended is None:
            if self.request.transport is None or self.request.transport.is_closing():
                raise ConnectionResetError("the client closed the connection")
            try:
                async with asyncio.timeout(CLIENT_CHECK_S):
                    event = await self.sub.get()
            except TimeoutError:
                continue
            if event is None:
                raise Refused(503, "the coordinator is shutting down", {"Retry-After": str(RETRY_AFTER_S)})
            if isinstance(event, Lagged) or (isinstance(event, TokenGenerated) and event.run == self.run.id):
                yield event
            elif isinstance(event, RunFinished) and event.run == self.run.id:
                self.ended = event

    async def record(self) -> ClusterRun:
        """The run as stored, once it ended ok; Refused saying how it ended otherwise."""
        assert self.ended is not None
        run_id, status = self.run.id, self.ended.status
        if status != "ok":
            code = ENDED_STATUS.get(status, 500)
            headers = {"Retry-After": str(RETRY_AFTER_S)} if code == 503 else None
            raise Refused(code, f"run {run_id} ended {status}: {self.ended.error}", headers)
        try:
            # Ended: no longer live (a run leaves the runs in flight before its end is heard), so as stored.
            run = await self.cluster.run(run_id)
        except StoreError as exc:
            why = f"run {run_id} ended ok, but its record cannot be read: {exc}"
            raise Refused(503, why, {"Retry-After": str(RETRY_AFTER_S)}) from None
        if run is None:
            raise Refused(500, f"run {run_id} ended ok, but its record is gone from the store")
        if run.finish_reason not in ("stop", "length"):
            raise Refused(500, f"run {run_id} ended ok, but its record does not say why it stopped")
        return run

    def sse(self, choices: list[Any], **extra: Any) -> bytes:
        """One server-sent event carrying a chunk."""
        return b"data: " + msgspec.json.encode(self.wording.chunk(self.head, choices, **extra)) + b"\n\n"

    async def cancel(self) -> None:
        """Cancel the run no one will hear the end of; a run that ended meanwhile is left as it is."""
        log.info("run %d: its completion is no longer answered (client gone); cancelling it", self.run.id)
        with suppress(LookupError, RunFinishedError, TimeoutError):
            async with asyncio.timeout(CANCEL_WAIT_S):
                await self.cluster.cancel(self.run.id)


async def _whole(c: Completion) -> web.Response:
    """Wait for the run to end and answer the whole completion."""
    async for _ in c.events():
        pass
    run = await c.record()
    return json_response(c.wording.whole(c.head, run.text or "", _finish_reason(run), _usage(run), _rlx(run)))


async def _stream(c: Completion, include_usage: bool) -> web.StreamResponse:
    """Answer the completion as server-sent chunks while the run generates it."""
    resp = c.response = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(c.request)
    if (opening := c.wording.opening()) is not None:
        await resp.write(c.sse([opening]))
    held, lagged = Holdback(c.rreq.stop), False
    try:
        async for event in c.events():
            # After a gap the pieces no longer add up: the rest comes from the record.
            lagged = lagged or isinstance(event, Lagged)
            if lagged:
                continue
            if piece := held.push(event.text):
                await resp.write(c.sse([c.wording.choice(piece)]))
        run = await c.record()
    except Refused as exc:
        await resp.write(b"data: " + msgspec.json.encode(openai_error(exc.status, str(exc))) + b"\n\n")
    else:
        rest = (run.text or "")[held.sent :]
        await resp.write(c.sse([c.wording.choice(rest, _finish_reason(run))], rlx=_rlx(run)))
        if include_usage:
            await resp.write(c.sse([], usage=_usage(run)))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def _finish_reason(run: ClusterRun) -> FinishReason:
    """Why the run stopped, as its record says: stop (an end token or a stop string) or length."""
    assert run.finish_reason in ("stop", "length")  # record() lets no other run through
    return run.finish_reason


def _usage(run: ClusterRun) -> Usage:
    prompt, generated = run.seq, len(run.tokens)
    return Usage(prompt_tokens=prompt, completion_tokens=generated, total_tokens=prompt + generated)


def _rlx(run: ClusterRun) -> RlxRun:
    decode = run.decode
    return RlxRun(
        run=run.id, location=f"/runs/{run.id}", prefill=run.timings, decode=decode.timings if decode else [],
        prefill_ms=run.total_forward_ms, decode_ms=decode.total_forward_ms if decode else 0.0,
    )  # fmt: skip
