"""Nodes and health: each stage's report and state, restarts, readiness and liveness."""

from __future__ import annotations

import msgspec
from aiohttp import web

from coordinator.api.common import CLUSTER, ascii_int, expect_body, flag, json_response
from coordinator.cluster import RestartFailed

# Seconds GET /nodes?live=1 waits for each worker to say what it holds now.
LIVE_TIMEOUT = 5.0


async def healthz(request: web.Request) -> web.Response:
    """200 when a run can go through now; 503 naming every reason it cannot (store, run loop, stages)."""
    health = request.app[CLUSTER].health()
    body = msgspec.to_builtins(health)
    if health.ok:
        return json_response(body)
    return json_response({"error": "; ".join(health.reasons), **body}, 503)  # the one error shape, and more


async def livez(request: web.Request) -> web.Response:
    """200 whenever the process serves: liveness, not readiness (that is /healthz)."""
    return json_response({"ok": True})


async def nodes(request: web.Request) -> web.Response:
    cluster = request.app[CLUSTER]
    body: dict = {"nodes": await cluster.nodes(live_within=LIVE_TIMEOUT if flag(request, "live") else None)}
    if (joined := cluster.joined()) is not None:  # who has joined, spares included, and why the plan waits
        body["joined"] = joined
    return json_response(body)


async def restart_node(request: web.Request) -> web.Response:
    cluster = request.app[CLUSTER]
    raw = request.match_info["index"]
    index = ascii_int(raw)
    if index is None or index >= cluster.node_count:
        raise web.HTTPNotFound(text=f"no node {raw[:40]!r}: nodes are 0..{cluster.node_count - 1}")
    try:
        # Concurrent requests for one stage share one restart and all get its outcome.
        return json_response(await cluster.restart(index))
    except RestartFailed as exc:
        raise web.HTTPConflict(text=str(exc)) from None


def setup(app: web.Application) -> None:
    """Add the node and health routes."""
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/livez", livez)
    app.router.add_get("/nodes", nodes)
    app.router.add_post("/nodes/{index}/restart", restart_node, expect_handler=expect_body)
