"""Real worker processes, real sockets: forwards through 1..4 stages."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import numpy as np
import pytest

from coordinator.runs.requests import RunRequest
from coordinator.stages.chain import ForwardRequest
from coordinator.stages.pipeline import StageFailed
from coordinator.stages.supervisor import attach_pipeline
from tests.conftest import eventually, worker_pids
from tests.support.soak import soak_beyond
from workers.fake import reference
from workers.models import build, describe
from workers.models.synthetic import make_input
from workers.protocol.info import BatchItem
from workers.protocol.report import LayerRange

# One stage is both the first and the last; four hold a first, two middle and a last stage, every kind of
# hop two or three stages make (make soak runs those as well).
ANY_SPLIT = soak_beyond([1, 2, 3, 4], keep=[1, 4])


@pytest.mark.parametrize("stages", ANY_SPLIT)
async def test_fake_stages_each_apply_once_in_order(launch, stages):
    pipeline = await launch("fake:layers=8", stages)
    x = make_input(5, 4, seed=3)
    timings = []
    y = await pipeline.forward(ForwardRequest(BatchItem(x, "s", 0), on_stage=timings.append))
    np.testing.assert_array_equal(y, reference(x, range(8)))
    assert [t.stage for t in timings] == list(range(stages))
    assert [str(t.layers) for t in timings] == [str(n.layers) for n in pipeline.nodes]
    assert all(t.forward_ms >= t.compute_ms >= 0 for t in timings)


@pytest.mark.parametrize("stages", ANY_SPLIT)
async def test_synthetic_pipeline_output_equals_single_process_forward_bitwise(cluster, stages):
    model = "synthetic:layers=8,hidden=64,seed=5"
    opened = await cluster(model, stages)
    run = await asyncio.wait_for(opened.runner.run(RunRequest(seq=7, seed=11)), 30)
    whole = build(model, LayerRange(0, 8), "f32")
    expected = whole.forward(make_input(7, 64, 11), session="s", start_pos=0, last_only=False)
    got = np.asarray(run.output, dtype=np.float32).reshape(expected.shape)
    assert run.status == "ok", run.error
    assert got.tobytes() == expected.tobytes()
    assert (
        len(run.timings) == stages and run.total_forward_ms >= sum(t.forward_ms for t in run.timings) * 0.99
    )


async def test_the_next_stage_is_sent_while_a_stage_hook_still_runs(launch):
    # The forward thread hands each stage's hook to the loop and goes on: stage 0's hook, holding the
    # loop, sees the thread ask `halt` before stage 1, which a thread waiting for the hook never would.
    pipeline = await launch("fake:layers=3", 3)
    asked = [threading.Event() for _ in range(3)]
    order: list[int] = []

    def halt() -> None:
        asked[sum(e.is_set() for e in asked)].set()

    def hook(t) -> None:
        if t.stage == 0:
            assert asked[1].wait(10), "stage 1 was not sent before stage 0's hook returned"
        order.append(t.stage)

    x = make_input(2, 4, seed=1)
    y = await pipeline.forward(ForwardRequest(BatchItem(x, "s", 0), hook, halt))
    np.testing.assert_array_equal(y, reference(x, range(3)))
    assert order == [0, 1, 2] and all(e.is_set() for e in asked)


async def test_a_halt_that_raises_stops_the_forward_before_the_next_stage(launch):
    pipeline = await launch("fake:layers=3", 3)
    calls: list[int] = []

    def halt() -> None:
        calls.append(len(calls))
        if len(calls) == 2:
            raise RuntimeError("cancelled while running")

    timings = []
    with pytest.raises(RuntimeError, match="cancelled while running"):
        await pipeline.forward(
            ForwardRequest(BatchItem(make_input(2, 4, seed=1), "s", 0), timings.append, halt)
        )
    assert len(calls) == 2 and [t.stage for t in timings] == [0]
    forwards = [(await node.client.stats()).forwards for node in pipeline.nodes]
    assert forwards == [1, 0, 0], "a stage after the halt computed"
    again = await pipeline.forward(ForwardRequest(BatchItem(make_input(2, 4, seed=1), "t", 0)))
    assert again.shape == (2, 4)


async def test_with_recovery_off_a_worker_killed_mid_forward_fails_within_two_seconds_naming_stage(launch):
    pipeline = await launch("fake:layers=4,delay_ms=2000,stage=2", 2, recover_timeout=0)
    victim = pipeline.nodes[1]
    forward = asyncio.create_task(pipeline.forward(ForwardRequest(BatchItem(make_input(2, 4, 0), "s", 0))))
    await eventually(lambda: victim.report.pid in worker_pids(os.getpid()), what="the victim")
    await asyncio.sleep(0.3)  # let the forward reach the slow stage
    killed = time.monotonic()
    os.kill(victim.report.pid, signal.SIGKILL)
    with pytest.raises(StageFailed) as failed:
        await asyncio.wait_for(forward, 5)
    assert time.monotonic() - killed < 2.0
    assert "stage 1" in str(failed.value) and victim.report.addr in str(failed.value)
    assert victim.state in ("down", "restarting")
    assert (failed.value.stage, failed.value.addr, failed.value.lost) == (1, victim.report.addr, True)
    assert failed.value.reason in str(failed.value) and "stage 1" not in failed.value.reason


async def test_with_recovery_off_a_hanging_worker_times_out_naming_the_stage_and_drops_the_connection(launch):
    pipeline = await launch("fake:layers=4,hang_on=1,stage=0", 2, forward_timeout=0.5, recover_timeout=0)
    started = time.monotonic()
    with pytest.raises(StageFailed) as failed:
        await asyncio.wait_for(pipeline.forward(ForwardRequest(BatchItem(make_input(2, 4, 0), "s", 0))), 10)
    assert time.monotonic() - started < 3
    assert "stage 0" in str(failed.value) and "no reply within 0.5s" in str(failed.value)
    assert pipeline.nodes[0].client.lost is not None
    assert (failed.value.stage, failed.value.lost) == (0, True)
    assert "no reply within 0.5s" in failed.value.reason


async def test_worker_error_fails_the_forward_but_keeps_the_node_up(launch):
    pipeline = await launch("fake:layers=4,fail_on=1,stage=2", 2)
    with pytest.raises(StageFailed, match="fake failure on forward 1") as failed:
        await pipeline.forward(ForwardRequest(BatchItem(make_input(2, 4, 0), "s", 0)))
    assert (failed.value.stage, failed.value.addr) == (1, pipeline.nodes[1].report.addr)
    assert not failed.value.lost and "fake failure on forward 1" in failed.value.reason
    x = make_input(2, 4, 0)
    y = await pipeline.forward(ForwardRequest(BatchItem(x, "s", 0)))
    np.testing.assert_array_equal(y, reference(x, range(4)))
    assert [n.state for n in pipeline.nodes] == ["up", "up"]


async def test_attach_connects_to_running_workers_in_order(launch):
    launched = await launch("fake:layers=6", 3)
    info = describe("fake:layers=6")
    attached = await attach_pipeline(info, [n.report.addr for n in launched.nodes], launched.supervisor.token)
    try:
        x = make_input(2, 4, 9)
        np.testing.assert_array_equal(
            await attached.forward(ForwardRequest(BatchItem(x, "a", 0))), reference(x, range(6))
        )
        with pytest.raises(StageFailed, match="contiguous"):
            await attach_pipeline(info, [launched.nodes[1].report.addr], launched.supervisor.token)
    finally:
        await attached.close()


async def test_a_stage_lost_while_a_hook_raised_is_taken_down_and_the_hook_error_is_raised(launch):
    # Stage 0's hook raises only once the thread has passed the halt before stage 1, so stage 1 is sent
    # while the hook raises; its worker hangs and the link drops. The forward's caller gets the hook's
    # error, and the stage whose connection is gone must still go down, not wait for the next run.
    pipeline = await launch("fake:layers=2,hang_on=1,stage=1", 2, forward_timeout=0.5)
    asked = [threading.Event(), threading.Event()]

    def halt() -> None:
        asked[asked[0].is_set()].set()

    def hook(t) -> None:
        if t.stage == 0:
            assert asked[1].wait(10), "stage 1 was not reached"
            raise RuntimeError("cancelled while stage 1 computed")

    victim = pipeline.nodes[1]
    client = victim.client
    request = ForwardRequest(BatchItem(make_input(2, 4, 0), "s", 0), hook, halt)
    with pytest.raises(RuntimeError, match="cancelled while stage 1 computed"):
        await asyncio.wait_for(pipeline.forward(request), 10)
    assert client.lost is not None and "no reply" in client.lost
    assert victim.state in ("down", "restarting") and "no reply within 0.5s" in victim.error


async def test_with_recovery_off_a_stage_not_up_refuses_the_forward_before_any_stage_computes_naming_it(
    launch,
):
    pipeline = await launch("fake:layers=4", 2, recover_timeout=0)
    node = pipeline.nodes[1]
    node.set("down", "taken out by the test")
    with pytest.raises(StageFailed) as failed:
        await asyncio.wait_for(pipeline.forward(ForwardRequest(BatchItem(make_input(2, 4, 0), "s", 0))), 10)
    assert str(failed.value) == f"{node.name} is down: taken out by the test"
    assert (failed.value.stage, failed.value.addr, failed.value.lost) == (1, node.report.addr, False)
    assert failed.value.reason == "down: taken out by the test"
    assert (await pipeline.nodes[0].client.stats()).forwards == 0


async def test_a_forward_whose_caller_leaves_while_a_stage_computes_leaves_every_link_in_step(launch):
    # The stage's reply is still read (and dropped), so the next forward's replies are its own; the
    # forward goes no further than the stage it had sent.
    pipeline = await launch("fake:layers=4,delay_ms=300", 2)
    asked: list[int] = []
    x = make_input(2, 4, 3)
    forward = asyncio.create_task(
        pipeline.forward(ForwardRequest(BatchItem(x, "left", 0), halt=lambda: asked.append(len(asked))))
    )
    await eventually(lambda: asked == [0], what="stage 0 sent the forward")
    forward.cancel()
    with pytest.raises(asyncio.CancelledError):
        await forward
    y = make_input(1, 4, 4)
    np.testing.assert_array_equal(
        await asyncio.wait_for(pipeline.forward(ForwardRequest(BatchItem(y, "next", 0))), 10),
        reference(y, range(4)),
    )
    assert all(n.client.lost is None and n.state == "up" for n in pipeline.nodes)
    assert (await pipeline.nodes[1].client.stats()).forwards == 1  # the next forward's alone
