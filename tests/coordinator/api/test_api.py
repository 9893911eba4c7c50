"""The HTTP API through a real server on loopback, over a real pipeline."""

from __future__ import annotations

import io
import os
import signal
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestServer

from coordinator.api import CLUSTER, MAX_BODY, create_app
from coordinator.api import runs as api_module
from coordinator.cluster import Cluster, ClusterConfig
from coordinator.runs.requests import MAX_PROMPT_CHARS
from coordinator.runs.runner import Runner
from coordinator.stages.node import RestartPolicy
from coordinator.stages.pipeline import Pipeline
from coordinator.store.history import RunStore
from tests.conftest import eventually, worker_pids
from tests.coordinator.conftest import Api
from tests.support.store_files import WriteLock
from workers.fake import reference
from workers.models.synthetic import make_input

JSON = {"Content-Type": "application/json"}


async def test_posted_run_is_served_as_latest_with_table_and_reduce(api):
    status, body, resp = await api.post("/runs", json={"seq": 3, "seed": 7})
    assert status == 202 and resp.headers["Location"] == f"/runs/{body['id']}"
    run = await api.finished(body["id"])
    assert run["status"] == "ok" and run["seq"] == 3 and "output" not in run
    assert [t["stage"] for t in run["timings"]] == [0, 1]
    assert run["critical_path_ms"] == max(t["forward_ms"] for t in run["timings"])
    assert run["tokens_per_s"] == pytest.approx(3 / (run["total_forward_ms"] / 1000))
    assert set(run["reduce"]) == {"sum", "mean", "max", "min"}

    status, latest, _ = await api.get("/run/latest?output=1")
    expected = reference(make_input(3, 4, 7), range(4))
    assert status == 200 and latest["id"] == body["id"]
    np.testing.assert_array_equal(np.asarray(latest["output"], np.float32).reshape(3, 4), expected)

    status, table, resp = await api.get("/run/latest/table")
    assert status == 200 and resp.content_type == "text/plain"
    assert table == latest["table"] and table.startswith("node ") and "across 2 stages" in table

    status, reduce, _ = await api.get("/run/latest/reduce?kind=max")
    assert status == 200 and reduce["kind"] == "max"
    assert reduce["resident_gb"] == pytest.approx(max(t["resident_bytes"] for t in run["timings"]) / 1e9)


async def test_runs_list_newest_first_with_limit_and_paging(api):
    ids = [(await api.post("/runs", json={"seq": 1, "seed": i}))[1]["id"] for i in range(4)]
    await api.finished(ids[-1])
    status, page, _ = await api.get("/runs?limit=3")
    assert status == 200 and [r["id"] for r in page["runs"]] == ids[::-1][:3]
    status, rest, _ = await api.get(f"/runs?limit=3&before={page['next_before']}")
    assert [r["id"] for r in rest["runs"]] == [ids[0]] and rest["next_before"] is None
    for bad in ("?limit=0", "?limit=abc", "?limit=100000", "?before=-1"):
        status, err, _ = await api.get(f"/runs{bad}")
        assert status == 400 and "error" in err


def astral_prompt_body(chars: int) -> bytes:
    """A run request whose prompt is `chars` characters, each in JSON's longest escape (12 bytes)."""
    return b'{"prompt": "' + b"\\ud83d\\ude00" * chars + b'"}'


# Python's int() or str.isdigit() takes some of these ("\u0661": Arabic-Indic one; "\u00b2": superscript 2).
NOT_ASCII_DIGITS = ["\u00b2", "\u0661", "1\u00b2", "9" * 5000, "+1", "1_0", "-1", "0x1"]


async def test_running_run_is_visible_with_the_stages_finished_so_far(api_factory):
    api = await api_factory("fake:layers=4,delay_ms=600,stage=2")
    _, body, _ = await api.post("/runs", json={"seq": 2})

    async def first_stage_done():
        status, run, _ = await api.get("/run/latest")
        return run if status == 200 and run["status"] == "running" and len(run["timings"]) == 1 else None

    live = await eventually(first_stage_done, 10, "a running run with one stage done")
    assert live["id"] == body["id"] and live["timings"][0]["stage"] == 0
    assert (await api.finished(body["id"]))["status"] == "ok"


async def test_nodes_are_served_up_with_their_workers_reports(api):
    status, nodes, _ = await api.get("/nodes")
    assert status == 200 and [n["state"] for n in nodes["nodes"]] == ["up", "up"]
    report = {"addr", "layers", "device", "precision", "build_ms", "resident_bytes", "n_params", "n_packed"}
    assert report <= set(nodes["nodes"][0])


