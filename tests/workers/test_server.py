"""A live worker over raw sockets: hostile bytes close that connection only."""

from __future__ import annotations

import asyncio
import os
import struct

import numpy as np
import pytest

from coordinator.launch.local import Launcher
from coordinator.stages.batch import split_rows, stack_batch
from coordinator.stages.client import WorkerClient, WorkerError, WrongWorker
from tests.conftest import worker_pids
from workers.fake import reference
from workers.models import build
from workers.protocol import auth
from workers.protocol.info import BatchItem
from workers.protocol.messages import (
    BatchEntry,
    Challenge,
    Error,
    Forward,
    ForwardBatch,
    GetStats,
    Hello,
    Tensor,
    Welcome,
)
from workers.protocol.report import LayerRange
from workers.protocol.wire import ProtocolError, encode_frame, read_frame, send
from workers.server import WorkerServer


@pytest.fixture
async def worker():
    launcher = Launcher("fake:layers=4,delay_ms=300")
    w = await launcher.start(0, LayerRange(0, 4))
    yield launcher, w
    await launcher.stop_all()
    assert worker_pids(os.getpid()) == []


async def open_raw(addr: str):
    host, port = addr.rsplit(":", 1)
    return await asyncio.wait_for(asyncio.open_connection(host, int(port)), 5)


async def closed_by_peer(reader: asyncio.StreamReader) -> bool:
    """Read until EOF (discarding frames); True when the worker closed the connection."""
    data = await asyncio.wait_for(reader.read(), 5)
    return isinstance(data, bytes)


async def handshake(reader, writer, token: str) -> Welcome:
    challenge, _ = await asyncio.wait_for(read_frame(reader), 5)
    assert isinstance(challenge, Challenge)
    nonce = auth.new_nonce()
    await send(writer, Hello(mac=auth.mac(token, "client", challenge.nonce), nonce=nonce))
    welcome, _ = await asyncio.wait_for(read_frame(reader), 5)
    assert isinstance(welcome, Welcome) and auth.verify(token, "worker", nonce, welcome.mac)
    return welcome


async def still_serves(launcher, w, layers: int = 4) -> None:
    client = await WorkerClient.connect(w.report.addr, launcher.token)
    try:
        x = np.ones((2, 4), np.float32)
        y, _ = await asyncio.to_thread(client.forward_now, BatchItem(x, "ok", 0), timeout=5)
        np.testing.assert_array_equal(y, reference(x, range(layers)))
    finally:
        await client.close()


async def test_junk_bytes_close_the_connection_and_the_worker_keeps_serving(worker):
    launcher, w = worker
    reader, writer = await open_raw(w.report.addr)
    writer.write(os.urandom(64) + b"GET / HTTP/1.1\r\n\r\n")
    assert await closed_by_peer(reader)
    writer.close()
    await still_serves(launcher, w)


async def test_huge_length_prefix_is_refused_at_once(worker):
    launcher, w = worker
    reader, writer = await open_raw(w.report.addr)
    await asyncio.wait_for(read_frame(reader), 5)  # the challenge
    writer.write(struct.pack("!II", 100, 2**32 - 1))  # announces 4 GiB, sends nothing more
    assert await closed_by_peer(reader)
    writer.close()
    await still_serves(launcher, w)


async def test_wrong_token_fails_the_handshake(worker):
    launcher, w = worker
    reader, writer = await open_raw(w.report.addr)
    challenge, _ = await asyncio.wait_for(read_frame(reader), 5)
    await send(
        writer, Hello(mac=auth.mac("not the token", "client", challenge.nonce), nonce=auth.new_nonce())
    )
    reply, _ = await asyncio.wait_for(read_frame(reader), 5)
    assert isinstance(reply, Error) and "handshake failed" in reply.message
    assert await closed_by_peer(reader)
    writer.close()
    with pytest.raises(WorkerError, match="wrong token"):
        await WorkerClient.connect(w.report.addr, "another wrong token")
    await still_serves(launcher, w)


