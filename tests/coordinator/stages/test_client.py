"""A client of one real `fake:` worker process: the handshake, forwards over the link, stats, timeouts."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
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


async def on_loop(client: WorkerClient, request):
    """`request` (a coroutine of the client's `_on_loop` calls) with the link taken by the loop."""
    assert client.link.take_on_loop()
    try:
        return await request
    finally:
        client.link.give_back_on_loop()


async def forward(way: str, client: WorkerClient, item: BatchItem, timeout: float = 5.0):
    """`item` forwarded over the link `way`: from a thread (forward_now), or awaited on the loop."""
    if way == "thread":
        return await asyncio.to_thread(client.forward_now, item, timeout=timeout)
    return await on_loop(client, client.forward_on_loop(item, timeout=timeout))


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


@pytest.mark.parametrize("way", ["thread", "loop"])
async def test_a_refused_forward_is_a_worker_error_and_the_link_stays_up(way):
    async with connected("fake:layers=4,fail_on=1") as (_, client):
        x = np.ones((1, 4), np.float32)
        with pytest.raises(WorkerError, match="fake failure on forward 1"):
            await forward(way, client, BatchItem(x, "s", 0))
        assert client.lost is None
        y, _ = await forward(way, client, BatchItem(x, "s", 0))
        np.testing.assert_array_equal(y, reference(x, range(4)))


@pytest.mark.parametrize("way", ["thread", "loop"])
async def test_a_forward_with_no_reply_in_time_marks_the_link_lost_and_the_next_fails_at_once(way):
    async with connected("fake:layers=4,hang_on=1") as (_, client):
        item = BatchItem(np.ones((1, 4), np.float32), "s", 0)
        started = time.monotonic()
        with pytest.raises(WorkerError, match=r"no reply within 0\.5s \(connection dropped\)"):
            await forward(way, client, item, timeout=0.5)
        assert time.monotonic() - started < 3
        assert client.link.lost == "no reply to forward within 0.5s" and client.lost == client.link.lost
        assert client.link._sock.fileno() == -1  # closed as the request let it go: no late reply is read
        # Its late output must not be taken for another forward's: the link is not used again.
        with pytest.raises(ConnectionLost, match=r"no reply to forward within 0\.5s"):
            await forward(way, client, item)
        client.drop("the link to the worker broke")
        with pytest.raises(ConnectionLost):
            await client.stats(timeout=5)


async def test_forwards_on_the_loop_answer_as_those_on_a_thread_and_leave_the_socket_blocking():
    async with connected("fake:layers=4,delay_ms=50") as (_, client):
        x = np.arange(12, dtype=np.float32).reshape(3, 4)
        y, compute_ms = await on_loop(client, client.forward_on_loop(BatchItem(x, "s", 0), timeout=5))
        np.testing.assert_array_equal(y, reference(x, range(4)))
        assert compute_ms >= 50
        items = [BatchItem(np.full((n, 4), n, np.float32), f"b{n}", 0) for n in (2, 1, 3)]
        stacked, entries = stack_batch(items)
        y, rows, _ = await on_loop(client, client.forward_batch_on_loop(stacked, entries, timeout=5))
        assert rows == [2, 1, 3]
        for item, got in zip(items, split_rows(y, rows), strict=True):
            np.testing.assert_array_equal(got, reference(item.x, range(4)))
        # A thread's request after them: the socket is still blocking, with its timeouts.
        y, _ = await asyncio.to_thread(client.forward_now, BatchItem(x, "t", 0), timeout=5)
        np.testing.assert_array_equal(y, reference(x, range(4)))
        assert client.lost is None and not client.link.on_loop


async def test_the_loop_cannot_take_a_link_a_thread_holds_or_one_it_holds_already():
    async with connected() as (_, client):
        link = client.link
        assert link.take_on_loop() and not link.take_on_loop()  # its lock is reentrant: `on_loop` says
        link.give_back_on_loop()
        held = asyncio.Event()
        done = threading.Event()
        loop = asyncio.get_running_loop()

        def hold() -> None:
            with link.lock:
                loop.call_soon_threadsafe(held.set)
                done.wait(10)

        holder = asyncio.create_task(asyncio.to_thread(hold))
        await asyncio.wait_for(held.wait(), 10)
        try:
            assert not link.take_on_loop()
        finally:
            done.set()
            await holder
        assert link.take_on_loop()
        link.give_back_on_loop()


async def awaiting_reply(client: WorkerClient) -> asyncio.Task:
    """A forward on the loop, which took the link, once the loop watches for its reply (2 s away)."""
    link = client.link
    assert link.take_on_loop()
    request = asyncio.create_task(client.forward_on_loop(BatchItem(np.ones((1, 4), np.float32), "s", 0), 10))
    watched = asyncio.get_running_loop()._selector.get_map()  # the default loop's: what it waits on
    await eventually(lambda: link._sock.fileno() in watched, what="the loop to wait for the reply")
    return request


async def test_a_link_closed_on_the_loop_while_the_loop_awaits_its_reply_fails_the_request_then_closes():
    # The loop's thread holds the (reentrant) lock: closing must not take it again and close the socket
    # under the request it awaits. The request fails naming why; giving the link back closes it.
    async with connected("fake:layers=4,delay_ms=2000") as (_, client):
        request = await awaiting_reply(client)
        client.link.close("closed by the test")
        assert client.link._sock.fileno() != -1  # still open: the loop watches it
        with pytest.raises(ConnectionLost, match="closed by the test"):
            await asyncio.wait_for(request, 5)
        client.link.give_back_on_loop()
        assert client.link._sock.fileno() == -1 and not client.link.on_loop


async def test_a_request_on_the_loop_cancelled_before_its_reply_loses_the_link_not_left_out_of_step():
    async with connected("fake:layers=4,delay_ms=2000") as (_, client):
        request = await awaiting_reply(client)
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        client.link.give_back_on_loop()
        assert client.link.lost == "forward cancelled before its reply" and client.link._sock.fileno() == -1


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
