"""Nodes and health: each stage's report and state, restarts, readiness and liveness."""

from __future__ import annotations

import asyncio

import msgspec
from aiohttp import web

from coordinator.api.common import CLUSTER, ascii_int, expect_body, flag, json_response
from coordinator.launch.base import LaunchError
from coordinator.stages.client import WorkerError
from coordinator.stages.node import Node
from coordinator.stages.pipeline import StageFailed

LIVE_TIMEOUT = 5.0


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


def node_view(node: Node) -> dict:
    """A node as served: its NodeReport (its layers alone while no worker holds it) plus live state."""
    held = node.report if node.report is not None else {"layers": node.layers}
    view = msgspec.to_builtins(held)
    view.update(stage=node.index, state=node.state, restarts=node.restarts, error=node.error)
    view["restarts_in_window"] = node.restarts_in_window
    return view


async def nodes(request: web.Request) -> web.Response:
    cluster = request.app[CLUSTER]
    nodes = cluster.pipeline.nodes
    views = [node_view(n) for n in nodes]
    if flag(request, "live"):
        lives = await asyncio.gather(*(_live(n) for n in nodes))
        for view, live in zip(views, lives, strict=True):
            view["live"] = live
    body: dict = {"nodes": views}
    if cluster.joins is not None:  # who has joined, spares included, and why the plan waits
        body["joined"] = cluster.joins.view()
    return json_response(body)


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
    index = ascii_int(raw)
    if index is None or index >= len(pipeline.nodes):
        raise web.HTTPNotFound(text=f"no node {raw[:40]!r}: nodes are 0..{len(pipeline.nodes) - 1}")
    try:
        # Concurrent requests for one stage share one restart and all get its outcome.
        node = await request.app[CLUSTER].supervisor.restart(index)
    except (StageFailed, LaunchError, WorkerError, OSError) as exc:
        raise web.HTTPConflict(text=str(exc)) from None
    return json_response(node_view(node))


def setup(app: web.Application) -> None:
    """Add the node and health routes."""
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/livez", livez)
    app.router.add_get("/nodes", nodes)
    app.router.add_post("/nodes/{index}/restart", restart_node, expect_handler=expect_body)
