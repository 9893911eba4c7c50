"""The HTTP surface: runs, tables, reduces and nodes as JSON (aiohttp).

The app serves one cluster, found under CLUSTER: one opened by the caller, or
one the app opens at startup and closes at cleanup (its cleanup context).
Nothing a client sends turns into a 500: ids are ASCII digits of bounded
length, a body has MAX_BODY bytes and BODY_TIMEOUT_S seconds to arrive, and
views that can be big (outputs, long pages) are encoded off the event loop.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
from aiohttp import web

from coordinator.client import WorkerError
from coordinator.cluster import Cluster, ClusterConfig, open_cluster
from coordinator.errors import Unavailable
from coordinator.launcher import LaunchError
from coordinator.pipeline import Node, StageFailed
from coordinator.runner import MAX_PROMPT_CHARS, RunRequest
from coordinator.stats import ClusterRun, ReduceKind

log = logging.getLogger("coordinator.api")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

CLUSTER = web.AppKey("cluster", Cluster)
TOKEN = web.AppKey("token", str)
BODY_TIMEOUT = web.AppKey("body_timeout", float)

# Bytes in a request body; more is a 413. Any prompt within the prompt limit fits, however it is
# escaped: 12 bytes per character is JSON's longest form (a surrogate pair, \uXXXX\uXXXX).
MAX_BODY = 12 * MAX_PROMPT_CHARS + 16 * 1024
# Seconds a client has to send a request body once its head is in; then 408.
BODY_TIMEOUT_S = 30.0
# A JSON body longer than this (bytes) is decoded in a thread, not on the event loop.
INLINE_DECODE_BYTES = 64 * 1024
# A /runs page of more runs than this is built and encoded in a thread (as is any view with an output).
INLINE_PAGE_RUNS = 50
# Digits in an id in a path; a longer one names no run or node (404).
MAX_ID_DIGITS = 18
LIVE_TIMEOUT = 5.0
MAX_LIMIT = 1000
DEFAULT_LIMIT = 50
OPEN_PATHS = ("/healthz", "/livez")
KINDS = ", ".join(k.value for k in ReduceKind)


def json_response(data: object, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """A JSON response encoded with msgspec."""
    return web.Response(
        body=msgspec.json.encode(data), status=status, content_type="application/json", headers=headers
    )


async def json_off_loop(build: Callable[[], object]) -> web.Response:
    """A JSON response built and encoded in a thread, for views big enough to stall the event loop."""
    body = await asyncio.to_thread(lambda: msgspec.json.encode(build()))
    return web.Response(body=body, content_type="application/json")


def error(status: int, message: str) -> web.Response:
    """The one error shape: {"error": "..."}."""
    return json_response({"error": message}, status)


def run_view(run: ClusterRun, with_output: bool = False) -> dict:
    """A run as served: its fields (output on request) plus what follows from them."""
    # The output is dropped before conversion: a big one would be converted only to be thrown away.
    view = msgspec.to_builtins(run if with_output else msgspec.structs.replace(run, output=[]))
    if not with_output:
        view.pop("output", None)
    view["critical_path_ms"] = run.critical_path_ms()
    view["tokens_per_s"] = run.tokens_per_s(run.seq)
    view["reduce"] = {k.value: run.reduce_resident_gb(k) for k in ReduceKind}
    view["table"] = run.table()
    if run.decode is not None:
        view["decode"] = run_view(run.decode)
    return view


@web.middleware
async def errors_as_json(request: web.Request, handler) -> web.StreamResponse:
    """Every error leaves as JSON; nothing the client sends turns into a 500."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        default_text = exc.text is None or exc.text.startswith(str(exc.status))
        return error(exc.status, exc.reason if default_text else exc.text)
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error(500, "internal error; see the coordinator log")


@web.middleware
async def bearer_token(request: web.Request, handler) -> web.StreamResponse:
    """When a token is set, every path but /healthz and /livez needs `Authorization: Bearer <token>`."""
    return _unauthorized(request) or await handler(request)


def _unauthorized(request: web.Request) -> web.Response | None:
    """The 401 for a request without the right bearer token, or None when it may pass."""
    token = request.app[TOKEN]
    if not token or request.path in OPEN_PATHS:
        return None
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    # Header bytes that are not UTF-8 arrive as lone surrogates: compared as the bytes they were.
    given = value.strip().encode("utf-8", "surrogateescape")
    if scheme.lower() == "bearer" and hmac.compare_digest(given, token.encode()):
        return None
    return json_response(
        {"error": "missing or wrong bearer token"}, 401, headers={"WWW-Authenticate": "Bearer"}
    )


async def expect_body(request: web.Request) -> web.Response | None:
    """Say `100 Continue` only to a body that will be read: a wrong token or a body too big is refused now."""
    if request.headers.get("Expect", "").lower() != "100-continue":
        return error(417, f"unsupported Expect: {request.headers['Expect']!r}; only 100-continue is")
    if (refusal := _unauthorized(request)) is not None:
        return refusal
    if request.content_length is not None and request.content_length > MAX_BODY:
        return error(413, f"the body is {request.content_length} bytes; the limit is {MAX_BODY}")
    if request.version >= (1, 1):
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the interim answer is not the response: errors may still be sent
    return None