async def test_live_nodes_say_what_each_worker_holds_and_how_many_forwards_it_served(api):
    _, body, _ = await api.post("/runs", json={"seq": 1})
    await api.finished(body["id"])
    status, live, _ = await api.get("/nodes?live=1")
    assert status == 200 and [n["live"]["forwards"] for n in live["nodes"]] == [1, 1]
    assert all(n["live"]["resident_bytes"] > 10_000_000 for n in live["nodes"])


async def test_healthz_is_200_with_every_stage_up_and_the_store_ok(api):
    status, health, _ = await api.get("/healthz")
    assert status == 200 and health == {"ok": True, "reasons": [], "nodes_up": 2, "nodes": 2, "store": "ok"}


async def test_with_recovery_off_a_killed_worker_fails_the_run_marks_the_node_down_and_the_api_keeps_serving(
    api_factory,
):
    api = await api_factory("fake:layers=4,delay_ms=1500,stage=2", recover_timeout=0)
    _, first, _ = await api.post("/runs", json={"seq": 1})
    await api.finished(first["id"], 10)
    _, body, _ = await api.post("/runs", json={"seq": 1})
    runner, victim = api.cluster.runner, api.cluster.pipeline.nodes[1]
    killed = victim.report

    def at_stage_1() -> bool:
        return runner.latest.id == body["id"] and len(runner.latest.timings) == 1

    await eventually(at_stage_1, 10, "the run to reach stage 1")
    os.kill(killed.pid, signal.SIGKILL)
    run = await api.finished(body["id"], 3)
    assert run["status"] == "failed" and "stage 1" in run["error"] and killed.addr in run["error"]
    status, kept, _ = await api.get(f"/runs/{first['id']}")
    assert status == 200 and kept["status"] == "ok"

    async def restarted():
        node = (await api.get("/nodes"))[1]["nodes"][1]
        return node if node["state"] == "up" and node["restarts"] == 1 else None

    node = await eventually(restarted, 15, "stage 1 to be restarted")
    assert node["pid"] != killed.pid and node["error"] is None
    _, again, _ = await api.post("/runs", json={"seq": 1})
    assert (await api.finished(again["id"]))["status"] == "ok"


async def test_restart_endpoint_replaces_one_node(api):
    before = [n["pid"] for n in (await api.get("/nodes"))[1]["nodes"]]
    status, node, _ = await api.post("/nodes/1/restart")
    assert status == 200 and node["state"] == "up" and node["restarts"] == 1 and node["pid"] != before[1]
    after = [n["pid"] for n in (await api.get("/nodes"))[1]["nodes"]]
    assert after[0] == before[0]
    status, err, _ = await api.post("/nodes/7/restart")
    assert status == 404 and "nodes are 0..1" in err["error"]


async def test_token_protects_everything_but_healthz_and_livez(api_factory):
    api = await api_factory(token="s3cret")
    assert (await api.get("/healthz"))[0] == 200
    assert (await api.get("/livez"))[:2] == (200, {"ok": True})
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
        status, _, resp = await api.get("/runs", headers=headers)
        assert status == 401 and resp.headers["WWW-Authenticate"] == "Bearer"
        status, _, _ = await api.post("/runs", json={"seq": 1}, headers=headers)
        assert status == 401
    status, _, _ = await api.get("/runs", headers={"Authorization": "Bearer s3cret"})
    assert status == 200
    assert (await api.get("/nodes", headers={"Authorization": "Bearer s3cret"}))[0] == 200


@asynccontextmanager
async def by_hand(pipeline: Pipeline, store: RunStore) -> AsyncIterator[Callable]:
    """Serve `pipeline` and `store` with token s3cret; yield a `call(method, path) -> (status, json)`."""
    runner = Runner(pipeline, store)
    await runner.start()
    server = TestServer(create_app(Cluster(pipeline.info, store, pipeline, runner, None), "s3cret"))
    await server.start_server()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:

            async def call(method: str, path: str, **kw) -> tuple[int, dict]:
                headers = {"Authorization": "Bearer s3cret"}
                async with session.request(method, str(server.make_url(path)), headers=headers, **kw) as r:
                    return r.status, await r.json()

            yield call
    finally:
        await server.close()
        await runner.close()
        await store.close()


