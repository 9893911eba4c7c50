"""The HTTP surface: runs, tables, reduces and nodes as JSON (aiohttp).

The app serves one cluster, found under CLUSTER: one opened by the caller, or
one the app opens at startup and closes at cleanup (its cleanup context).
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
from coordinator.runner import RunRequest
from coordinator.stats import ClusterRun, ReduceKind

log = logging.getLogger("coordinator.api")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

CLUSTER = web.AppKey("cluster", Cluster)
TOKEN = web.AppKey("token", str)

MAX_BODY = 64 * 1024
LIVE_TIMEOUT = 5.0
MAX_LIMIT = 1000
DEFAULT_LIMIT = 50
OPEN_PATHS = ("/healthz",)
KINDS = ", ".join(k.value for k in ReduceKind)


def json_response(data: object, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """A JSON response encoded with msgspec."""
    return web.Response(
        body=msgspec.json.encode(data), status=status, content_type="application/json", headers=headers
    )


def error(status: int, message: str) -> web.Response:
    """The one error shape: {"error": "..."}."""
    return json_response({"error": message}, status)


def run_view(run: ClusterRun, with_output: bool = False) -> dict:
    """A run as served: its fields (output on request) plus what follows from them."""
    view = msgspec.to_builtins(run)
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
    """When a token is set, every path but /healthz needs `Authorization: Bearer <token>`."""
    token = request.app[TOKEN]
    if token and request.path not in OPEN_PATHS:
        given = request.headers.get("Authorization", "")
        scheme, _, value = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), token.encode()):
            return web.Response(
                body=msgspec.json.encode({"error": "missing or wrong bearer token"}),
                status=401,
                content_type="application/json",
                headers={"WWW-Authenticate": "Bearer"},
            )
    return await handler(request)


def _flag(request: web.Request, name: str) -> bool:
    return request.query.get(name, "0").lower() in ("1", "true", "yes")


def _int_param(request: web.Request, name: str, default: int | None, low: int, high: int) -> int | None:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise web.HTTPBadRequest(text=f"{name} must be an integer, got {raw!r}") from None
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
    if not raw.isdigit() or len(raw) > 18:
        raise web.HTTPNotFound(text=f"no run {raw!r}: run ids are positive integers")
    run_id = int(raw)
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
    nodes = request.app[CLUSTER].pipeline.nodes
    up = sum(n.state == "up" for n in nodes)
    return json_response({"ok": True, "nodes_up": up, "nodes": len(nodes)})


def run_handlers(find: Callable[[web.Request], Awaitable[ClusterRun]]) -> list[tuple[str, Handler]]:
    """The views of one run (JSON, table, reduce), whichever way `find` picks it."""

    async def show(request: web.Request) -> web.Response:
        return json_response(run_view(await find(request), _flag(request, "output")))

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
    views = [run_view(r) for r in runs]
    next_before = runs[-1].id if len(runs) == limit else None
    return json_response({"runs": views, "next_before": next_before})


async def post_run(request: web.Request) -> web.Response:
    body = await request.read()
    try:
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
        for view, live in zip(views, lives):
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
    if not raw.isdigit() or int(raw) >= len(pipeline.nodes):
        raise web.HTTPNotFound(text=f"no node {raw!r}: nodes are 0..{len(pipeline.nodes) - 1}")
    try:
        # Concurrent requests for one stage share one restart and all get its outcome.
        node = await pipeline.restart(int(raw))
    except (StageFailed, LaunchError, WorkerError, OSError) as exc:
        raise web.HTTPConflict(text=str(exc)) from None
    return json_response(node_view(node))


def create_app(cluster: Cluster | ClusterConfig, token: str = "") -> web.Application:
    """Build the HTTP app around an open cluster, or around one it opens at startup and closes at cleanup."""
    app = web.Application(middlewares=[errors_as_json, bearer_token], client_max_size=MAX_BODY)
    if isinstance(cluster, ClusterConfig):
        app.cleanup_ctx.append(_cluster_context(cluster))
    else:
        app[CLUSTER] = cluster
    app[TOKEN] = token
    app.router.add_get("/healthz", healthz)
    for base, find in (("/run/latest", _latest), ("/runs/{id}", _by_id)):
        for suffix, handler in run_handlers(find):
            app.router.add_get(base + suffix, handler)
    app.router.add_get("/runs", list_runs)
    app.router.add_post("/runs", post_run)
    app.router.add_get("/nodes", nodes)
    app.router.add_post("/nodes/{index}/restart", restart_node)
    return app


def _cluster_context(config: ClusterConfig) -> Callable[[web.Application], AsyncIterator[None]]:
    """The app's cleanup context for a cluster it owns: open before serving, closed after."""

    async def cluster(app: web.Application) -> AsyncIterator[None]:
        async with open_cluster(config) as opened:
            app[CLUSTER] = opened
            yield

    return cluster