async def test_a_request_before_the_handshake_closes_the_connection(worker):
    launcher, w = worker
    reader, writer = await open_raw(w.report.addr)
    await asyncio.wait_for(read_frame(reader), 5)
    tensor = Tensor(dtype="float32", shape=[1, 4])
    writer.writelines(encode_frame(Forward(id=1, session="s", start_pos=0, tensor=tensor), bytes(16)))
    assert await closed_by_peer(reader)
    writer.close()
    await still_serves(launcher, w)


async def test_payload_that_does_not_match_its_shape_closes_the_connection(worker):
    launcher, w = worker
    reader, writer = await open_raw(w.report.addr)
    await handshake(reader, writer, launcher.token)
    tensor = Tensor(dtype="float32", shape=[1000, 4])
    writer.writelines(encode_frame(Forward(id=1, session="s", start_pos=0, tensor=tensor), bytes(16)))
    assert await closed_by_peer(reader)
    writer.close()
    await still_serves(launcher, w)


async def test_a_clients_stats_are_answered_while_its_forward_runs(worker):
    launcher, w = worker
    client = await WorkerClient.connect(w.report.addr, launcher.token)
    try:
        item = BatchItem(np.zeros((1, 4), np.float32), "s", 0)
        forward = asyncio.create_task(asyncio.to_thread(client.forward_now, item, timeout=5))
        stats = await asyncio.wait_for(client.stats(), 0.25)  # the forward takes 300 ms
        assert not forward.done() and stats.resident_bytes > 0
        y, compute_ms = await forward
        assert compute_ms >= 300 and y.shape == (1, 4)
        assert (await client.stats()).forwards == 1
    finally:
        await client.close()


@pytest.mark.parametrize(
    ("entries", "shape"),
    [
        ([BatchEntry("a", 0, 1), BatchEntry("b", 0, 1)], [3, 4]),
        ([BatchEntry("a", 0, 1), BatchEntry("a", 1, 1)], [2, 4]),
        ([BatchEntry("a", 0, 2)], []),
    ],
    ids=["rows-do-not-tile", "session-twice", "scalar"],
)
async def test_a_malformed_batch_frame_closes_the_connection_and_the_worker_keeps_serving(
    worker, entries, shape
):
    launcher, w = worker
    reader, writer = await open_raw(w.report.addr)
    await handshake(reader, writer, launcher.token)
    n_bytes = 4 * (shape[0] * shape[1] if shape else 1)
    batch = ForwardBatch(id=1, entries=entries, tensor=Tensor(dtype="float32", shape=shape))
    writer.writelines(encode_frame(batch, bytes(n_bytes)))
    assert await closed_by_peer(reader)
    writer.close()
    await still_serves(launcher, w)


async def test_a_batch_on_a_live_worker_answers_each_session_in_order(worker):
    launcher, w = worker
    client = await WorkerClient.connect(w.report.addr, launcher.token)
    try:
        items = [BatchItem(np.full((n, 4), n, np.float32), f"s{n}", 0, False) for n in (2, 1, 3)]
        x, entries = stack_batch(items)
        y, rows, compute_ms = await asyncio.to_thread(client.forward_batch_now, x, entries, timeout=5)
        outputs = split_rows(y, rows)
        assert compute_ms >= 3 * 300  # the fake stage sleeps once per item
        for item, got in zip(items, outputs, strict=True):
            np.testing.assert_array_equal(got, reference(item.x, range(4)))
        assert (await client.stats()).forwards == 1
    finally:
        await client.close()


async def test_wrong_input_shape_is_an_error_reply_not_a_crash(worker):
    launcher, w = worker
    client = await WorkerClient.connect(w.report.addr, launcher.token)
    try:
        with pytest.raises(WorkerError, match=r"expects float32 \(T, 4\)"):
            await asyncio.to_thread(
                client.forward_now, BatchItem(np.zeros((2, 3), np.float32), "s", 0), timeout=5
            )
        with pytest.raises(WorkerError, match="exceed the context length"):
            far = BatchItem(np.zeros((2, 4), np.float32), "s", 2**31 - 2)
            await asyncio.to_thread(client.forward_now, far, timeout=5)
    finally:
        await client.close()
    await still_serves(launcher, w)


