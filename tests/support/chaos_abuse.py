"""The chaos soak's HTTP abuse: what a careless or hostile client sends, and what it must get back.

Quick ones (bad bodies, huge lengths, junk bytes, ids that are not ASCII digits) each expect one answer;
slow ones (a head sent a byte a second, silent and idle connections, a body that stops coming) expect the
server to cut them off within its bounds; event streams that read nothing expect the API to answer beside
them. Each returns None when the server did right, else what it did.
"""

from __future__ import annotations

import asyncio
import random
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from contextlib import suppress

from coordinator.api.common import BODY_TIMEOUT_S
from coordinator.api.server import HEADER_TIMEOUT_S, IDLE_TIMEOUT_S
from tests.support.chaos import Log

HOST = "127.0.0.1"
# Seconds past a connection bound of the server's within which it must have closed the connection.
SLACK_S = 5


def get(path: bytes, headers: bytes = b"") -> bytes:
    return b"GET " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n" + headers + b"Connection: close\r\n\r\n"


def post(path: bytes, body: bytes, headers: bytes = b"") -> bytes:
    head = b"POST " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
    return head + headers + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body


JSON_TYPE = b"Content-Type: application/json\r\n"
HUGE_LENGTH = b"POST /runs HTTP/1.1\r\nHost: 127.0.0.1\r\n" + JSON_TYPE + b"Content-Length: 999999999999\r\n"
# What a client may send, and what it must get: never a 5xx, always the answer that names its mistake.
ABUSE: list[tuple[str, bytes, set[int]]] = [
    ("bad json", post(b"/runs", b'{"seq": '), {400}),
    ("wrong type", post(b"/runs", b'{"seq": "many"}'), {400}),
    ("seq over the limit", post(b"/runs", b'{"seq": 100000000}'), {400}),
    ("unknown field", post(b"/runs", b'{"sequence": 4}'), {400}),
    ("not an object", post(b"/runs", b"[1, 2, 3]"), {400}),
    ("body not utf-8", post(b"/runs", b'{"seq": "\xff\xfe"}'), {400}),
    ("huge content-length", HUGE_LENGTH + b"\r\n", {413}),
    ("huge content-length, expect 100-continue", HUGE_LENGTH + b"Expect: 100-continue\r\n\r\n", {413}),
    ("tls hello", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 junk\r\n\r\n", {400}),
    ("superscript id", get(b"/runs/%C2%B2"), {404}),
    ("arabic-indic id", get(b"/runs/%D9%A1"), {404}),
    ("raw utf-8 id", get("/runs/١".encode()), {400}),
    ("5000-digit id", get(b"/runs/" + b"9" * 5000), {404}),
    ("superscript node", post(b"/nodes/%C2%B2/restart", b""), {404}),
    ("5000-digit node", post(b"/nodes/" + b"9" * 5000 + b"/restart", b""), {404}),
    ("node out of range", post(b"/nodes/1000/restart", b""), {404}),
    ("bad limit", get(b"/runs?limit=abc"), {400}),
    ("zero limit", get(b"/runs?limit=0"), {400}),
    ("negative before", get(b"/runs?before=-1"), {400}),
    ("unknown reduce kind", get(b"/run/latest/reduce?kind=median"), {400, 404}),
    ("authorization bytes", get(b"/nodes", b"Authorization: Bearer \xff\xfe\r\n"), {200}),
    ("long header", get(b"/nodes", b"X-Long: " + b"a" * 10_000 + b"\r\n"), {400}),
    ("unknown path", get(b"/nope"), {404}),
    ("wrong method", b"DELETE /runs HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n", {405}),
    ("a rebound name", get(b"/runs").replace(b"Host: 127.0.0.1", b"Host: rebind.evil.example"), {403}),
    ("a post from another origin", post(b"/runs", b'{"seq": 2}', b"Origin: http://127.0.0.1:1\r\n"), {403}),
    ("a text/plain body", post(b"/runs", b'{"seq": 2}').replace(b"application/json", b"text/plain"), {415}),
]


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.wait_for(asyncio.open_connection(HOST, port), 5)


async def hang_up(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with suppress(OSError, TimeoutError):
        await asyncio.wait_for(writer.wait_closed(), 5)


async def answer(reader: asyncio.StreamReader, timeout: float) -> int | None:
    """The status of the next response, None when the connection closes without one."""
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    return int(head.split(maxsplit=2)[1])


async def closed_within(reader: asyncio.StreamReader, timeout: float) -> bool:
    """Whether the server closes the connection within `timeout` seconds (skipping what it sends)."""
    try:
        async with asyncio.timeout(timeout):
            while await reader.read(65536):
                pass
    except TimeoutError:
        return False
    except ConnectionError:
        pass
    return True


async def quick(port: int, data: bytes, expected: set[int], statuses: Counter) -> str | None:
    """Send `data` on a new connection and count the answer's status: None when expected, else what came."""
    reader, writer = await connect(port)
    try:
        with suppress(ConnectionError):
            writer.write(data)
            await asyncio.wait_for(writer.drain(), 5)
        status = await answer(reader, 10)
    finally:
        await hang_up(writer)
    statuses[status] += 1
    return None if status in expected else f"answered {status}, expected one of {sorted(expected)}"


async def slow_head(port: int) -> str | None:
    """A request head sent a byte a second must be cut off within the header bound."""
    reader, writer = await connect(port)
    head = b"GET /nodes HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Slow: a\r\n" * 100

    async def trickle() -> None:
        with suppress(ConnectionError):
            for i in range(len(head)):
                writer.write(head[i : i + 1])
                await asyncio.wait_for(writer.drain(), 5)
                await asyncio.sleep(1)

    sending = asyncio.create_task(trickle())
    try:
        cut = await closed_within(reader, HEADER_TIMEOUT_S + SLACK_S)
    finally:
        sending.cancel()
        with suppress(asyncio.CancelledError):
            await sending
        await hang_up(writer)
    return None if cut else f"a head sent a byte a second was held past {HEADER_TIMEOUT_S + SLACK_S:g} s"


async def idle_connections(port: int, n: int = 8) -> str | None:
    """Connections that send nothing must be closed within the header bound."""
    opened = [await connect(port) for _ in range(n)]
    try:
        cut = await asyncio.gather(*(closed_within(r, HEADER_TIMEOUT_S + SLACK_S) for r, _ in opened))
    finally:
        for _, writer in opened:
            await hang_up(writer)
    return None if all(cut) else f"{cut.count(False)} of {n} silent connections were held open"


async def idle_kept_alive(port: int) -> str | None:
    """A kept-alive connection idle after its answer must be closed within the idle bound."""
    reader, writer = await connect(port)
    try:
        writer.write(b"GET /livez HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        status = await answer(reader, 10)
        cut = await closed_within(reader, IDLE_TIMEOUT_S + SLACK_S)
    finally:
        await hang_up(writer)
    return None if status == 200 and cut else f"answered {status}, closed when idle: {cut}"


async def unfinished_body(port: int) -> str | None:
    """A body that stops coming must get 408 within the body bound."""
    reader, writer = await connect(port)
    try:
        writer.write(
            b"POST /runs HTTP/1.1\r\nHost: 127.0.0.1\r\n" + JSON_TYPE + b'Content-Length: 100\r\n\r\n{"seq"'
        )
        status = await answer(reader, BODY_TIMEOUT_S + SLACK_S)
    finally:
        await hang_up(writer)
    return None if status == 408 else f"answered {status}, not 408"


async def stalled_streams(port: int, n: int = 4, hold_s: float = 15.0) -> str | None:
    """Event streams whose clients never read must not keep the API from answering meanwhile."""
    loop = asyncio.get_running_loop()
    socks = []
    try:
        for _ in range(n):
            sock = socket.socket()
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            await asyncio.wait_for(loop.sock_connect(sock, (HOST, port)), 5)
            await asyncio.wait_for(loop.sock_sendall(sock, b"GET /events HTTP/1.1\r\nHost: x\r\n\r\n"), 5)
        deadline = time.monotonic() + hold_s
        while time.monotonic() < deadline:
            reader, writer = await connect(port)
            try:
                writer.write(get(b"/livez"))
                status = await answer(reader, 5)
            finally:
                await hang_up(writer)
            if status != 200:
                return f"/livez answered {status} beside {n} event streams that read nothing"
            await asyncio.sleep(1)
    finally:
        for sock in socks:
            sock.close()
    return None


SLOW_ABUSE: list[Callable[[int], Awaitable[str | None]]] = [slow_head, idle_connections, idle_kept_alive,
                                                            unfinished_body, stalled_streams]  # fmt: skip


async def abuse(
    port: int, log: Log, rng: random.Random, nap: Callable[[float, float], Awaitable[bool]]
) -> None:
    """Abuse the server on `port` while `nap` says the chaos goes on: quick moves often, 3 slow at most."""
    slow: set[asyncio.Task] = set()

    async def one(name: str, move: Awaitable[str | None]) -> None:
        log.counts["abuse requests"] += 1
        log.counts[f"abuse: {name}"] += 1
        try:
            wrong = await move
        except (OSError, TimeoutError) as exc:
            wrong = f"{type(exc).__name__}: {exc}"
        if wrong is not None:
            log.violations.append(f"abuse {name!r} {log.at(time.monotonic())}: {wrong}")

    while await nap(0.1, 0.6):
        if len(slow) < 3 and rng.random() < 0.1:
            move = rng.choice(SLOW_ABUSE)
            task = asyncio.create_task(one(move.__name__.replace("_", " "), move(port)))
            slow.add(task)
            task.add_done_callback(slow.discard)
        else:
            name, data, expected = rng.choice(ABUSE)
            await one(name, quick(port, data, expected, log.statuses))
    await asyncio.gather(*slow)
