"""Supervisors keep the stages' workers: real fake-model workers, real signals, real sockets.

Launched workers are restarted within a budget, after a backoff, one restart shared by whoever asks;
attached and joined ones are only marked down; and anyone may wait until a stage is back.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import numpy as np
import pytest

from coordinator.events import NodeChanged
from coordinator.launch.base import LaunchError
from coordinator.stages.node import Node, RestartPolicy
from coordinator.stages.pipeline import Pipeline, StageFailed
from coordinator.stages.supervisor import JoinedSupervisor, Supervisor, attach_pipeline
from tests.conftest import eventually, worker_pids
from workers.fake import reference
from workers.models import describe
from workers.models.synthetic import make_input
from workers.protocol.report import LayerRange

QUICK = (0.05,)  # backoff short enough that a test of many restarts stays fast


async def kill_and_wait_up(pipeline: Pipeline, index: int, timeout: float = 10.0) -> int:
    """SIGKILL a stage's worker and wait until a new one is up; return the new pid."""
    node = pipeline.nodes[index]
    old = node.report.pid
    os.kill(old, signal.SIGKILL)
    back = f"stage {index} up again"
    await eventually(lambda: node.state == "up" and node.report.pid != old, timeout, back)
    return node.report.pid


async def forward_ok(pipeline: Pipeline) -> None:
    x = make_input(2, 4, 5)
    y = await asyncio.wait_for(pipeline.forward(x, session="s", start_pos=0), 10)
    np.testing.assert_array_equal(y, reference(x, range(4)))


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
        await asyncio.wait_for(pipeline.forward(make_input(2, 4, 0), session="s", start_pos=0), 10)
    assert worker_pids(os.getpid()) == [pipeline.nodes[0].report.pid]

    await asyncio.wait_for(pipeline.supervisor.restart(1), 15)
    assert node.state == "up" and node.error is None and node.restarts == 3 and node.restarts_in_window == 0
    assert pipeline.unready() is None
    await forward_ok(pipeline)


async def test_a_stage_that_stays_up_through_the_window_has_its_restarts_forgotten(launch):
    # The window outlasts a restart on a busy host (a worker took 1.2 s to start on 2 shared cores,
    # past a 1 s window before the count could be seen) and is short enough to wait out.
    policy = RestartPolicy(budget=1, window_s=3.0, backoff_s=QUICK)
    pipeline = await launch("fake:layers=4", 2, restart=policy)
    node = pipeline.nodes[1]
    await kill_and_wait_up(pipeline, 1)
    assert node.restarts_in_window == 1
    await eventually(lambda: node.restarts_in_window == 0, 5, "the restart to leave the window")
    await kill_and_wait_up(pipeline, 1)
    assert node.state == "up" and node.restarts == 2


async def test_manual_restarts_do_not_spend_the_automatic_budget(launch):
    pipeline = await launch("fake:layers=4", 2, restart=RestartPolicy(budget=1, backoff_s=QUICK))
    node = pipeline.nodes[1]
    for _ in range(2):
        await asyncio.wait_for(pipeline.supervisor.restart(1), 15)
    assert node.restarts == 2 and node.restarts_in_window == 0
    await kill_and_wait_up(pipeline, 1)
    assert node.state == "up" and node.restarts_in_window == 1


async def test_a_manual_restart_during_an_automatic_one_leaves_one_worker_per_stage(launch):
    # The slow build keeps the automatic restart busy launching when the manual one arrives.
    pipeline = await launch("fake:layers=4,late_ms=1500,stage=2", 2, restart=RestartPolicy(backoff_s=QUICK))
    node = pipeline.nodes[1]
    os.kill(node.report.pid, signal.SIGKILL)
    await eventually(lambda: node.state == "restarting", 5, "the automatic restart to begin")
    await asyncio.wait_for(pipeline.supervisor.restart(1), 15)
    assert node.state == "up" and node.restarts == 2
    assert sorted(worker_pids(os.getpid())) == sorted(n.report.pid for n in pipeline.nodes)
    await forward_ok(pipeline)


