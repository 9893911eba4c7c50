"""Live HTTP streams against real coordinator processes: shutdown, the stream budget, slow readers, ids."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sqlite3
import time
from collections.abc import AsyncIterator
from contextlib import ExitStack, asynccontextmanager, closing, suppress

import aiohttp
import pytest

from coordinator.api import streams
from coordinator.api.events import HUB
from coordinator.api.server import MAX_STREAMS, SHUTDOWN_GRACE_S
from coordinator.events import NodeChanged
from tests.conftest import eventually, worker_pids
from tests.coordinator.conftest import Api
from tests.support.serving import Serve
from tests.support.serving import serving as launched
from tests.support.tiny_chat import PROMPT, write_tiny_chat, write_tiny_chatml

# A receive buffer as small as the kernel allows: a client that never reads backs up after a few KB.
SMALL_RCVBUF = 4096
# How much later than the grace the process may take to exit: the workers' own stop, on a busy machine.
EXIT_SLACK_S = 4.0
# Tokens a run generates in these tests.
LONG_RUN = 600
# Characters of text in each of the wordy model's markers (most of the tokens it generates).
MARKER_CHARS = 16384


@pytest.fixture(scope="module")
def wordy_chat(tmp_path_factory: pytest.TempPathFactory):
    """The tiny chat llama whose every token but the letters is MARKER_CHARS long."""
    path = tmp_path_factory.mktemp("tiny") / "wordy-chat.gguf"
    write_tiny_chat(path, context_length=1024, marker_chars=MARKER_CHARS)
    return path


@pytest.fixture(scope="module")
def tiny_chatml(tmp_path_factory: pytest.TempPathFactory):
    """A tiny chat llama with a ChatML template (for /v1) that never ends a generation by itself."""
    path = tmp_path_factory.mktemp("tiny") / "tiny-chatml.gguf"
    write_tiny_chatml(path, context_length=1024)
    return path


@asynccontextmanager
async def serving(*args: str) -> AsyncIterator[Serve]:
    """A `rlx-cluster serve ARGS` process, once it serves, for the block."""
    async with launched(*args) as c:
        await c.said("serving on", 60)
        yield c


def stalled_stream(port: int, path: str = "/events") -> socket.socket:
    """A client that asks for `path` and never reads a byte of the answer."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_RCVBUF)
    sock.settimeout(5)
    sock.connect(("127.0.0.1", port))
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    return sock


def status_of(sock: socket.socket) -> int:
    """The status of the response `sock` gets (read with the socket's own timeout)."""
    head = b""
    while b"\r\n" not in head:
        piece = sock.recv(1024)
        assert piece, f"closed without a status line after {head!r}"
        head += piece
    return int(head.split()[1])


async def model_id(c: Serve) -> str:
    status, body, _ = await c.get("/v1/models")
    assert status == 200, body
    return body["data"][0]["id"]


async def test_sigterm_exits_within_the_grace_while_event_streams_never_read(wordy_chat):
    async with serving(
        "--model", str(wordy_chat), "--stages", "1", "--plan", "even", "--db", ":memory:"
    ) as c:
        with ExitStack() as clients:
            for _ in range(5):
                clients.enter_context(closing(stalled_stream(c.port)))
            timeout = aiohttp.ClientTimeout(total=60)
            async with (
                aiohttp.ClientSession(c.cluster.base_url, timeout=timeout) as session,
                session.get("/events?kind=run_finished") as ends,
            ):
                status, posted, _ = await c.post("/runs", {"prompt": PROMPT, "max_new_tokens": LONG_RUN})
                assert status == 202, posted
                end = json.loads((await ends.content.readuntil(b"\n\n")).partition(b"data: ")[2])
            # ~5 MB of token events were pushed at each stalled client: more than its kernel buffers hold.
            assert end["run"] == posted["id"] and end["status"] == "ok", end
            assert end["generated_tokens"] == LONG_RUN, "a stalled stream slowed no run"
            workers = worker_pids(c.proc.pid)
            started = time.monotonic()
            c.proc.send_signal(signal.SIGTERM)
            assert await c.exit_code(SHUTDOWN_GRACE_S + EXIT_SLACK_S) == 128 + signal.SIGTERM
            took = time.monotonic() - started
    assert took < SHUTDOWN_GRACE_S + EXIT_SLACK_S
    assert workers and not any(os.path.exists(f"/proc/{pid}") for pid in workers)