async def test_worker_refuses_a_public_address_without_a_token():
    env = {k: v for k, v in os.environ.items() if k != auth.WORKER_TOKEN_ENV}
    proc = await asyncio.create_subprocess_exec(
        *Launcher("fake").command(LayerRange(0, 8))[:-2], "--host", "0.0.0.0",
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode != 0 and out == b""
    assert b"refusing to listen on 0.0.0.0 without a token" in err


def mutate(frame: bytes, rng) -> bytes:
    """Flip, insert or delete a few bytes of a valid frame."""
    data = bytearray(frame)
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(len(data))
        match rng.randrange(3):
            case 0:
                data[i] ^= 1 << rng.randrange(8)
            case 1:
                data.insert(i, rng.randrange(256))
            case 2:
                del data[i]
    return bytes(data)


async def test_mutated_frames_after_the_handshake_never_take_the_worker_down(worker):
    import random

    launcher, w = worker
    rng = random.Random(1234)
    x = np.ones((2, 4), np.float32)
    valid = [
        b"".join(
            encode_frame(
                Forward(id=7, session="fuzz", start_pos=0, tensor=Tensor("float32", [2, 4])), x.tobytes()
            )
        ),
        b"".join(encode_frame(GetStats(id=8))),
    ]
    outcomes = {"closed": 0, "answered": 0}
    for _ in range(60):
        reader, writer = await open_raw(w.report.addr)
        await handshake(reader, writer, launcher.token)
        writer.write(mutate(rng.choice(valid), rng))
        writer.write_eof()  # so a frame announcing more bytes than sent ends at once
        try:
            reply = await asyncio.wait_for(read_frame(reader), 5)
        except (ProtocolError, ConnectionError):
            reply = None
        outcomes["answered" if reply is not None else "closed"] += 1
        writer.close()
    assert sum(outcomes.values()) == 60 and outcomes["closed"] > 0
    await still_serves(launcher, w)
    client = await WorkerClient.connect(w.report.addr, launcher.token)
    try:
        assert (await client.stats()).resident_bytes > 0
    finally:
        await client.close()


async def test_a_worker_on_ipv6_reports_its_address_in_brackets_and_serves_there():
    launcher = Launcher("fake:layers=2", host="::1")
    try:
        w = await launcher.start(0, LayerRange(0, 2))
        assert w.report is not None
        assert w.report.addr.startswith("[::1]:"), w.report.addr
        await still_serves(launcher, w, layers=2)
    finally:
        await launcher.stop_all()
    assert worker_pids(os.getpid()) == []


async def serve_in_process(ticket: bytes) -> tuple[WorkerServer, asyncio.Server, str]:
    """A WorkerServer for a fake stage on a loopback port of this process, as a joiner runs one."""
    stage = build("fake:layers=4", LayerRange(0, 4), "f32")
    worker = WorkerServer(stage, "ticket-test-token", ticket=ticket)
    server = await asyncio.start_server(worker.handle, "127.0.0.1", 0)
    addr = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    worker.describe(addr, 0, "fake:layers=4")
    return worker, server, addr


async def test_a_worker_that_joined_proves_its_ticket_and_a_client_expecting_another_is_refused():
    ticket = auth.new_nonce()
    worker, server, addr = await serve_in_process(ticket)
    plain, plain_server, plain_addr = await serve_in_process(b"")
    try:
        client = await WorkerClient.connect(addr, "ticket-test-token", timeout=5, ticket=ticket)
        await client.close()
        with pytest.raises(WrongWorker, match="cannot prove its join ticket") as raised:
            await WorkerClient.connect(addr, "ticket-test-token", timeout=5, ticket=auth.new_nonce())
        assert raised.value.report.layers == LayerRange(0, 4) and raised.value.report.addr == addr
        with pytest.raises(WrongWorker):  # a worker that did not join proves no ticket at all
            await WorkerClient.connect(plain_addr, "ticket-test-token", timeout=5, ticket=ticket)
        attached = await WorkerClient.connect(plain_addr, "ticket-test-token", timeout=5)  # none expected
        await attached.close()
    finally:
        for each, listening in ((worker, server), (plain, plain_server)):
            listening.close()
            each.close()
