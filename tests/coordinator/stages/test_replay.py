"""The input log: what each stage was sent per session, and the refill of a worker in a stage's place."""

from __future__ import annotations

import asyncio

import numpy as np

from coordinator.stages.chain import ForwardRequest
from coordinator.stages.replay import InputLog
from workers.fake import reference
from workers.protocol.info import BatchItem


class Worker:
    """Stands for a worker's client: the log only tells one from another and reads its address."""

    def __init__(self, addr: str) -> None:
        self.addr = addr


def rows(start: int, n: int) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.float32)[:, None] * np.ones((1, 4), np.float32)  # (n, 4)


def test_a_new_worker_lacks_every_earlier_row_and_the_one_that_took_them_lacks_none():
    log, old, new = InputLog(), Worker("old:1"), Worker("new:1")
    log.keep(1, old, [("s", 0, rows(0, 3))])
    log.keep(1, old, [("s", 3, rows(3, 1)), ("t", 0, rows(0, 2))])
    assert log.missing(1, old, "s", 4) is None
    addr, lacking = log.missing(1, new, "s", 4)
    assert addr == "old:1" and lacking.tobytes() == rows(0, 4).tobytes()
    assert log.missing(1, new, "s", 0) is None  # a forward from position 0 needs nothing before it
    assert log.missing(0, new, "s", 4) is None  # nothing was kept for stage 0
    assert log.nbytes("s") == 4 * 4 * 4 and log.nbytes("t") == 2 * 4 * 4
    log.drop("s")
    assert log.missing(1, new, "s", 4) is None and log.nbytes("s") == 0


def test_a_step_tried_again_replaces_the_rows_it_had_sent_and_a_gap_is_not_refilled():
    log, old, new = InputLog(), Worker("old:1"), Worker("new:1")
    log.keep(0, old, [("s", 0, rows(0, 4))])
    log.keep(0, old, [("s", 2, rows(20, 1))])  # the step at position 2 again, other rows this time
    _, lacking = log.missing(0, new, "s", 3)
    assert lacking[:, 0].tolist() == [0.0, 1.0, 20.0]
    assert log.missing(0, new, "s", 5) is None  # position 3 and 4 are not held: no partial refill


async def test_a_stage_restarted_between_two_forwards_is_refilled_before_the_next_one(launch):
    pipeline = await launch("fake:layers=4", 2)
    told = []

    def on_recovery(session, recovery, reason):
        told.append((session, reason, recovery))

    x = rows(0, 5)
    y = await pipeline.forward(ForwardRequest(BatchItem(x, "s", 0)))
    np.testing.assert_array_equal(y, reference(x, range(4)))
    old = pipeline.nodes[1].report.addr
    await asyncio.wait_for(pipeline.supervisor.restart(1), 30)
    step = rows(5, 1)
    y = await pipeline.forward(ForwardRequest(BatchItem(step, "s", 5), on_recovery=on_recovery))
    np.testing.assert_array_equal(y, reference(step, range(4)))
    assert (await pipeline.nodes[1].client.stats()).forwards == 2  # the refill of 5 rows, then the step
    assert (await pipeline.nodes[0].client.stats()).forwards == 2  # stage 0 kept its own: no refill
    [(session, reason, recovery)] = told
    assert session == "s" and reason is None  # refilled without a wait: it was back before the forward
    assert (recovery.stage, recovery.addr, recovery.replayed_positions) == (1, old, 5)
    assert recovery.new_addr == pipeline.nodes[1].report.addr != old and recovery.waited_ms == 0