async def finished(c: Serve, run_id: int) -> dict | None:
    status, run, _ = await c.get(f"/runs/{run_id}")
    return run if status == 200 and run["status"] not in ("queued", "running") else None


async def read_chat(response: aiohttp.ClientResponse, started: asyncio.Event) -> list[dict | str]:
    """Every `data:` of a streamed chat, decoded ([DONE] as the string); `started` once content came."""
    got: list[dict | str] = []
    async for raw in response.content:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        got.append(data if data == "[DONE]" else json.loads(data))
        if isinstance(got[-1], dict) and any(c["delta"].get("content") for c in got[-1].get("choices", [])):
            started.set()
    return got


async def test_sigterm_during_streamed_chats_stores_them_interrupted_and_ends_each_stream_with_that(
    tiny_chatml, tmp_path
):
    db = tmp_path / "runs.db"
    async with serving("--model", str(tiny_chatml), "--stages", "1", "--plan", "even", "--db", str(db)) as c:
        body = {
            "model": await model_id(c), "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": LONG_RUN, "stream": True, "temperature": 0,
        }  # fmt: skip
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(c.cluster.base_url, timeout=timeout) as session:
            chats = [await session.post("/v1/chat/completions", json=body) for _ in range(2)]
            assert [r.status for r in chats] == [200, 200]
            started = [asyncio.Event() for _ in chats]
            readers = [asyncio.ensure_future(read_chat(r, s)) for r, s in zip(chats, started, strict=True)]
            await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 30)
            signalled = time.monotonic()
            c.proc.send_signal(signal.SIGTERM)
            got = await asyncio.wait_for(asyncio.gather(*readers), SHUTDOWN_GRACE_S + EXIT_SLACK_S)
            ended = time.monotonic() - signalled
            assert await c.exit_code(SHUTDOWN_GRACE_S + EXIT_SLACK_S) == 128 + signal.SIGTERM
    assert ended < SHUTDOWN_GRACE_S + EXIT_SLACK_S
    for data in got:
        finishes = [
            ch.get("finish_reason") for d in data if isinstance(d, dict) for ch in d.get("choices", [])
        ]
        assert "length" not in finishes, "the chat ran on to its token budget after SIGTERM"
        assert data[-1] == "[DONE]" and "interrupted" in data[-2]["error"]["message"], data[-3:]
    statuses = sqlite3.connect(db).execute("select status from runs").fetchall()
    assert statuses == [("interrupted",), ("interrupted",)]


async def test_event_streams_past_the_budget_are_refused_while_the_api_and_probes_answer():
    async with serving("--model", "fake:layers=2", "--stages", "1", "--db", ":memory:") as c:
        with ExitStack() as clients:
            held = [clients.enter_context(closing(stalled_stream(c.port))) for _ in range(MAX_STREAMS)]
            # Each answered (it reads its status line, and no more) before the next streams come.
            assert await asyncio.to_thread(lambda: [status_of(sock) for sock in held]) == [200] * MAX_STREAMS
            over = [clients.enter_context(closing(stalled_stream(c.port))) for _ in range(4)]
            assert await asyncio.to_thread(lambda: [status_of(sock) for sock in over]) == [503] * 4
            for path in ("/healthz", "/livez", "/runs"):
                status, body, _ = await c.get(path)
                assert status == 200, (path, body)
            status, posted, _ = await c.post("/runs", {"seq": 2})
            assert status == 202, posted
            assert (await eventually(lambda: finished(c, posted["id"]), 20, "the run"))["status"] == "ok"


