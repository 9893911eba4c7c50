"""The OpenAI-compatible face: POST /v1/chat/completions, streamed or not, and GET /v1/models.

A completion is a run like any other: the runner queues, executes and stores
it, so /run/latest, /runs and the table show it, and the answer names it (and
its per-stage prefill and decode timings) under `rlx`. Text arrives from the
event bus as the run's tokens are generated; the stored record has the last
word, so a subscriber that lagged still answers the whole text. A client that
goes away before the run ends cancels it. Errors have OpenAI's shape
({"error": {"message", "type", "code"}}). The request and answer shapes are in
coordinator.api.openai_shapes, and importable from here.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import suppress
from typing import Any

import msgspec
from aiohttp import web

from coordinator.api.common import (
    CLUSTER,
    INLINE_DECODE_BYTES,
    error,
    expect_body,
    json_response,
    openai_error,
    read_body,
)
from coordinator.api.openai_shapes import (
    NEUTRAL,
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChunkChoice,
    Delta,
    FinishReason,
    Message,
    Model,
    ModelList,
    OpenAIError,
    RlxRun,
    Usage,
)
from coordinator.api.stops import Holdback
from coordinator.cluster import Cluster, RunFinishedError, StoreError
from coordinator.errors import DEFAULT_RETRY_AFTER_S as RETRY_AFTER_S
from coordinator.errors import Unavailable
from coordinator.events import Event, Lagged, RunFinished, Subscription, TokenGenerated
from coordinator.runs.requests import MAX_NEW_TOKENS, ChatTurn, RunRequest
from coordinator.stats import ClusterRun

__all__ = [
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ModelList",
    "OpenAIError",
    "setup",
]

log = logging.getLogger("coordinator.api.openai")

# Seconds between looks at whether a waiting client is still connected.
CLIENT_CHECK_S = 1.0
CREATED = web.AppKey("openai_created", int)
DECODER = msgspec.json.Decoder(ChatCompletionRequest)
# Seconds a completion whose client went away waits for its run to stop.
CANCEL_WAIT_S = 10.0
# How a run that did not end ok is answered.
ENDED_STATUS = {"failed": 500, "cancelled": 409, "interrupted": 503}
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


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


async def list_models(request: web.Request) -> web.Response:
    return json_response(ModelList(data=[_model(request)]))


async def get_model(request: web.Request) -> web.Response:
    model, asked = _model(request), request.match_info["model"]
    if asked != model.id:
        raise web.HTTPNotFound(text=f"no model {asked!r}: this server serves {model.id!r}")
    return json_response(model)


def _model(request: web.Request) -> Model:
    return Model(id=request.app[CLUSTER].info.name, created=request.app[CREATED])


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """Run a chat completion; answer it whole, or stream it as server-sent chunks."""
    creq = await _decode(request)
    cluster = request.app[CLUSTER]
    rreq = _run_request(creq, cluster)
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
        completion = _Completion(request, cluster, creq, rreq, run, sub)
        try:
            return await (_stream(completion) if creq.stream else _whole(completion))
        except Refused as exc:
            return error(exc.status, str(exc), exc.headers, request.path)
        except ConnectionResetError:
            return completion.response or web.Response(status=499, text="the client closed the request")
        finally:
            if not completion.ended:
                await completion.cancel()


async def _decode(request: web.Request) -> ChatCompletionRequest:
    """The request body as a ChatCompletionRequest; 400 saying what is wrong with it."""
    body = await read_body(request)
    try:
        if len(body) > INLINE_DECODE_BYTES:
            return await asyncio.to_thread(DECODER.decode, body)
        return DECODER.decode(body)
    except msgspec.ValidationError as exc:
        unknown = "unknown field" in str(exc)
        hint = " (fields this server does not know are refused, not ignored)" if unknown else ""
        raise web.HTTPBadRequest(text=f"invalid chat completion request: {exc}{hint}") from None
    except msgspec.DecodeError as exc:
        raise web.HTTPBadRequest(text=f"the body is not valid JSON: {exc}") from None


def _run_request(creq: ChatCompletionRequest, cluster: Cluster) -> RunRequest:
    """The run a chat completion request asks for; 404 for another model, 400 for what cannot be done."""
    model = cluster.info.name
    if creq.model != model:
        raise web.HTTPNotFound(text=f"the model {creq.model!r} does not exist: this server serves {model!r}")
    if cluster.info.input != "tokens":
        raise web.HTTPBadRequest(
            text=f"model {model!r} takes no prompt (it is fed activations): chat completions need a "
            'language model; run this one with POST /runs {"seq": N}'
        )
    for name, neutral in NEUTRAL.items():
        value = getattr(creq, name)
        if value is not None and value not in neutral:
            allowed = f"; leave it out or send {neutral[0]!r}" if neutral else "; leave it out"
            raise web.HTTPBadRequest(text=f"{name} {value!r} is not supported by this server{allowed}")
    temperature = 1.0 if creq.temperature is None else creq.temperature  # OpenAI's default
    stop = [creq.stop] if isinstance(creq.stop, str) else creq.stop or []
    return RunRequest(
        messages=_turns(creq.messages),
        max_new_tokens=creq.max_completion_tokens or creq.max_tokens or MAX_NEW_TOKENS,
        temperature=temperature,
        top_p=creq.top_p or 1.0,
        top_k=max(creq.top_k or 0, 0),
        # Without a seed each request draws its own, as OpenAI's API does; RunRequest takes 63 bits.
        seed=secrets.randbits(63) if creq.seed is None else creq.seed % 2**63,
        stop=stop,
    )


def _turns(messages: list[Message]) -> list[ChatTurn]:
    """The conversation as the runner takes it; 400 naming the message it cannot hold."""
    turns = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = "system" if message.role == "developer" else message.role
        if role not in ("system", "user", "assistant"):
            raise web.HTTPBadRequest(
                text=f"{where}: role {message.role!r} is not supported; use system, user or assistant "
                "(tool calling is not supported)"
            )
        if message.tool_calls:
            raise web.HTTPBadRequest(text=f"{where}: tool_calls are not supported")
        if message.content is None:
            raise web.HTTPBadRequest(text=f"{where}: content is missing")
        content = message.content
        if not isinstance(content, str):
            for j, part in enumerate(content):
                if part.type != "text":
                    raise web.HTTPBadRequest(
                        text=f"{where}.content[{j}]: {part.type!r} parts are not supported; only text"
                    )
            content = "\n".join(part.text for part in content)
        turns.append(ChatTurn(role=role, content=content))
    return turns


class _Completion:
    """One chat completion under way: its run, the run's events, and how to answer it."""

    def __init__(
        self, request: web.Request, cluster: Cluster, creq: ChatCompletionRequest, rreq: RunRequest,
        run: ClusterRun, sub: Subscription,
    ) -> None:  # fmt: skip
        self.request, self.cluster, self.sub = request, cluster, sub
        self.creq, self.rreq, self.run = creq, rreq, run
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

    def chunk(self, choices: list[ChunkChoice], **extra: Any) -> bytes:
        """One server-sent event carrying a chunk."""
        body = ChatCompletionChunk(
            id=f"chatcmpl-{self.run.id}", object="chat.completion.chunk", created=int(self.run.created_at),
            model=self.run.model, choices=choices, **extra,
        )  # fmt: skip
        return b"data: " + msgspec.json.encode(body) + b"\n\n"

    async def cancel(self) -> None:
        """Cancel the run no one will hear the end of; a run that ended meanwhile is left as it is."""
        log.info(
            "run %d: its chat completion is no longer answered (client gone); cancelling it", self.run.id
        )
        with suppress(LookupError, RunFinishedError, TimeoutError):
            async with asyncio.timeout(CANCEL_WAIT_S):
                await self.cluster.cancel(self.run.id)


