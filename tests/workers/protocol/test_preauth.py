"""Before the handshake a worker reads a Hello's worth of bytes and holds few strangers, a few per peer."""

from __future__ import annotations

import asyncio
import math
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from coordinator.launch.local import Launcher
from coordinator.stages.client import WorkerClient
from tests.conftest import worker_pids
from workers.fake import reference
from workers.protocol import auth
from workers.protocol.gate import HANDSHAKE_TIMEOUT, MAX_PER_PEER, MAX_UNAUTHENTICATED
from workers.protocol.info import BatchItem
from workers.protocol.messages import Challenge, Hello
from workers.protocol.report import LayerRange
from workers.protocol.wire import MAX_HEADER, PREFIX, decode_header, encode_frame, read_frame

CHUNK = 1 << 20
CLOSE_BOUND_S = 2.0  # "at once": far below the handshake timeout
SOCKET_TIMEOUT_S = 5.0


@pytest.fixture
async def worker():
    launcher = Launcher("fake:layers=4")
    w = await launcher.start(0, LayerRange(0, 4))
    yield launcher, w
    await launcher.stop_all()
    assert worker_pids(os.getpid()) == []


def vm_rss(pid: int) -> int:
    """The resident set of process `pid`, in bytes, as the kernel counts it."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        piece = sock.recv(n - len(data))
        if not piece:
            raise AssertionError(f"the worker closed after {len(data)} of {n} bytes")
        data += piece
    return data


def attack(addr: str, header: bytes, header_len: int, payload_len: int, junk: int) -> float:
    """Announce a frame in place of a Hello, send `header` and `junk`; seconds until the worker hung up."""
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=SOCKET_TIMEOUT_S) as sock:
        challenge_len, _ = PREFIX.unpack(recv_exactly(sock, PREFIX.size))
        assert isinstance(decode_header(recv_exactly(sock, challenge_len)), Challenge)
        started = time.monotonic()
        try:
            sock.sendall(PREFIX.pack(header_len, payload_len) + header)
            for _ in range(math.ceil(junk / CHUNK)):
                sock.sendall(bytes(min(CHUNK, junk)))
            while sock.recv(CHUNK):  # the worker owes us nothing more: only its close
                pass
        except (ConnectionResetError, BrokenPipeError):
            pass
        except TimeoutError:
            return math.inf
        return time.monotonic() - started


def hello_header() -> bytes:
    return encode_frame(Hello(mac=bytes(32), nonce=auth.new_nonce()))[1]


async def attack_all(addr: str, n: int, *how) -> list[float]:
    with ThreadPoolExecutor(n) as pool:
        loop = asyncio.get_running_loop()
        runs = [loop.run_in_executor(pool, attack, addr, *how) for _ in range(n)]
        # Each attack is bounded by its socket timeouts; this bound only guards the test itself.
        return await asyncio.wait_for(asyncio.gather(*runs), 4 * SOCKET_TIMEOUT_S)


async def still_serves(launcher: Launcher, addr: str, client: WorkerClient | None = None) -> None:
    own = client is None
    client = client or await WorkerClient.connect(addr, launcher.token, timeout=5)
    try:
        x = np.ones((2, 4), np.float32)
        y, _ = await asyncio.to_thread(client.forward_now, BatchItem(x, "ok", 0), timeout=5)
        np.testing.assert_array_equal(y, reference(x, range(4)))
    finally:
        if own:
            await client.close()


async def test_a_256_mib_payload_before_the_handshake_is_refused_unread(worker):
    launcher, w = worker
    before = vm_rss(w.proc.pid)
    hello = hello_header()  # a valid header, so only the announced payload can be refused
    hung_up = await attack_all(w.report.addr, 4, hello, len(hello), 256 << 20, 64 << 20)
    grown = vm_rss(w.proc.pid) - before
    assert all(s < CLOSE_BOUND_S for s in hung_up), f"seconds until the worker hung up: {hung_up}"
    assert grown < 8 << 20, f"the worker grew by {grown / 2**20:.1f} MiB under the attack"
    await still_serves(launcher, w.report.addr)


async def test_a_64_kib_header_before_the_handshake_is_refused_unread(worker):
    launcher, w = worker
    hung_up = await attack_all(w.report.addr, 1, b"", MAX_HEADER, 0, 1024)
    assert hung_up[0] < CLOSE_BOUND_S, f"the worker waited {hung_up[0]}s for the rest of the header"
    await still_serves(launcher, w.report.addr)


async def open_stranger(addr: str, source: str = "127.0.0.1"):
    """A raw connection from `source` (127.0.0.2, 127.0.0.3, ... are other peers on Linux's loopback)."""
    host, port = addr.rsplit(":", 1)
    return await asyncio.wait_for(asyncio.open_connection(host, int(port), local_addr=(source, 0)), 5)


async def challenged(stranger) -> None:
    challenge, _ = await asyncio.wait_for(read_frame(stranger[0]), 5)
    assert isinstance(challenge, Challenge)


async def test_a_stranger_past_its_peers_bound_pushes_out_the_longest_waiting_and_the_idle_ones_time_out(
    worker,
):
    launcher, w = worker
    addr = w.report.addr
    client = await WorkerClient.connect(addr, launcher.token, timeout=5)
    idle = [await open_stranger(addr) for _ in range(MAX_PER_PEER)]
    try:
        for stranger in idle:
            await challenged(stranger)
        newcomer = await open_stranger(addr)
        idle.append(newcomer)  # closed with the others, whatever happens
        await challenged(newcomer)  # never turned away
        oldest = idle.pop(0)
        assert await asyncio.wait_for(oldest[0].read(), CLOSE_BOUND_S) == b"", "the oldest was not pushed out"
        oldest[1].close()
        late = await WorkerClient.connect(addr, launcher.token, timeout=5)  # past the squatters
        try:
            await still_serves(launcher, addr, late)
        finally:
            await late.close()
        await still_serves(launcher, addr, client)  # the authenticated connection is unaffected

        for reader, _ in idle:  # never answered: the worker drops them at its handshake timeout
            assert await asyncio.wait_for(reader.read(), HANDSHAKE_TIMEOUT + 5) == b""
        await still_serves(launcher, addr)
    finally:
        for _, writer in idle:
            writer.close()
        await client.close()


async def test_one_peer_holds_at_most_its_bound_in_the_handshake_however_many_it_opens(worker):
    launcher, w = worker
    opened = [await open_stranger(w.report.addr, "127.0.0.2") for _ in range(MAX_PER_PEER + 4)]
    try:
        for stranger in opened[4:]:
            await challenged(stranger)
        for reader, _ in opened[:4]:  # the longest-waiting went as the newer came (challenged or not yet)
            await asyncio.wait_for(reader.read(), CLOSE_BOUND_S)  # returns at the worker's close
        await still_serves(launcher, w.report.addr)  # from 127.0.0.1, another peer
    finally:
        for _, writer in opened:
            writer.close()


async def test_squatters_from_many_peers_past_the_bound_on_everyone_never_keep_a_client_with_the_token_out(
    worker,
):
    launcher, w = worker
    peers = [f"127.0.0.{i}" for i in range(2, 2 + MAX_UNAUTHENTICATED // MAX_PER_PEER + 2)]
    squatting = [await open_stranger(w.report.addr, peer) for peer in peers for _ in range(MAX_PER_PEER)]
    try:
        assert len(squatting) > MAX_UNAUTHENTICATED
        started = time.monotonic()
        await still_serves(launcher, w.report.addr)  # from 127.0.0.1, a peer holding nothing
        print(
            f"in past {len(squatting)} squatters from {len(peers)} peers: {time.monotonic() - started:.3f}s"
        )
    finally:
        for _, writer in squatting:
            writer.close()