async def test_dead_stage_is_restarted_and_the_next_forward_succeeds(launch):
    pipeline = await launch("fake:layers=4", 2)
    survivor_pid = pipeline.nodes[0].report.pid
    old_pid = pipeline.nodes[1].report.pid
    os.kill(old_pid, signal.SIGKILL)
    await eventually(
        lambda: pipeline.nodes[1].restarts == 1 and pipeline.nodes[1].state == "up", 15, "restart"
    )
    assert pipeline.nodes[1].report.pid != old_pid
    assert pipeline.nodes[0].report.pid == survivor_pid
    x = make_input(3, 4, 1)
    y = await asyncio.wait_for(pipeline.forward(x, session="s", start_pos=0), 10)
    np.testing.assert_array_equal(y, reference(x, range(4)))


async def test_an_automatic_restart_waits_its_backoff_and_the_next_one_in_the_window_waits_longer(launch):
    pipeline = await launch("fake:layers=4", 2, restart=RestartPolicy(backoff_s=(0.4, 1.2)))
    sub = pipeline.bus.subscribe(accept=lambda e: isinstance(e, NodeChanged) and e.stage == 1)
    waits = []
    for _ in range(2):
        await kill_and_wait_up(pipeline, 1)
        events = [await asyncio.wait_for(sub.get(), 5) for _ in range(3)]
        assert [e.state for e in events] == ["down", "restarting", "up"]
        waits.append(events[1].time - events[0].time)
    assert 0.4 <= waits[0] < 1.2 <= waits[1], waits


async def test_concurrent_manual_restarts_share_one_restart_and_one_worker(launch):
    pipeline = await launch("fake:layers=4", 2)
    node, before = pipeline.nodes[1], pipeline.nodes[1].report.pid
    restarts = [pipeline.supervisor.restart(1) for _ in range(3)]
    nodes = await asyncio.wait_for(asyncio.gather(*restarts), 15)
    assert nodes == [node] * 3 and node.restarts == 1 and node.state == "up"
    assert node.report.pid != before
    assert sorted(worker_pids(os.getpid())) == sorted(n.report.pid for n in pipeline.nodes)


async def test_concurrent_manual_restarts_that_fail_all_get_the_one_failure(launch):
    pipeline = await launch("fake:layers=4", 2)
    node = pipeline.nodes[1]
    pipeline.supervisor.launcher.model = "fake:layers=4,exit_before_report=1"  # the next worker cannot build
    restarts = [pipeline.supervisor.restart(1) for _ in range(3)]
    failures = await asyncio.wait_for(asyncio.gather(*restarts, return_exceptions=True), 15)
    assert all(isinstance(f, LaunchError) for f in failures) and len({id(f) for f in failures}) == 1
    assert node.restarts == 1 and node.state == "down" and node.error == str(failures[0])
    assert worker_pids(os.getpid()) == [pipeline.nodes[0].report.pid]


async def test_wait_up_returns_at_once_for_a_stage_that_is_up(launch):
    pipeline = await launch("fake:layers=4", 2)
    assert await asyncio.wait_for(pipeline.supervisor.wait_up(1, 0), 1) is pipeline.nodes[1]


async def test_wait_up_resolves_when_the_supervisor_has_brought_the_stage_back(launch):
    pipeline = await launch("fake:layers=4", 2, restart=RestartPolicy(backoff_s=(0.3,)))
    node = pipeline.nodes[1]
    old = node.report.pid
    os.kill(old, signal.SIGKILL)
    await eventually(lambda: node.state != "up", 5, "stage 1 to go down")
    back = await pipeline.supervisor.wait_up(1, 15)
    assert back is node and node.state == "up" and node.report.pid != old and node.restarts == 1
    await forward_ok(pipeline)