async def test_a_last_event_id_from_a_previous_coordinator_process_is_410(tmp_path):
    db = str(tmp_path / "runs.db")
    async with serving("--model", "fake:layers=2", "--stages", "1", "--db", db) as first:
        await first.post("/runs", {"seq": 2})
        async with asyncio.timeout(10):
            old = [e async for e in _events(first, since=0, until="run_finished")]
    async with serving("--model", "fake:layers=2", "--stages", "1", "--db", db) as second:
        await second.post("/runs", {"seq": 2})
        async with asyncio.timeout(10):
            new = [e async for e in _events(second, since=0, until="run_finished")]
        stale = str(old[0].id)  # an early event of the first process: its number exists in the second too
        for sent in (stale, stale.rpartition("-")[2]):  # the id as sent, and its bare number
            status, says = await stream_status(second, {"Last-Event-ID": sent})
            assert status == 410 and "does not exist in this coordinator process" in says, (sent, says)
        assert {e.id.rpartition("-")[0] for e in old}.isdisjoint({e.id.rpartition("-")[0] for e in new})
        async with asyncio.timeout(10):
            resumed = [e async for e in _events(second, since=new[0].id, until="run_finished")]
        assert [e.id for e in resumed] == [e.id for e in new[1:]]


async def stream_status(c: Serve, headers: dict[str, str]) -> tuple[int, str]:
    """The status GET /events answers with `headers`, and its error ("" for a stream, left unread)."""
    timeout = aiohttp.ClientTimeout(total=10)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.get(c.cluster.base_url + "/events", headers=headers) as r,
    ):
        return r.status, "" if r.status == 200 else (await r.json())["error"]


async def _events(c: Serve, since: str | int, until: str):
    """The events of `c` after `since`, up to and including the first of kind `until`."""
    events = c.cluster.aio.events(since=since)
    try:
        async for event in events:
            yield event
            if event.kind == until:
                return
    finally:
        await events.aclose()


# In-process: what the fan-out does for each stream, seen from the bus and the sockets.


async def test_many_streams_cost_the_bus_one_subscriber_and_each_event_one_encoding(api, monkeypatch):
    encoded: list[int] = []
    real = streams.frame
    monkeypatch.setattr(
        streams, "frame", lambda event, epoch: encoded.append(event.seq) or real(event, epoch)
    )
    bus = api.cluster.bus
    before = bus.subscribers
    responses = [await api.session.get(api.url("/events")) for _ in range(20)]
    try:
        assert all(r.status == 200 for r in responses)
        assert bus.subscribers == before, "every stream is fed by the one fan-out"
        published = [bus.publish(NodeChanged(stage=0, addr="x", state="up")).seq for _ in range(30)]
        for r in responses:
            got = []
            async with asyncio.timeout(5):
                while len(got) < len(published):
                    line = (await r.content.readline()).decode()
                    if line.startswith("id: "):
                        got.append(int(line.rpartition("-")[2]))
            assert got == published
        assert sorted(encoded) == published, "each event is encoded once, not once per stream"
    finally:
        for r in responses:
            r.close()


async def test_a_stream_whose_client_stops_reading_is_dropped_and_a_reader_beside_it_gets_every_event(
    api: Api, monkeypatch
):
    monkeypatch.setattr(streams, "STALL_S", 0.5)
    bus = api.cluster.bus
    hub_streams = api.server.app[HUB].streams
    reader = await api.session.get(api.url("/events?kind=node"), timeout=aiohttp.ClientTimeout(sock_read=10))
    with closing(stalled_stream(api.server.port, "/events?kind=node")) as sock:
        await eventually(lambda: len(hub_streams) == 2, 5, "both streams open")
        big = "x" * 8192
        seen: list[int] = []

        async def read() -> None:
            while line := await reader.content.readline():
                if line.startswith(b"id: "):
                    seen.append(int(line.rpartition(b"-")[2]))

        reading = asyncio.ensure_future(read())
        published: list[int] = []

        async def dropped() -> bool:
            published.append(bus.publish(NodeChanged(stage=0, addr="x", state="down", error=big)).seq)
            await asyncio.sleep(0.02)
            return len(hub_streams) == 1

        await eventually(dropped, 10, "the stalled stream to be dropped")
        await eventually(lambda: seen[-1:] == published[-1:], 5, "the reader to get every event")
        assert seen == published
        with suppress(TimeoutError, ConnectionError):
            sock.settimeout(5)
            while sock.recv(65536):
                pass  # what the kernel held, then the end
        reading.cancel()
        reader.close()