async def _whole(c: _Completion) -> web.Response:
    """Wait for the run to end and answer the whole completion."""
    async for _ in c.events():
        pass
    run = await c.record()
    message = AssistantMessage(content=run.text or "")
    return json_response(
        ChatCompletion(
            id=f"chatcmpl-{run.id}", object="chat.completion", created=int(run.created_at), model=run.model,
            choices=[Choice(message=message, finish_reason=_finish_reason(run))], usage=_usage(run),
            rlx=_rlx(run),
        )
    )  # fmt: skip


async def _stream(c: _Completion) -> web.StreamResponse:
    """Answer the completion as server-sent chunks while the run generates it."""
    resp = c.response = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(c.request)
    await resp.write(c.chunk([ChunkChoice(delta=Delta(role="assistant", content=""))]))
    held, lagged = Holdback(c.rreq.stop), False
    try:
        async for event in c.events():
            # After a gap the pieces no longer add up: the rest comes from the record.
            lagged = lagged or isinstance(event, Lagged)
            if lagged:
                continue
            if piece := held.push(event.text):
                await resp.write(c.chunk([ChunkChoice(delta=Delta(content=piece))]))
        run = await c.record()
    except Refused as exc:
        await resp.write(b"data: " + msgspec.json.encode(openai_error(exc.status, str(exc))) + b"\n\n")
    else:
        rest = (run.text or "")[held.sent :]
        delta = Delta(content=rest) if rest else Delta()
        finish = ChunkChoice(delta=delta, finish_reason=_finish_reason(run))
        await resp.write(c.chunk([finish], rlx=_rlx(run)))
        if c.creq.stream_options is not None and c.creq.stream_options.include_usage:
            await resp.write(c.chunk([], usage=_usage(run)))
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


def setup(app: web.Application) -> None:
    """Add the /v1 routes."""
    app[CREATED] = int(time.time())
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", get_model)
    app.router.add_post("/v1/chat/completions", chat_completions, expect_handler=expect_body)