async def test_wait_up_times_out_naming_the_stage_and_why_it_is_not_up(launch):
    pipeline = await launch("fake:layers=4", 2, restart=RestartPolicy(budget=0))
    node = pipeline.nodes[1]
    killed = node.report.pid
    os.kill(killed, signal.SIGKILL)
    await eventually(lambda: node.state == "failed", 10, "stage 1 to fail")
    started = time.monotonic()
    with pytest.raises(TimeoutError) as timed_out:
        await asyncio.wait_for(pipeline.supervisor.wait_up(1, 0.5), 5)
    assert 0.5 <= time.monotonic() - started < 3
    said = str(timed_out.value)
    assert said.startswith(f"{node.name} is not up after 0.5s; it is failed: out of automatic restarts")
    assert f"process {killed} exited" in said


async def test_wait_up_ends_when_the_supervisor_closes_and_refuses_a_stage_that_does_not_exist(launch):
    pipeline = await launch("fake:layers=4", 2, restart=RestartPolicy(budget=0))
    supervisor = pipeline.supervisor
    with pytest.raises(ValueError, match=r"no stage 2: the stages are 0\.\.1"):
        await supervisor.wait_up(2, 1)
    with pytest.raises(ValueError, match="timeout must be a number of seconds >= 0, got -1"):
        await supervisor.wait_up(0, -1)
    os.kill(pipeline.nodes[0].report.pid, signal.SIGKILL)
    await eventually(lambda: pipeline.nodes[0].state == "failed", 10, "stage 0 to fail")
    waiting = asyncio.create_task(supervisor.wait_up(0, 30))
    # Closed while it waits, not before it began (which would end it too, without showing the wake-up).
    await eventually(lambda: supervisor._waiting, 5, "wait_up to follow the stage")
    await supervisor.close()
    with pytest.raises(StageFailed, match=r"stage 0 .* will not come back: its supervisor is closed"):
        await asyncio.wait_for(waiting, 5)


async def test_attached_workers_are_only_marked_down_and_cannot_be_restarted_from_here(launch):
    launched = await launch("fake:layers=4", 2)
    addrs = [n.report.addr for n in launched.nodes]
    attached = await attach_pipeline(describe("fake:layers=4"), addrs, launched.supervisor.token)
    try:
        assert type(attached.supervisor) is Supervisor
        with pytest.raises(
            StageFailed, match="workers were attached, not launched: restart them where they run"
        ):
            await attached.supervisor.restart(1)
        node = attached.nodes[1]
        os.kill(launched.nodes[1].report.pid, signal.SIGKILL)
        with pytest.raises(StageFailed, match="stage 1"):
            await asyncio.wait_for(attached.forward(make_input(2, 4, 0), session="s", start_pos=0), 10)
        assert node.state == "down" and node.restarts == 0
        with pytest.raises(TimeoutError, match=r"stage 1 .* is not up after 0.2s; it is down"):
            await attached.supervisor.wait_up(1, 0.2)
    finally:
        await attached.close()


class Told:
    """The join side, as a joined supervisor sees it: it only remembers which stages went down."""

    def __init__(self) -> None:
        self.down: list[int] = []

    def stage_down(self, node: Node) -> None:
        self.down.append(node.index)


async def test_a_joined_supervisor_tells_the_join_side_of_a_stage_that_went_down_and_restarts_nothing():
    nodes = [Node(i, LayerRange(2 * i, 2 * i + 2)) for i in range(2)]
    told = Told()
    supervisor = JoinedSupervisor(nodes, "token", told)
    supervisor.mark_down(nodes[1], "connection lost")
    supervisor.mark_down(nodes[1], "told twice")  # a stage that is down already is not told again
    assert told.down == [1] and (nodes[1].state, nodes[1].error) == ("down", "connection lost")
    with pytest.raises(StageFailed, match="workers joined, not launched: restart the worker where it runs"):
        await supervisor.restart(1)
    await supervisor.vacate(nodes[0], "its worker left: it closed the join connection")
    assert told.down == [1, 0] and nodes[0].error == "its worker left: it closed the join connection"
    events = [(e.stage, e.state) for e in supervisor.bus.after(0) if isinstance(e, NodeChanged)]
    assert events == [(0, "up"), (1, "up"), (1, "down"), (0, "down")]
    await supervisor.close()
