"""The served API's limits over raw sockets: slow, idle and too many clients; requests aiohttp refuses."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, closing, suppress

import aiohttp
import pytest
from aiohttp import web

from coordinator.api import MAX_BODY, create_app
from coordinator.api.server import Guard, HttpLimits, Reserved, serve
from coordinator.events import NodeChanged
from tests.conftest import eventually

TOKEN = "s3cret"
AUTH = f"Authorization: Bearer {TOKEN}\r\n".encode()
# The test server's bounds: short, so a test sees them pass without waiting long.
SHORT_S = 0.5
CAP = 6
LONG = HttpLimits(header_s=30, idle_s=30, drain_s=30, connections=CAP)
SHORT = HttpLimits(header_s=SHORT_S, idle_s=SHORT_S, drain_s=SHORT_S, connections=CAP)
# How much later than its bound a cut-off may come on a busy 2-core machine.
SLACK_S = 1.5


@pytest.fixture
async def served(cluster) -> AsyncIterator[Callable]:
    """Serve the API of one fake cluster under given limits and body timeout, as often as a test asks."""
    c = await cluster("fake:layers=2", 1)
    async with AsyncExitStack() as stack:

        async def start(limits: HttpLimits, body_timeout: float = 30.0) -> Guard:
            app = create_app(c, TOKEN, body_timeout=body_timeout)
            return await stack.enter_async_context(serve(app, "127.0.0.1", 0, limits))

        start.cluster = c
        yield start


class Raw:
    """One raw TCP connection to the server."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> Raw:
        return cls(*await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5))

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await asyncio.wait_for(self.writer.drain(), 5)

    async def response(self, timeout: float = 5) -> tuple[int, dict[str, str], bytes]:
        """Read one response: status, headers (lower-case names) and the body its Content-Length gives."""
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), timeout)
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines if line)}
        body = await asyncio.wait_for(self.reader.readexactly(int(headers.get("content-length", 0))), timeout)
        return int(status_line.split()[1]), headers, body

    async def closed_within(self, timeout: float) -> bool:
        """Whether the server closes the connection within `timeout` seconds (skipping what it sends)."""
        try:
            async with asyncio.timeout(timeout):
                while await self.reader.read(65536):
                    pass
        except TimeoutError:
            return False
        except ConnectionError:
            pass
        return True

    def close(self) -> None:
        self.writer.close()


async def trickle(raw: Raw, data: bytes, every_s: float = 0.05) -> None:
    """Send `data` a byte at a time until it is all sent or the server hangs up."""
    with suppress(ConnectionError):
        for i in range(len(data)):
            await raw.send(data[i : i + 1])
            await asyncio.sleep(every_s)


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_a_client_sending_its_head_a_byte_at_a_time_is_cut_off_after_the_header_bound(served):
    guard = await served(SHORT)
    raw = await Raw.open(guard.port)
    started = time.monotonic()
    head = b"GET /runs HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: a\r\n" * 20
    slow = asyncio.create_task(trickle(raw, head, 0.1))
    try:
        assert await raw.closed_within(SHORT_S + SLACK_S), "a slow head was held past its bound"
        assert time.monotonic() - started >= SHORT_S * 0.9
        assert not slow.done(), "the head was closed only after it was all sent"
    finally:
        slow.cancel()
        with suppress(asyncio.CancelledError):
            await slow
        raw.close()
    assert guard.open == {}