async def test_healthz_is_503_naming_a_failed_stage_until_it_is_restarted_while_livez_stays_200(launch):
    pipeline = await launch("fake:layers=4", 2, restart=RestartPolicy(budget=0))
    async with by_hand(pipeline, await RunStore.open(":memory:")) as call:
        healthy = {"ok": True, "reasons": [], "nodes_up": 2, "nodes": 2, "store": "ok"}
        assert await call("GET", "/healthz") == (200, healthy)
        os.kill(pipeline.nodes[1].report.pid, signal.SIGKILL)
        await eventually(lambda: pipeline.nodes[1].state == "failed", 10, "stage 1 to be failed")
        status, health = await call("GET", "/healthz")
        assert status == 503 and health["ok"] is False
        assert (health["nodes_up"], health["nodes"], health["store"]) == (1, 2, "ok")
        [reason] = health["reasons"]
        assert health["error"] == reason
        assert reason.startswith("stages: stage 1 (") and "is failed" in reason
        assert "/nodes/1/restart" in reason
        assert await call("GET", "/livez") == (200, {"ok": True})
        assert (await call("POST", "/nodes/1/restart"))[0] == 200
        assert await call("GET", "/healthz") == (200, healthy)


async def test_healthz_is_503_naming_the_store_while_it_cannot_write_and_200_once_it_can(launch, tmp_path):
    path = tmp_path / "runs.sqlite3"
    pipeline = await launch("fake:layers=2,delay_ms=1000", 1)
    async with by_hand(pipeline, await RunStore.open(path, busy_timeout=0.2, retry_every=0.1)) as call:
        _, run = await call("POST", "/runs", json={"seq": 1})

        async def running():
            return (await call("GET", f"/runs/{run['id']}"))[1]["status"] == "running"

        await eventually(running, 5, "the run to start")
        lock = WriteLock(path)  # the run's end cannot be saved while another connection holds the lock
        try:

            async def unhealthy():
                status, health = await call("GET", "/healthz")
                return status == 503 and health

            health = await eventually(unhealthy, 10, "/healthz to say the store is failing")
            assert "database is locked" in health["store"] and str(path) in health["store"]
            assert health["reasons"] == [f"store: {health['store']}"] and health["nodes_up"] == 1
        finally:
            lock.release()

        async def healthy():
            return (await call("GET", "/healthz"))[0] == 200

        await eventually(healthy, 10, "/healthz to say ok once the store writes again")


async def test_views_with_an_output_and_long_pages_are_built_and_encoded_off_the_event_loop(api, monkeypatch):
    on_loop: list[bool] = []
    real_view = api_module.run_view

    def spy(run, with_output=False):
        on_loop.append(threading.current_thread() is threading.main_thread())
        return real_view(run, with_output)

    ids = [(await api.post("/runs", json={"seq": 2, "seed": i}))[1]["id"] for i in range(2)]
    await api.finished(ids[-1])
    monkeypatch.setattr(api_module, "run_view", spy)
    monkeypatch.setattr(api_module, "INLINE_PAGE_RUNS", 1)
    for path, expected in (
        (f"/runs/{ids[0]}?output=1", [False]),
        ("/run/latest?output=1", [False]),
        (f"/runs/{ids[0]}", [True]),
        ("/runs?limit=2", [False, False]),
        ("/runs?limit=1", [True]),
    ):
        on_loop.clear()
        status, body, _ = await api.get(path)
        assert status == 200 and on_loop == expected, path
    assert len(body["runs"]) == 1 and body["next_before"] == ids[1]


# The tests below change nothing: each sends what the API refuses, or reads what a new cluster holds. They
# share one cluster (`pristine`) where each would otherwise launch its own pair of workers (~1 s of CPU
# each, 22 times), and come last: the function-scoped fixtures above check that no worker of this process
# is alive, which holds only before the shared cluster starts.
on_pristine = pytest.mark.asyncio(loop_scope="module")


@on_pristine
async def test_latest_is_404_before_any_run(pristine):
    status, body, _ = await pristine.get("/run/latest")
    assert status == 404 and "no run yet" in body["error"]
    status, body, _ = await pristine.get("/run/latest/table")
    assert status == 404 and "error" in body


@on_pristine
@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"{not json", "not valid JSON"),
        (b'{"seq": "many"}', "got `str` - at `$.seq`"),
        (b'{"seq": 0}', "seq"),
        (b'{"seq": 2, "colour": "red"}', "unknown field `colour`"),
        (b"[1, 2]", "Expected `object`"),
        (b'{"prompt": "hi"}', "takes no prompt"),
    ],
)
async def test_malformed_run_request_is_400_saying_what_is_wrong(pristine, body, says):
    status, err, _ = await pristine.post("/runs", data=body, headers={"Content-Type": "application/json"})
    assert status == 400 and says in err["error"]
    status, listing, _ = await pristine.get("/runs")
    assert listing["runs"] == []