async def read_body(request: web.Request) -> bytes:
    """The request's body, refused when over MAX_BODY (413), late (408) or malformed (400)."""
    if request.content_length is not None and request.content_length > MAX_BODY:
        raise web.HTTPRequestEntityTooLarge(max_size=MAX_BODY, actual_size=request.content_length)
    seconds = request.app[BODY_TIMEOUT]
    try:
        async with asyncio.timeout(seconds):
            return await request.read()
    except TimeoutError:
        raise web.HTTPRequestTimeout(text=f"the request body did not arrive within {seconds:g} s") from None
    except web.RequestPayloadError as exc:
        raise web.HTTPBadRequest(text=f"malformed request body: {exc}") from None
    except ConnectionResetError:  # the client's doing, not ours: no one hears this answer, no traceback
        raise web.HTTPBadRequest(text="the connection closed before the body was complete") from None


def _ascii_int(raw: str) -> int | None:
    """`raw` as a number when it is ASCII digits of bounded length, else None (int() also takes '١')."""
    if raw.isascii() and raw.isdigit() and len(raw) <= MAX_ID_DIGITS:
        return int(raw)
    return None


def _flag(request: web.Request, name: str) -> bool:
    return request.query.get(name, "0").lower() in ("1", "true", "yes")


def _int_param(request: web.Request, name: str, default: int | None, low: int, high: int) -> int | None:
    raw = request.query.get(name)
    if raw is None:
        return default
    value = _ascii_int(raw)
    if value is None:
        raise web.HTTPBadRequest(text=f"{name} must be an integer in {low}..{high}, got {raw!r}")
    if not low <= value <= high:
        raise web.HTTPBadRequest(text=f"{name} must be in {low}..{high}, got {value}")
    return value


async def _latest(request: web.Request) -> ClusterRun:
    run = request.app[CLUSTER].runner.latest
    if run is None:
        raise web.HTTPNotFound(text="no run yet: POST /runs to start one")
    if _flag(request, "output") and run.status != "running":
        run = await request.app[CLUSTER].store.get(run.id, with_output=True) or run
    return run


async def _by_id(request: web.Request) -> ClusterRun:
    raw = request.match_info["id"]
    run_id = _ascii_int(raw)
    if run_id is None:
        raise web.HTTPNotFound(text=f"no run {raw[:40]!r}: run ids are positive integers")
    live = request.app[CLUSTER].runner.latest
    if live is not None and live.id == run_id and live.status == "running":
        return live
    run = await request.app[CLUSTER].store.get(run_id, with_output=_flag(request, "output"))
    if run is None:
        raise web.HTTPNotFound(text=f"no run {run_id}")
    return run


def _reduce(request: web.Request, run: ClusterRun) -> web.Response:
    raw = request.query.get("kind")
    try:
        kind = ReduceKind(raw)
    except ValueError:
        raise web.HTTPBadRequest(text=f"kind must be one of {KINDS}; got {raw!r}") from None
    return json_response({"kind": kind.value, "resident_gb": run.reduce_resident_gb(kind), "run": run.id})


async def healthz(request: web.Request) -> web.Response:
    """200 when a run can go through now; 503 naming every reason it cannot (store, run loop, stages)."""
    cluster = request.app[CLUSTER]
    store = cluster.store.problem
    problems = {"store": store, "run loop": cluster.runner.problem, "stages": cluster.pipeline.unready()}
    reasons = [f"{part}: {why}" for part, why in problems.items() if why is not None]
    nodes = cluster.pipeline.nodes
    body = {"ok": not reasons, "reasons": reasons, "nodes_up": sum(n.state == "up" for n in nodes),
            "nodes": len(nodes), "store": store or "ok"}  # fmt: skip
    if not reasons:
        return json_response(body)
    return json_response({"error": "; ".join(reasons), **body}, 503)  # the one error shape, and more


async def livez(request: web.Request) -> web.Response:
    """200 whenever the process serves: liveness, not readiness (that is /healthz)."""
    return json_response({"ok": True})


def run_handlers(find: Callable[[web.Request], Awaitable[ClusterRun]]) -> list[tuple[str, Handler]]:
    """The views of one run (JSON, table, reduce), whichever way `find` picks it."""

    async def show(request: web.Request) -> web.Response:
        run = await find(request)
        if _flag(request, "output"):
            return await json_off_loop(lambda: run_view(run, with_output=True))
        return json_response(run_view(run))

    async def table(request: web.Request) -> web.Response:
        return web.Response(text=(await find(request)).table(), content_type="text/plain")

    async def reduce(request: web.Request) -> web.Response:
        return _reduce(request, await find(request))

    return [("", show), ("/table", table), ("/reduce", reduce)]


