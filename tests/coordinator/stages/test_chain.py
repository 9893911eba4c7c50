"""One forward's walk through real workers' stages, on a thread, and the outcome it ends in."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from coordinator.stages.chain import (
    Cancelled,
    Chain,
    Finished,
    HookFailed,
    StageDown,
    WorkerFailed,
    never_halt,
    no_hook,
)
from coordinator.stages.client import WorkerClient, WorkerError
from coordinator.stats import StageTiming
from workers.fake import reference
from workers.models.synthetic import make_input
from workers.protocol.info import BatchItem

X = make_input(2, 4, seed=7)


def forward_hop(sent: list[str] | None = None, timeout: float = 5.0):
    """A hop as Pipeline.forward makes one: the item's rows over the link; notes which worker it asked."""

    def hop(client: WorkerClient, x: np.ndarray) -> tuple[np.ndarray, float]:
        if sent is not None:
            sent.append(client.addr)
        return client.forward_now(BatchItem(x, "s", 0), timeout=timeout)

    return hop


async def forwards(pipeline) -> list[int]:
    """How many forwards each stage's worker has computed."""
    return [(await node.client.stats()).forwards for node in pipeline.nodes]


async def test_the_stages_are_sent_in_order_and_their_hooks_run_on_the_loop_in_order(launch):
    pipeline = await launch("fake:layers=6", 3)
    loop_thread = threading.get_ident()
    heard: list[tuple[int, bool]] = []

    def hook(t: StageTiming) -> None:
        heard.append((t.stage, threading.get_ident() == loop_thread))

    sent: list[str] = []
    chain = Chain(asyncio.get_running_loop(), hook)
    outcome = await asyncio.to_thread(chain.run, pipeline.nodes, X, forward_hop(sent))
    assert isinstance(outcome, Finished)
    np.testing.assert_array_equal(outcome.output, reference(X, range(6)))
    assert sent == [node.report.addr for node in pipeline.nodes]
    # The hooks handed to the loop ran before the outcome came back; the last is the caller's to run.
    assert heard == [(0, True), (1, True)]
    chain.settle()
    assert heard == [(0, True), (1, True), (2, True)]


async def test_a_chain_without_a_hook_still_forwards_through_every_stage(launch):
    pipeline = await launch("fake:layers=4", 2)
    outcome = await asyncio.to_thread(
        Chain(asyncio.get_running_loop(), no_hook).run, pipeline.nodes, X, forward_hop()
    )
    assert isinstance(outcome, Finished)
    np.testing.assert_array_equal(outcome.output, reference(X, range(4)))
    assert await forwards(pipeline) == [1, 1]


async def test_a_halt_that_raises_before_a_stage_stops_the_chain_there_as_cancelled(launch):
    pipeline = await launch("fake:layers=6", 3)
    asked: list[int] = []
    cancel = RuntimeError("cancelled while running")

    def halt() -> None:
        asked.append(len(asked))
        if len(asked) == 3:  # before stage 2
            raise cancel

    timings: list[StageTiming] = []
    chain = Chain(asyncio.get_running_loop(), timings.append, halt)
    outcome = await asyncio.to_thread(chain.run, pipeline.nodes, X, forward_hop())
    assert outcome == Cancelled(cancel)
    assert [t.stage for t in timings] == [0, 1]  # the stages that replied are still heard
    assert await forwards(pipeline) == [1, 1, 0]


async def test_a_hook_that_raises_stops_the_chain_before_the_next_stage_and_silences_later_hooks(launch):
    # Stage 0's hook raises once the thread has asked the halt before stage 1 (so stage 1 is sent), and
    # stage 1 replies once the hook has raised (so the thread meets the error before stage 2).
    pipeline = await launch("fake:layers=6", 3)
    boom = RuntimeError("the hook broke")
    before_stage_1 = threading.Event()
    asked: list[int] = []
    heard: list[int] = []

    def halt() -> None:
        asked.append(len(asked))
        if len(asked) == 2:
            before_stage_1.set()

    def hook(t: StageTiming) -> None:
        heard.append(t.stage)
        if t.stage == 0:
            assert before_stage_1.wait(10), "stage 1 was not reached"
            raise boom

    chain = Chain(asyncio.get_running_loop(), hook, halt)
    inner = forward_hop()

    def hop(client: WorkerClient, x: np.ndarray) -> tuple[np.ndarray, float]:
        out = inner(client, x)
        deadline = time.monotonic() + 10
        while client is pipeline.nodes[1].client and chain.hook_error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return out

    outcome = await asyncio.to_thread(chain.run, pipeline.nodes, X, hop)
    assert outcome == HookFailed(boom) and chain.hook_error is boom
    assert heard == [0]  # stage 1 replied, but a hook already raised: its hook is not run
    assert await forwards(pipeline) == [1, 1, 0]