@on_pristine
async def test_huge_body_is_413_as_json_whether_its_length_is_announced_or_chunked(pristine):
    body = b"{" + b" " * (MAX_BODY + 10) + b"}"

    async def chunks():
        for i in range(0, len(body), 65536):
            yield body[i : i + 65536]

    for data in (io.BytesIO(body), chunks()):
        status, err, resp = await pristine.post("/runs", data=data, headers=JSON)
        assert status == 413 and resp.content_type == "application/json" and str(MAX_BODY) in err["error"]
    assert (await pristine.get("/runs"))[1]["runs"] == []


@on_pristine
async def test_a_prompt_within_its_limit_fits_the_body_limit_however_it_is_escaped(pristine):
    # The fake model takes no prompt: a 400 saying so shows the body was read and decoded whole.
    status, err, _ = await pristine.post(
        "/runs", data=io.BytesIO(astral_prompt_body(MAX_PROMPT_CHARS)), headers=JSON
    )
    assert status == 400 and "takes no prompt" in err["error"]
    body = io.BytesIO(astral_prompt_body(MAX_PROMPT_CHARS + 1))
    status, err, _ = await pristine.post("/runs", data=body, headers=JSON)
    assert status == 400 and f"length <= {MAX_PROMPT_CHARS}" in err["error"] and "$.prompt" in err["error"]


@on_pristine
@pytest.mark.parametrize("index", NOT_ASCII_DIGITS)
async def test_node_indexes_are_ascii_digits_else_404_and_nothing_restarts(pristine, index):
    pids = [n.report.pid for n in pristine.cluster.pipeline.nodes]
    status, err, _ = await pristine.post(f"/nodes/{index}/restart")
    assert status == 404 and "nodes are 0..1" in err["error"]
    assert [n.report.pid for n in pristine.cluster.pipeline.nodes] == pids


@on_pristine
@pytest.mark.parametrize("query", ["limit=\u0661", "limit=" + "9" * 5000, "before=\u00b2", "limit=1_0"])
async def test_query_numbers_are_ascii_digits_else_400_naming_the_range(pristine, query):
    status, err, _ = await pristine.get(f"/runs?{query}")
    assert status == 400 and "must be an integer in" in err["error"]


@on_pristine
async def test_unknown_path_is_a_json_404(pristine):
    status, err, _ = await pristine.get("/nope")
    assert status == 404 and "error" in err


# The tests below only read a store holding one finished run (id 1): they share one cluster that holds it
# (`one_run`), after `pristine`'s tests, so that this file launches two pairs of workers for them rather
# than one per test (13). It checks at its end that its own workers are gone (`pristine`, set up before
# it, still has its own), and `pristine` then that no worker of this process is left.


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def one_run() -> AsyncIterator[Api]:
    """A cluster like `pristine`'s whose store holds one finished run of 2 rows, id 1."""
    before = set(worker_pids(os.getpid()))
    config = ClusterConfig("fake:layers=4", 2, build_timeout=60.0)
    server = TestServer(create_app(config, ""), host="127.0.0.1")
    await server.start_server()
    mine = set(worker_pids(os.getpid())) - before
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
    try:
        api = Api(server, session, server.app[CLUSTER])
        _, body, _ = await api.post("/runs", json={"seq": 2})
        assert body["id"] == 1 and (await api.finished(1))["status"] == "ok"
        yield api
    finally:
        await session.close()
        await server.close()
    assert not set(worker_pids(os.getpid())) & mine, "a worker outlived the one-run cluster"


@on_pristine
@pytest.mark.parametrize("query", ["", "?kind=median", "?kind="])
async def test_unknown_or_missing_reduce_kind_is_400_naming_the_valid_kinds(one_run, query):
    status, err, _ = await one_run.get(f"/run/latest/reduce{query}")
    assert status == 400 and "sum, mean, max, min" in err["error"]


@on_pristine
async def test_a_runs_table_by_id_is_the_table_its_view_holds(one_run):
    run = await one_run.finished(1)
    status, table, _ = await one_run.get("/runs/1/table")
    assert status == 200 and table == run["table"]


@on_pristine
async def test_a_run_id_no_run_has_is_a_json_404_for_its_view_and_its_table(one_run):
    for path in ("/runs/999", "/runs/abc", "/runs/999/table", "/runs/-1"):
        status, err, _ = await one_run.get(path)
        assert status == 404 and "error" in err


@on_pristine
@pytest.mark.parametrize("run_id", NOT_ASCII_DIGITS)
async def test_run_ids_are_ascii_digits_else_404_even_when_python_reads_them_as_a_number(one_run, run_id):
    assert (await one_run.finished(1))["status"] == "ok"
    for path in (f"/runs/{run_id}", f"/runs/{run_id}/table"):
        status, err, resp = await one_run.get(path)
        assert status == 404 and resp.content_type == "application/json"
        assert "run ids are positive integers" in err["error"]