async def list_runs(request: web.Request) -> web.Response:
    limit = _int_param(request, "limit", DEFAULT_LIMIT, 1, MAX_LIMIT)
    before = _int_param(request, "before", None, 1, 2**62)
    cluster = request.app[CLUSTER]
    runs = await cluster.store.list(limit=limit, before=before)
    live = cluster.runner.latest
    if live is not None and live.status == "running":
        runs = [live if r.id == live.id else r for r in runs]
    next_before = runs[-1].id if len(runs) == limit else None

    def page() -> dict:
        return {"runs": [run_view(r) for r in runs], "next_before": next_before}

    return await json_off_loop(page) if len(runs) > INLINE_PAGE_RUNS else json_response(page())


async def post_run(request: web.Request) -> web.Response:
    body = await read_body(request)
    try:
        if len(body) > INLINE_DECODE_BYTES:
            req = await asyncio.to_thread(msgspec.json.decode, body, type=RunRequest)
        else:
            req = msgspec.json.decode(body, type=RunRequest) if body.strip() else RunRequest()
    except msgspec.ValidationError as exc:
        raise web.HTTPBadRequest(text=f"invalid run request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise web.HTTPBadRequest(text=f"body is not valid JSON: {exc}") from None
    runner = request.app[CLUSTER].runner
    try:
        run = await runner.submit(req)
    except ValueError as exc:
        raise web.HTTPBadRequest(text=str(exc)) from None
    except Unavailable as exc:  # a stage, the store or the queue: try again later
        return json_response({"error": str(exc)}, 503, headers={"Retry-After": str(exc.retry_after)})
    location = f"/runs/{run.id}"
    return json_response(
        {"id": run.id, "status": run.status, "location": location, "queued": runner.queued()},
        status=202,
        headers={"Location": location},
    )


def node_view(node: Node) -> dict:
    """A node as served: its NodeReport plus live state."""
    view = msgspec.to_builtins(node.report)
    view.update(stage=node.index, state=node.state, restarts=node.restarts, error=node.error)
    view["restarts_in_window"] = node.restarts_in_window
    return view


async def nodes(request: web.Request) -> web.Response:
    nodes = request.app[CLUSTER].pipeline.nodes
    views = [node_view(n) for n in nodes]
    if _flag(request, "live"):
        lives = await asyncio.gather(*(_live(n) for n in nodes))
        for view, live in zip(views, lives, strict=True):
            view["live"] = live
    return json_response({"nodes": views})


async def _live(node: Node) -> dict:
    """What a node's worker says of itself now (resident set, sessions, forwards)."""
    if node.state != "up" or node.client is None:
        return {"error": f"node is {node.state}"}
    try:
        stats = await node.client.stats(timeout=LIVE_TIMEOUT)
    except WorkerError as exc:
        return {"error": str(exc)}
    return {"resident_bytes": stats.resident_bytes, "sessions": stats.sessions, "forwards": stats.forwards}


async def restart_node(request: web.Request) -> web.Response:
    pipeline = request.app[CLUSTER].pipeline
    raw = request.match_info["index"]
    index = _ascii_int(raw)
    if index is None or index >= len(pipeline.nodes):
        raise web.HTTPNotFound(text=f"no node {raw[:40]!r}: nodes are 0..{len(pipeline.nodes) - 1}")
    try:
        # Concurrent requests for one stage share one restart and all get its outcome.
        node = await pipeline.restart(index)
    except (StageFailed, LaunchError, WorkerError, OSError) as exc:
        raise web.HTTPConflict(text=str(exc)) from None
    return json_response(node_view(node))


def create_app(
    cluster: Cluster | ClusterConfig, token: str = "", body_timeout: float = BODY_TIMEOUT_S
) -> web.Application:
    """Build the HTTP app around an open cluster, or around one it opens at startup and closes at cleanup."""
    app = web.Application(middlewares=[errors_as_json, bearer_token], client_max_size=MAX_BODY)
    if isinstance(cluster, ClusterConfig):
        app.cleanup_ctx.append(_cluster_context(cluster))
    else:
        app[CLUSTER] = cluster
    app[TOKEN] = token
    app[BODY_TIMEOUT] = body_timeout
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/livez", livez)
    for base, find in (("/run/latest", _latest), ("/runs/{id}", _by_id)):
        for suffix, handler in run_handlers(find):
            app.router.add_get(base + suffix, handler)
    app.router.add_get("/runs", list_runs)
    app.router.add_post("/runs", post_run, expect_handler=expect_body)
    app.router.add_get("/nodes", nodes)
    app.router.add_post("/nodes/{index}/restart", restart_node, expect_handler=expect_body)
    return app


def _cluster_context(config: ClusterConfig) -> Callable[[web.Application], AsyncIterator[None]]:
    """The app's cleanup context for a cluster it owns: open before serving, closed after."""

    async def cluster(app: web.Application) -> AsyncIterator[None]:
        async with open_cluster(config) as opened:
            app[CLUSTER] = opened
            yield

    return cluster
