"""Runs: the latest and any stored one as JSON, table and reduce; the history; starting and cancelling."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import web

from coordinator.api.common import (
    CLUSTER,
    INLINE_DECODE_BYTES,
    INLINE_PAGE_RUNS,
    Handler,
    ascii_int,
    expect_body,
    flag,
    int_param,
    json_off_loop,
    json_response,
    read_body,
)
from coordinator.cluster import RunFinishedError
from coordinator.errors import Unavailable
from coordinator.runs.requests import RunRequest
from coordinator.stats import ClusterRun, ReduceKind

MAX_LIMIT = 1000
DEFAULT_LIMIT = 50
KINDS = ", ".join(k.value for k in ReduceKind)
# Seconds DELETE waits for a running run to stop before answering 202 (it stops at the next forward boundary).
CANCEL_WAIT_S = 5.0


def run_view(run: ClusterRun, with_output: bool = False) -> dict:
    """A run as served: its fields (output on request) plus what follows from them."""
    # The output and the steps (served as /runs/{id}/trace) are dropped before conversion: a long
    # run's would be converted only to be thrown away, on every poll of a running one.
    dropped = {"steps": []} if with_output else {"steps": [], "output": []}
    view = msgspec.to_builtins(msgspec.structs.replace(run, **dropped))
    if not with_output:
        view.pop("output", None)
    view.pop("steps", None)
    if view.get("accepted"):
        view["accepted"].pop("prompt_ids", None)  # a long prompt's ids would swell every page of /runs
    view["critical_path_ms"] = run.critical_path_ms()
    view["tokens_per_s"] = run.tokens_per_s(run.seq)
    view["reduce"] = {k.value: run.reduce_resident_gb(k) for k in ReduceKind}
    view["table"] = run.table()
    if run.decode is not None:
        view["decode"] = run_view(run.decode)
    return view


async def _latest(request: web.Request) -> ClusterRun:
    run = await request.app[CLUSTER].latest(with_output=flag(request, "output"))
    if run is None:
        raise web.HTTPNotFound(text="no run yet: POST /runs to start one")
    return run


async def run_by_id(request: web.Request) -> ClusterRun:
    """The run `{id}` names: the live record while it runs, else the stored one; 404 when there is none."""
    raw = request.match_info["id"]
    run_id = ascii_int(raw)
    if run_id is None:
        raise web.HTTPNotFound(text=f"no run {raw[:40]!r}: run ids are positive integers")
    run = await request.app[CLUSTER].run(run_id, with_output=flag(request, "output"))
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


def run_handlers(find: Callable[[web.Request], Awaitable[ClusterRun]]) -> list[tuple[str, Handler]]:
    """The views of one run (JSON, table, reduce), whichever way `find` picks it."""

    async def show(request: web.Request) -> web.Response:
        run = await find(request)
        if flag(request, "output"):
            return await json_off_loop(lambda: run_view(run, with_output=True))
        return json_response(run_view(run))

    async def table(request: web.Request) -> web.Response:
        return web.Response(text=(await find(request)).table(), content_type="text/plain")

    async def reduce(request: web.Request) -> web.Response:
        return _reduce(request, await find(request))

    return [("", show), ("/table", table), ("/reduce", reduce)]


async def list_runs(request: web.Request) -> web.Response:
    limit = int_param(request, "limit", DEFAULT_LIMIT, 1, MAX_LIMIT)
    before = int_param(request, "before", None, 1, 2**62)
    runs = await request.app[CLUSTER].runs(limit, before)
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
    cluster = request.app[CLUSTER]
    try:
        run = await cluster.submit(req)
    except ValueError as exc:
        raise web.HTTPBadRequest(text=str(exc)) from None
    except Unavailable as exc:  # a stage, the store or the queue: try again later
        return json_response({"error": str(exc)}, 503, headers={"Retry-After": str(exc.retry_after)})
    location = f"/runs/{run.id}"
    return json_response(
        {"id": run.id, "status": run.status, "location": location, "queued": cluster.queued()},
        status=202,
        headers={"Location": location},
    )


async def cancel_run(request: web.Request) -> web.Response:
    """Cancel a queued or running run: 200 with it once stopped, 202 while it is still stopping.

    409 for a run that has finished, also one that finished otherwise while the cancel was on its way
    (past its last forward boundary): a 200 always means the run is stored `cancelled`.
    """
    raw = request.match_info["id"]
    run_id = ascii_int(raw)
    if run_id is None:
        raise web.HTTPNotFound(text=f"no run {raw[:40]!r}: run ids are positive integers")
    cluster = request.app[CLUSTER]
    cancelling = asyncio.ensure_future(cluster.cancel(run_id))
    await asyncio.wait({cancelling}, timeout=CANCEL_WAIT_S)
    if not cancelling.done():
        # It ends on its own at the next forward boundary; its outcome is the stored run, read later.
        cancelling.add_done_callback(lambda task: task.cancelled() or task.exception())
        live = cluster.live(run_id)
        view = run_view(live) if live is not None else {"id": run_id}
        return json_response({**view, "cancelling": True}, 202)
    try:
        run = cancelling.result()
    except LookupError as exc:
        raise web.HTTPNotFound(text=str(exc)) from None
    except RunFinishedError as exc:
        raise web.HTTPConflict(text=str(exc)) from None
    return json_response(run_view(run))


def setup(app: web.Application) -> None:
    """Add the run routes."""
    for base, find in (("/run/latest", _latest), ("/runs/{id}", run_by_id)):
        for suffix, handler in run_handlers(find):
            app.router.add_get(base + suffix, handler)
    app.router.add_get("/runs", list_runs)
    app.router.add_post("/runs", post_run, expect_handler=expect_body)
    app.router.add_delete("/runs/{id}", cancel_run)
