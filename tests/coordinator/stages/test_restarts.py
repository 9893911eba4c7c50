"""Restarts, node state and stats timeouts tell the truth: real workers, real signals, real HTTP."""

from __future__ import annotations

import asyncio
import os
import signal

import numpy as np
import pytest

from coordinator.api import nodes as api_module
from coordinator.stages.chain import ForwardRequest
from coordinator.stages.client import MAX_ABANDONED, RequestTimeout, WorkerError
from coordinator.stages.node import RestartPolicy
from coordinator.stages.pipeline import Pipeline, StageFailed
from tests.conftest import eventually, worker_pids
from workers.fake import reference
from workers.models.synthetic import make_input
from workers.protocol.info import BatchItem

QUICK = (0.05,)  # backoff short enough that a test of many restarts stays fast


async def kill_and_wait_up(pipeline: Pipeline, index: int, timeout: float = 10.0) -> int:
    """SIGKILL a stage's worker and wait until a new one is up; return the new pid."""
    node = pipeline.nodes[index]
    old = node.report.pid
    os.kill(old, signal.SIGKILL)
    back = f"stage {index} up again"
    await eventually(lambda: node.state == "up" and node.report.pid != old, timeout, back)
    return node.report.pid


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


async def forward_ok(pipeline: Pipeline) -> None:
    x = make_input(2, 4, 5)
    y = await asyncio.wait_for(pipeline.forward(ForwardRequest(BatchItem(x, "s", 0))), 10)
    np.testing.assert_array_equal(y, reference(x, range(4)))


@pytest.mark.parametrize(
    ("policy", "says"),
    [
        ({"budget": -1}, "restart budget must be an integer >= 0, got -1"),
        ({"window_s": 0}, "restart window must be a finite number of seconds > 0, got 0"),
        ({"window_s": float("nan")}, "restart window"),
        ({"backoff_s": ()}, "restart backoff must be one or more finite seconds >= 0, got ()"),
        ({"backoff_s": (1.0, -2.0)}, "got (1.0, -2.0)"),
    ],
)
def test_a_restart_policy_that_makes_no_sense_is_refused_naming_the_value(policy, says):
    with pytest.raises(ValueError) as refused:
        RestartPolicy(**policy)
    assert says in str(refused.value)


async def test_a_stage_killed_five_times_in_a_few_seconds_comes_back_every_time(launch):
    pipeline = await launch("fake:layers=4", 2, restart=RestartPolicy(backoff_s=QUICK))
    pids = {pipeline.nodes[1].report.pid}
    for _ in range(5):
        pids.add(await kill_and_wait_up(pipeline, 1))
    node = pipeline.nodes[1]
    assert len(pids) == 6 and node.restarts == 5 and node.restarts_in_window == 5
    assert pipeline.unready() is None
    await forward_ok(pipeline)


async def test_a_stage_out_of_its_budget_is_failed_and_a_manual_restart_brings_it_back(launch):
    pipeline = await launch("fake:layers=4", 2, restart=RestartPolicy(budget=2, backoff_s=QUICK))
    node = pipeline.nodes[1]
    for _ in range(2):
        await kill_and_wait_up(pipeline, 1)
    last = node.report.pid
    os.kill(last, signal.SIGKILL)
    await eventually(lambda: node.state == "failed", 10, "stage 1 to fail")
    unready = pipeline.unready()
    assert unready is not None and unready.startswith(f"{node.name} is failed: out of automatic restarts")
    assert "(2 allowed in 60 s)" in unready and f"process {last} exited" in unready
    assert "POST /nodes/1/restart or restart the coordinator" in unready
    with pytest.raises(StageFailed, match=r"stage 1 .* is failed"):
        await asyncio.wait_for(pipeline.forward(ForwardRequest(BatchItem(make_input(2, 4, 0), "s", 0))), 10)
    assert worker_pids(os.getpid()) == [pipeline.nodes[0].report.pid]

    await asyncio.wait_for(pipeline.restart(1), 15)
    assert node.state == "up" and node.error is None and node.restarts == 3 and node.restarts_in_window == 0
    assert pipeline.unready() is None
    await forward_ok(pipeline)


async def test_a_stage_that_stays_up_through_the_window_has_its_restarts_forgotten(launch):
    policy = RestartPolicy(budget=1, window_s=1.0, backoff_s=QUICK)
    pipeline = await launch("fake:layers=4", 2, restart=policy)
    node = pipeline.nodes[1]
    await kill_and_wait_up(pipeline, 1)
    assert node.restarts_in_window == 1
    await eventually(lambda: node.restarts_in_window == 0, 3, "the restart to leave the window")
    await kill_and_wait_up(pipeline, 1)
    assert node.state == "up" and node.restarts == 2


async def test_manual_restarts_do_not_spend_the_automatic_budget(launch):
    pipeline = await launch("fake:layers=4", 2, restart=RestartPolicy(budget=1, backoff_s=QUICK))
    node = pipeline.nodes[1]
    for _ in range(2):
        await asyncio.wait_for(pipeline.restart(1), 15)
    assert node.restarts == 2 and node.restarts_in_window == 0
    await kill_and_wait_up(pipeline, 1)
    assert node.state == "up" and node.restarts_in_window == 1


async def test_a_manual_restart_during_an_automatic_one_leaves_one_worker_per_stage(launch):
    # The slow build keeps the automatic restart busy launching when the manual one arrives.
    pipeline = await launch("fake:layers=4,late_ms=1500,stage=2", 2, restart=RestartPolicy(backoff_s=QUICK))
    node = pipeline.nodes[1]
    os.kill(node.report.pid, signal.SIGKILL)
    await eventually(lambda: node.state == "restarting", 5, "the automatic restart to begin")
    await asyncio.wait_for(pipeline.restart(1), 15)
    assert node.state == "up" and node.restarts == 2
    assert sorted(worker_pids(os.getpid())) == sorted(n.report.pid for n in pipeline.nodes)
    await forward_ok(pipeline)


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