async def test_a_stage_that_is_not_up_when_its_turn_comes_ends_the_chain_as_stage_down(launch):
    pipeline = await launch("fake:layers=6", 3)
    node = pipeline.nodes[1]
    node.set("down", "taken out by the test")
    outcome = await asyncio.to_thread(
        Chain(asyncio.get_running_loop(), no_hook).run, pipeline.nodes, X, forward_hop()
    )
    assert outcome == StageDown(node, "down: taken out by the test")
    assert await forwards(pipeline) == [1, 0, 0]


async def test_a_stage_without_a_client_is_down_as_not_connected(launch):
    pipeline = await launch("fake:layers=4", 2)
    node = pipeline.nodes[0]
    client, node.client = node.client, None
    try:
        outcome = await asyncio.to_thread(
            Chain(asyncio.get_running_loop(), no_hook).run, pipeline.nodes, X, forward_hop()
        )
    finally:
        node.client = client
    assert outcome == StageDown(node, "up: not connected")


async def test_a_worker_that_refuses_ends_the_chain_as_worker_failed_with_its_link_kept(launch):
    pipeline = await launch("fake:layers=6,fail_on=1,stage=2", 3)
    node = pipeline.nodes[1]
    outcome = await asyncio.to_thread(
        Chain(asyncio.get_running_loop(), no_hook).run, pipeline.nodes, X, forward_hop()
    )
    assert isinstance(outcome, WorkerFailed)
    assert (outcome.node, outcome.client) == (node, node.client)
    assert isinstance(outcome.error, WorkerError) and "fake failure on forward 1" in str(outcome.error)
    assert node.client.lost is None
    assert await forwards(pipeline) == [1, 0, 0]  # a worker counts the forwards it computed


async def test_a_worker_that_hangs_ends_the_chain_as_worker_failed_with_its_link_lost(launch):
    pipeline = await launch("fake:layers=4,hang_on=1,stage=2", 2)
    node = pipeline.nodes[1]
    chain = Chain(asyncio.get_running_loop(), no_hook)
    outcome = await asyncio.to_thread(chain.run, pipeline.nodes, X, forward_hop(timeout=0.5))
    assert isinstance(outcome, WorkerFailed) and outcome.node is node
    assert "no reply within 0.5s (connection dropped)" in str(outcome.error)
    assert node.client.link.lost is not None and node.client.lost is not None


async def test_a_chain_whose_caller_left_sends_nothing_and_runs_no_hook(launch):
    pipeline = await launch("fake:layers=4", 2)
    heard: list[StageTiming] = []
    chain = Chain(asyncio.get_running_loop(), heard.append, never_halt)
    chain.stop()
    outcome = await asyncio.to_thread(chain.run, pipeline.nodes, X, forward_hop())
    assert outcome == Cancelled(None)
    assert heard == [] and await forwards(pipeline) == [0, 0]


@pytest.mark.parametrize("stages", [1, 2])
async def test_each_stage_timing_names_its_stage_and_holds_its_compute(launch, stages):
    pipeline = await launch("fake:layers=4,delay_ms=20", stages)
    timings: list[StageTiming] = []
    chain = Chain(asyncio.get_running_loop(), timings.append)
    await asyncio.to_thread(chain.run, pipeline.nodes, X, forward_hop())
    assert len(timings) == stages - 1  # the last stage's is the caller's to run
    chain.settle()
    assert [(t.stage, t.addr) for t in timings] == [(n.index, n.report.addr) for n in pipeline.nodes]
    assert all(t.forward_ms >= t.compute_ms >= 20 for t in timings)
