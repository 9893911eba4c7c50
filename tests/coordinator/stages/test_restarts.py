"""Restarts and node state over HTTP, and stats timeouts, tell the truth: real workers, signals and HTTP.

How a supervisor restarts a stage (budget, window, backoff) is tested in test_supervisor.py.
"""

from __future__ import annotations

import asyncio
import os
import signal

from coordinator.api import nodes as api_module
from coordinator.stages.client import MAX_ABANDONED, RequestTimeout, WorkerError
from coordinator.stages.node import RestartPolicy
from tests.conftest import eventually, worker_pids


async def pause(pid: int) -> None:
    """SIGSTOP `pid` and wait until every thread of it is stopped: a signal lands a moment after kill."""
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                states.append(f.read().rpartition(")")[2].split()[0])
        return all(state in ("T", "t") for state in states)

    await eventually(stopped, 5, f"process {pid} to stop")


async def test_five_concurrent_restart_requests_share_one_restart_and_one_worker(api):
    before = [n.report.pid for n in api.cluster.pipeline.nodes]
    answers = await asyncio.wait_for(asyncio.gather(*(api.post("/nodes/0/restart") for _ in range(5))), 20)
    assert [status for status, _, _ in answers] == [200] * 5
    pids = {body["pid"] for _, body, _ in answers}
    assert len(pids) == 1 and before[0] not in pids
    _, nodes, _ = await api.get("/nodes")
    assert [n["restarts"] for n in nodes["nodes"]] == [1, 0]
    assert [n["pid"] for n in nodes["nodes"]] == [*pids, before[1]]
    assert sorted(worker_pids(os.getpid())) == sorted([*pids, before[1]])


async def test_a_failed_stage_shows_in_nodes_with_what_to_do(api):
    pipeline = api.cluster.pipeline
    pipeline.nodes[0].policy = RestartPolicy(budget=0)  # fail at the first death
    killed = pipeline.nodes[0].report.pid
    os.kill(killed, signal.SIGKILL)

    async def failed():
        node = (await api.get("/nodes"))[1]["nodes"][0]
        return node if node["state"] == "failed" else None

    node = await eventually(failed, 10, "stage 0 to be failed")
    assert node["restarts"] == 0 and node["restarts_in_window"] == 0
    assert f"process {killed} exited" in node["error"] and "POST /nodes/0/restart" in node["error"]
    assert "stage 0" in pipeline.unready() and "failed" in pipeline.unready()
    status, node, _ = await api.post("/nodes/0/restart")
    assert status == 200 and node["state"] == "up" and node["error"] is None
    assert pipeline.unready() is None


async def test_a_paused_worker_times_out_on_stats_but_keeps_its_connection_and_is_not_restarted(
    api, monkeypatch
):
    monkeypatch.setattr(api_module, "LIVE_TIMEOUT", 0.5)
    paused = api.cluster.pipeline.nodes[1].report.pid
    try:
        await pause(paused)
        status, body, _ = await api.get("/nodes?live=1")
    finally:
        os.kill(paused, signal.SIGCONT)
    assert status == 200
    first, second = body["nodes"]
    assert "forwards" in first["live"] and second["state"] == "up"
    assert "timed out" in second["live"]["error"] and "within 0.5s" in second["live"]["error"]

    _, posted, _ = await api.post("/runs", json={"seq": 2})
    assert (await api.finished(posted["id"]))["status"] == "ok"
    status, body, _ = await api.get("/nodes?live=1")
    assert [n["pid"] for n in body["nodes"]][1] == paused
    assert [n["restarts"] for n in body["nodes"]] == [0, 0]
    assert [n["live"]["forwards"] for n in body["nodes"]] == [1, 1]


async def test_a_connection_drops_once_too_many_timed_out_requests_wait_on_it(launch):
    pipeline = await launch("fake:layers=4", 1)
    client, pid = pipeline.nodes[0].client, pipeline.nodes[0].report.pid
    try:
        await pause(pid)
        asks = [client.stats(timeout=0.3) for _ in range(MAX_ABANDONED + 1)]
        answers = await asyncio.wait_for(asyncio.gather(*asks, return_exceptions=True), 5)
    finally:
        os.kill(pid, signal.SIGCONT)
    kept = [a for a in answers if isinstance(a, RequestTimeout)]
    dropped = [a for a in answers if isinstance(a, WorkerError) and not isinstance(a, RequestTimeout)]
    assert len(kept) == MAX_ABANDONED and len(dropped) == 1
    assert "connection dropped" in str(dropped[0]) and "no reply to getstats within 0.3s" in client.lost