async def test_a_kept_alive_connection_idle_past_the_bound_is_closed(served):
    guard = await served(SHORT)
    raw = await Raw.open(guard.port)
    await raw.send(b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n")
    status, headers, _ = await raw.response()
    assert status == 200 and headers.get("connection", "").lower() != "close"
    answered = time.monotonic()
    assert await raw.closed_within(SHORT_S + SLACK_S)
    assert time.monotonic() - answered >= SHORT_S * 0.9
    raw.close()


@pytest.mark.parametrize(
    ("head", "piece"),
    [
        (b"Content-Length: 10000\r\n", b"{"),
        (b"Transfer-Encoding: chunked\r\n", b"1\r\n \r\n"),
    ],
    ids=["content-length", "chunked"],
)
async def test_a_body_that_never_ends_gets_408_and_the_connection_is_closed(served, head, piece):
    guard = await served(SHORT, body_timeout=SHORT_S)
    raw = await Raw.open(guard.port)
    await raw.send(POST + AUTH + head + b"\r\n")
    started = time.monotonic()
    sender = asyncio.create_task(trickle(raw, piece * 1000))
    try:
        status, headers, body = await raw.response(SHORT_S + SLACK_S)
        assert status == 408 and headers["content-type"] == "application/json"
        assert json.loads(body)["error"] == f"the request body did not arrive within {SHORT_S:g} s"
        assert time.monotonic() - started >= SHORT_S * 0.9
        assert await raw.closed_within(SHORT_S + SLACK_S), "the trickling body was drained past its bound"
    finally:
        sender.cancel()
        with suppress(asyncio.CancelledError):
            await sender
        raw.close()


async def test_idle_connections_over_the_cap_evict_the_oldest_a_new_get_answers_and_fds_come_back(served):
    guard = await served(LONG)
    baseline = fds()
    clients = []
    for i in range(3 * CAP):
        clients.append(await Raw.open(guard.port))
        # One accepted at a time, so the order of eviction is the order of opening.
        accepted = min(i + 1, CAP)
        await eventually(lambda n=accepted: len(guard.open) == n, 5, f"connection {i} to be accepted")
    held = fds() - baseline - len(clients)
    assert held <= CAP, f"the server holds {held} sockets with a cap of {CAP}"
    closed = await asyncio.gather(*(c.closed_within(0.5) for c in clients[: 2 * CAP]))
    assert all(closed), "the oldest idle connections are the ones closed"

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        started = time.monotonic()
        async with session.get(f"http://127.0.0.1:{guard.port}/livez") as resp:
            assert resp.status == 200 and await resp.json() == {"ok": True}
        assert time.monotonic() - started < 1.0
    assert len(guard.open) <= CAP

    for c in clients:
        c.close()
    await eventually(lambda: fds() <= baseline and guard.open == {}, 5, f"fds back to {baseline}")


async def test_when_every_connection_is_busy_a_new_one_is_refused_at_once_with_503(served):
    guard = await served(LONG, body_timeout=SHORT_S)
    busy = [await Raw.open(guard.port) for _ in range(CAP)]
    for raw in busy:
        await raw.send(POST + AUTH + b"Content-Length: 10\r\n\r\n")
    await eventually(lambda: sum(c.busy for c in guard.open) == CAP, 5, "every connection to be busy")

    extra = await Raw.open(guard.port)
    status, headers, body = await extra.response(1.0)
    assert status == 503 and int(headers["retry-after"]) >= 1
    assert "too many connections" in json.loads(body)["error"]
    assert await extra.closed_within(1.0)
    extra.close()

    for raw in busy:  # their bodies never come: each gets its 408, and the server takes new clients again
        assert (await raw.response(SHORT_S + SLACK_S))[0] == 408
        raw.close()
    again = await Raw.open(guard.port)
    await again.send(b"GET /livez HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert (await again.response())[0] == 200
    again.close()


def never_reading(port: int) -> socket.socket:
    """A client that opens an event stream and never reads it, with as small a receive buffer as may be."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(5)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"GET /events HTTP/1.1\r\nHost: x\r\n" + AUTH + b"\r\n")
    return sock


async def test_streams_have_their_own_budget_and_a_new_one_there_drops_one_whose_client_stopped_reading(
    served,
):
    guard = await served(HttpLimits(header_s=30, idle_s=30, drain_s=30, connections=CAP, streams=2))
    bus = served.cluster.bus
    with closing(never_reading(guard.port)), closing(never_reading(guard.port)):
        await eventually(lambda: len(guard.streams) == 2, 5, "two streams")
        assert guard.open == {}, "a stream does not count against the connection limit"
        refused = await Raw.open(guard.port)
        await refused.send(b"GET /events HTTP/1.1\r\nHost: x\r\n" + AUTH + b"\r\n")
        status, _, body = await refused.response()
        assert status == 503 and "too many event streams" in json.loads(body)["error"]
        refused.close()
        livez = await Raw.open(guard.port)
        await livez.send(b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await livez.response())[0] == 200, "with the stream budget spent, the API answers"
        livez.close()

        def both_stalled() -> bool:
            bus.publish(NodeChanged(stage=0, addr="x", state="down", error="x" * 16384))
            return all(conn.stalled() for conn in guard.streams)

        await eventually(both_stalled, 10, "both streams to stall")
        newcomer = await Raw.open(guard.port)
        await newcomer.send(b"GET /events HTTP/1.1\r\nHost: x\r\n" + AUTH + b"\r\n")
        assert (await newcomer.response())[0] == 200
        await eventually(lambda: len(guard.streams) == 2, 5, "one stalled stream dropped for the new one")
        assert sum(conn.stalled() for conn in guard.streams) == 1
        newcomer.close()


EXPECT = b"POST /runs HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Type: application/json\r\n"


@pytest.mark.parametrize(
    ("auth", "length", "status"),
    [(AUTH, MAX_BODY + 1, 413), (b"Authorization: Bearer wrong\r\n", 10, 401)],
    ids=["too-big", "wrong-token"],
)
async def test_expect_100_continue_for_a_body_that_would_be_refused_is_refused_at_once(
    served, auth, length, status
):
    guard = await served(LONG)
    raw = await Raw.open(guard.port)
    await raw.send(EXPECT + auth + f"Content-Length: {length}\r\n\r\n".encode())
    got, headers, body = await raw.response(2.0)
    assert got == status and headers["content-type"] == "application/json" and json.loads(body)["error"]
    raw.close()


async def test_expect_100_continue_for_an_acceptable_body_continues_and_runs(served):
    guard = await served(LONG)
    raw = await Raw.open(guard.port)
    body = b'{"seq": 2}'
    await raw.send(EXPECT + AUTH + f"Content-Length: {len(body)}\r\n\r\n".encode())
    assert await asyncio.wait_for(raw.reader.readuntil(b"\r\n\r\n"), 2) == b"HTTP/1.1 100 Continue\r\n\r\n"
    await raw.send(body)
    status, _, answer = await raw.response()
    assert status == 202 and json.loads(answer)["status"] == "queued"
    raw.close()


POST = b"POST /runs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


@pytest.mark.parametrize(
    ("request_bytes", "says"),
    [
        (POST + b"Content-Length: abc\r\n\r\n", "Content-Length"),
        (POST + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}", "Content-Length"),
        (POST + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", "chunk"),
        (b"GET /runs/\xff HTTP/1.1\r\nHost: x\r\n\r\n", "url"),
        (b"GET /runs HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 10_000 + b"\r\n\r\n", "8190"),
        (b"\x16\x03\x01 not http\r\n\r\n", "HTTPS"),
    ],
    ids=["bad-length", "two-lengths", "bad-chunk", "non-utf8-path", "long-header", "tls"],
)
async def test_requests_aiohttp_refuses_itself_come_back_as_json_400(served, request_bytes, says):
    guard = await served(LONG)
    raw = await Raw.open(guard.port)
    await raw.send(request_bytes)
    status, headers, body = await raw.response()
    assert status == 400 and headers["content-type"] == "application/json"
    assert says in json.loads(body)["error"]
    raw.close()
    await eventually(lambda: guard.open == {}, 5, "the refused connection to be closed")


@pytest.mark.parametrize("value", [b"Bearer \xff\xfe", b"\xc3\x28 s3cret", b"Bearer s3cret\x80"])
async def test_an_authorization_header_with_bytes_that_are_not_text_is_401_not_500(served, value):
    guard = await served(LONG)
    raw = await Raw.open(guard.port)
    await raw.send(b"GET /runs HTTP/1.1\r\nHost: x\r\nAuthorization: " + value + b"\r\n\r\n")
    status, headers, body = await raw.response()
    assert status == 401 and headers["www-authenticate"] == "Bearer"
    assert json.loads(body) == {"error": "missing or wrong bearer token"}
    raw.close()


async def test_a_client_that_hangs_up_mid_body_is_not_an_internal_error(served, caplog):
    guard = await served(LONG)
    raw = await Raw.open(guard.port)
    await raw.send(POST + AUTH + b'Content-Length: 100\r\n\r\n{"seq"')
    await eventually(lambda: any(c.busy for c in guard.open), 5, "the request to be handled")
    raw.writer.write_eof()
    assert await raw.closed_within(5)
    raw.close()
    await eventually(lambda: guard.open == {}, 5, "the connection to be closed")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.mark.parametrize(
    "bad",
    [
        {"header_s": 0},
        {"idle_s": float("nan")},
        {"drain_s": float("inf")},
        {"connections": 0},
        {"streams": 0},
    ],
)
def test_limits_that_make_no_sense_are_refused_naming_them(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        HttpLimits(**bad)


async def test_a_reserved_address_refuses_connections_until_served_then_answers_on_that_port():
    reserved = await Reserved.bind("127.0.0.1", 0)
    try:
        port = reserved.listener.sockets[0].getsockname()[1]
        with pytest.raises(ConnectionRefusedError):
            await Raw.open(port)
        with socket.socket() as other, pytest.raises(OSError):  # bound: a plain bind of it fails
            other.bind(("127.0.0.1", port))
        app = web.Application()
        app.router.add_get("/", _served)
        async with serve(app, "127.0.0.1", 0, LONG, reserved=reserved) as guard:
            assert guard.port == port
            async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/") as got:
                assert got.status == 200 and await got.json() == {"served": True}
        with pytest.raises(ConnectionRefusedError):
            await Raw.open(port)
    finally:
        reserved.close()


async def _served(request: web.Request) -> web.Response:
    return web.json_response({"served": True})
