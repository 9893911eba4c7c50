"""A client of one real `fake:` worker process: the handshake, forwards over the link, stats, timeouts."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from contextlib import asynccontextmanager

import numpy as np
import pytest

from coordinator.launch.local import Launcher
from coordinator.stages.batch import split_rows, stack_batch
from coordinator.stages.client import ConnectionLost, WorkerClient, WorkerError
from tests.conftest import eventually, worker_pids
from workers.fake import reference
from workers.protocol.info import BatchItem
from workers.protocol.report import LayerRange

LAYERS = LayerRange(0, 4)


@asynccontextmanager
async def connected(spec: str = "fake:layers=4"):
    """One worker of `spec` holding all its layers, and a client connected to it; both gone afterwards."""
    launcher = Launcher(spec)
    try:
        worker = await launcher.start(0, LAYERS)
        client = await WorkerClient.connect(worker.report.addr, launcher.token, timeout=5)
        try:
            yield worker, client
        finally:
            await client.close()
    finally:
        await launcher.stop_all()
    assert worker_pids(os.getpid()) == []


async def test_a_client_connects_through_the_handshake_and_holds_the_workers_report():
    async with connected() as (worker, client):
        assert client.addr == worker.report.addr and client.report == worker.report
        assert client.report.layers == LAYERS and client.lost is None


async def test_a_client_with_the_wrong_token_is_refused_naming_the_address():
    launcher = Launcher("fake:layers=4")
    try:
        worker = await launcher.start(0, LAYERS)
        with pytest.raises(WorkerError, match=rf"worker {worker.report.addr}: cannot connect: .*wrong token"):
            await WorkerClient.connect(worker.report.addr, "not the token", timeout=5)
    finally:
        await launcher.stop_all()


async def test_connecting_where_nothing_listens_fails_naming_the_address():
    with socket.socket() as sock:  # a port that was free a moment ago, and is closed now
        sock.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(WorkerError, match=rf"worker {addr}: cannot connect"):
        await WorkerClient.connect(addr, "token", timeout=5)


async def test_forward_now_sends_the_items_rows_and_returns_the_stages_output_and_compute():
    async with connected("fake:layers=4,delay_ms=50") as (_, client):
        x = np.arange(12, dtype=np.float32).reshape(3, 4)
        y, compute_ms = await asyncio.to_thread(client.forward_now, BatchItem(x, "s", 0), timeout=5)
        np.testing.assert_array_equal(y, reference(x, range(4)))
        assert compute_ms >= 50
        last, _ = await asyncio.to_thread(client.forward_now, BatchItem(x, "s", 3, last_only=True), timeout=5)
        np.testing.assert_array_equal(last, reference(x, range(4))[-1:])  # the stage is the model's last


async def test_forward_batch_now_answers_each_sessions_rows_in_order():
    async with connected() as (_, client):
        items = [BatchItem(np.full((n, 4), n, np.float32), f"s{n}", 0) for n in (2, 1, 3)]
        x, entries = stack_batch(items)
        y, rows, _ = await asyncio.to_thread(client.forward_batch_now, x, entries, timeout=5)
        assert rows == [2, 1, 3]
        for item, got in zip(items, split_rows(y, rows), strict=True):
            np.testing.assert_array_equal(got, reference(item.x, range(4)))


async def test_a_refused_forward_is_a_worker_error_and_the_link_stays_up():
    async with connected("fake:layers=4,fail_on=1") as (_, client):
        x = np.ones((1, 4), np.float32)
        with pytest.raises(WorkerError, match="fake failure on forward 1"):
            await asyncio.to_thread(client.forward_now, BatchItem(x, "s", 0), timeout=5)
        assert client.lost is None
        y, _ = await asyncio.to_thread(client.forward_now, BatchItem(x, "s", 0), timeout=5)
        np.testing.assert_array_equal(y, reference(x, range(4)))


async def test_a_forward_with_no_reply_in_time_marks_the_link_lost_and_the_next_fails_at_once():
    async with connected("fake:layers=4,hang_on=1") as (_, client):
        item = BatchItem(np.ones((1, 4), np.float32), "s", 0)
        started = time.monotonic()
        with pytest.raises(WorkerError, match=r"no reply within 0\.5s \(connection dropped\)"):
            await asyncio.to_thread(client.forward_now, item, timeout=0.5)
        assert time.monotonic() - started < 3
        assert client.link.lost == "no reply to forward within 0.5s" and client.lost == client.link.lost
        # Its late output must not be taken for another forward's: the link is not used again.
        with pytest.raises(ConnectionLost, match=r"no reply to forward within 0\.5s"):
            await asyncio.to_thread(client.forward_now, item, timeout=5)
        client.drop("the link to the worker broke")
        with pytest.raises(ConnectionLost):
            await client.stats(timeout=5)


async def test_stats_count_the_forwards_computed_and_are_answered_while_one_computes():
    async with connected("fake:layers=4,delay_ms=300") as (_, client):
        before = await client.stats(timeout=5)
        assert before.forwards == 0 and before.resident_bytes > 0
        item = BatchItem(np.zeros((1, 4), np.float32), "s", 0)
        forward = asyncio.create_task(asyncio.to_thread(client.forward_now, item, timeout=5))
        during = await asyncio.wait_for(client.stats(), 0.25)  # the forward takes 300 ms
        assert not forward.done() and during.forwards == 0
        await asyncio.wait_for(forward, 5)
        assert (await client.stats(timeout=5)).forwards == 1


def link_busy(client: WorkerClient) -> bool:
    """Whether a request holds the client's link now."""
    if client.link.lock.acquire(blocking=False):
        client.link.lock.release()
        return False
    return True


async def test_a_reset_is_sent_only_once_the_forward_before_it_has_its_reply():
    async with connected("fake:layers=4,delay_ms=300") as (_, client):
        item = BatchItem(np.zeros((1, 4), np.float32), "s", 0)
        started = time.monotonic()
        forward = asyncio.create_task(asyncio.to_thread(client.forward_now, item, timeout=5))
        await eventually(lambda: link_busy(client), 5, "the forward to take the link")
        await asyncio.wait_for(client.reset("s", timeout=5), 5)
        assert time.monotonic() - started >= 0.3  # the reset waited out the forward's 300 ms
        y, _ = await asyncio.wait_for(forward, 5)
        np.testing.assert_array_equal(y, reference(item.x, range(4)))
