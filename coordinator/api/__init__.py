"""The HTTP surface, one module per face: runs, nodes (and health); each adds its routes in `setup`.

The app serves one cluster, found under CLUSTER: one opened by the caller, or
one the app opens at startup and closes at cleanup (its cleanup context).
A request a web page on another origin could have made a browser send is
refused (see coordinator.api.common). Nothing a client sends turns into a 500:
ids are ASCII digits of bounded length, a body has MAX_BODY bytes and
BODY_TIMEOUT_S seconds to arrive, and views that can be big (outputs, long
pages) are encoded off the event loop.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable

from aiohttp import web

from coordinator.api import dashboard, events, metrics, nodes, openai, openapi, runs, trace
from coordinator.api.common import (
    ALLOWED_HOSTS,
    BODY_TIMEOUT,
    BODY_TIMEOUT_S,
    CLUSTER,
    MAX_BODY,
    TOKEN,
    bearer_token,
    errors_as_json,
    json_bodies,
    same_origin,
)
from coordinator.api.runs import run_view
from coordinator.cluster import Cluster, ClusterConfig, open_cluster

__all__ = ["BODY_TIMEOUT_S", "CLUSTER", "MAX_BODY", "TOKEN", "create_app", "run_view"]

FACES = (nodes, runs, events, trace, dashboard, metrics, openapi, openai)


def create_app(
    cluster: Cluster | ClusterConfig, token: str = "", body_timeout: float = BODY_TIMEOUT_S,
    allow_hosts: Iterable[str] = (),
) -> web.Application:  # fmt: skip
    """Build the HTTP app around an open cluster, or around one it opens at startup and closes at cleanup.

    allow_hosts: names a request's Host may give besides a loopback or the server's own address
    (checked only without a token; see coordinator.api.common).
    """
    middlewares = [errors_as_json, same_origin, bearer_token, json_bodies]
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY)
    app[ALLOWED_HOSTS] = frozenset({"localhost", *(name.lower() for name in allow_hosts)})
    if isinstance(cluster, ClusterConfig):
        app.cleanup_ctx.append(_cluster_context(cluster))
    else:
        app[CLUSTER] = cluster
    app[TOKEN] = token
    app[BODY_TIMEOUT] = body_timeout
    for face in FACES:
        face.setup(app)
    return app


def _cluster_context(config: ClusterConfig) -> Callable[[web.Application], AsyncIterator[None]]:
    """The app's cleanup context for a cluster it owns: open before serving, closed after."""

    async def cluster(app: web.Application) -> AsyncIterator[None]:
        async with open_cluster(config) as opened:
            app[CLUSTER] = opened
            yield

    return cluster
