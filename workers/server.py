"""The worker's TCP server: handshake, then dispatch each message to the Stage.

Compute runs on one daemon thread, one forward at a time, so the event loop
keeps answering (stats, other connections) while a stage computes, and a
stage that hangs never blocks the process from exiting. A stranger gets
little: before the handshake only a Hello-sized frame is read, and only
MAX_UNAUTHENTICATED connections may be waiting in the handshake at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import Any, TypeVar, get_args

import numpy as np

from workers import auth
from workers.report import NodeReport, resident_bytes
from workers.stage import Stage, StageError
from workers.wire import (
    DEFAULT_MAX_PAYLOAD,
    PREFIX,
    Challenge,
    Done,
    Error,
    Forward,
    GetStats,
    Hello,
    Mac,
    Nonce,
    ProtocolError,
    Reset,
    Result,
    Stats,
    Welcome,
    decode_header,
    encode_frame,
    pack_tensor,
    read_frame,
    send,
    unpack_tensor,
)

log = logging.getLogger("workers.server")

HANDSHAKE_TIMEOUT = 10.0
# Connections still in the handshake at once; past this a newcomer is told so
# and closed, so strangers cannot hold more than this many sockets and buffers.
MAX_UNAUTHENTICATED = 16
T = TypeVar("T")


def _largest_hello_header() -> int:
    """The encoded size of the largest Hello the wire types allow."""
    mac, nonce = (get_args(kind)[1].max_length for kind in (Mac, Nonce))
    return len(encode_frame(Hello(mac=bytes(mac), nonce=bytes(nonce)))[1])


# Before the handshake only a Hello may arrive: no payload and a header of its
# size. Twice the size leaves room for another msgpack encoder's choices.
PREAUTH_MAX_HEADER = 2 * _largest_hello_header()


Job = tuple[Callable[[], Any], asyncio.Future, asyncio.AbstractEventLoop]


class ComputeThread:
    """One daemon thread that runs blocking calls in order and resolves futures."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="compute", daemon=True).start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            _call(*job)
            # While waiting for the next job, hold nothing of this one: a dropped stage must be freed.
            del job

    def close(self) -> None:
        """End the thread once the jobs already queued are done."""
        self._jobs.put(None)

    def submit(self, fn: Callable[[], Any]) -> asyncio.Future:
        """Queue `fn`; the returned future resolves on the calling loop."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._jobs.put((fn, fut, loop))
        return fut


def _call(fn: Callable[[], Any], fut: asyncio.Future, loop: asyncio.AbstractEventLoop) -> None:
    try:
        result = fn()
    except BaseException as exc:  # handed to the awaiting task, which reports it
        loop.call_soon_threadsafe(_settle, fut, None, exc)
    else:
        loop.call_soon_threadsafe(_settle, fut, result, None)


def _settle(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.cancelled():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


class HandshakeGate:
    """Bounds what strangers get: MAX_UNAUTHENTICATED in the handshake at once, HANDSHAKE_TIMEOUT each."""

    def __init__(self) -> None:
        self.waiting = 0

    async def admit(self, writer: asyncio.StreamWriter, handshake: Callable[[], Awaitable[T]]) -> T:
        """Run `handshake()` within the bounds; a newcomer past the cap is told so and refused."""
        if self.waiting >= MAX_UNAUTHENTICATED:
            busy = f"busy: {MAX_UNAUTHENTICATED} connections are already in the handshake; try again"
            await send(writer, Error(id=0, message=busy))
            raise ProtocolError(busy)
        self.waiting += 1
        try:
            return await asyncio.wait_for(handshake(), HANDSHAKE_TIMEOUT)
        finally:
            self.waiting -= 1


class WorkerServer:
    """Serves one built Stage to any client that passes the handshake."""

    def __init__(self, stage: Stage, token: str, max_payload: int = DEFAULT_MAX_PAYLOAD) -> None:
        self.stage = stage
        self.token = token
        self.max_payload = max_payload
        self.report: NodeReport | None = None
        self.forwards = 0
        self.gate = HandshakeGate()
        self.compute = ComputeThread()

    def close(self) -> None:
        """Stop computing once the forward under way is done, so that the stage can be freed."""
        self.compute.close()

    def describe(self, addr: str, build_ms: int, model: str) -> NodeReport:
        """Measure the report clients are greeted with: the stage served at `addr`, built in `build_ms`."""
        self.report = NodeReport(
            addr=addr,
            layers=self.stage.layers,
            device="cpu",
            precision=self.stage.precision,
            build_ms=build_ms,
            resident_bytes=resident_bytes(),
            n_params=self.stage.n_params,
            n_packed=self.stage.n_packed,
            pid=os.getpid(),
            model=model,
        )
        return self.report

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve one connection until it closes or breaks the protocol."""
        peer = writer.get_extra_info("peername")
        write_lock = asyncio.Lock()
        pending: set[asyncio.Task] = set()
        try:
            await self.gate.admit(writer, lambda: self._handshake(reader, writer))
            log.info("client %s connected", peer)
            while (frame := await read_frame(reader, self.max_payload)) is not None:
                request = asyncio.create_task(self._dispatch(*frame, writer, write_lock))
                pending.add(request)
                request.add_done_callback(pending.discard)
            log.info("client %s closed the connection", peer)
        except ProtocolError as exc:
            log.warning("dropping %s: %s", peer, exc)
        except TimeoutError:
            log.warning("dropping %s: no handshake within %.0fs", peer, HANDSHAKE_TIMEOUT)
        except (ConnectionError, OSError) as exc:
            log.info("client %s gone: %s", peer, exc)
        finally:
            for request in pending:
                request.cancel()
            writer.close()
            with suppress(Exception):
                await writer.wait_closed()

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonce = auth.new_nonce()
        await send(writer, Challenge(nonce=nonce))
        hello = await read_hello(reader)
        if not auth.verify(self.token, "client", nonce, hello.mac):
            await send(writer, Error(id=0, message="handshake failed: wrong token"))
            raise ProtocolError("handshake failed: wrong token")
        assert self.report is not None
        await send(writer, Welcome(mac=auth.mac(self.token, "worker", hello.nonce), report=self.report))

    async def _dispatch(
        self, msg: object, payload: bytes, writer: asyncio.StreamWriter, lock: asyncio.Lock
    ) -> None:
        match msg:
            case Forward():
                reply, out = await self._forward(msg, payload)
            case Reset(id=rid, session=session):
                await self.compute.submit(lambda: self.stage.reset(session))
                reply, out = Done(id=rid), b""
            case GetStats(id=rid):
                reply = Stats(
                    id=rid,
                    resident_bytes=resident_bytes(),
                    sessions=self.stage.n_sessions(),
                    forwards=self.forwards,
                )
                out = b""
            case _:
                rid = getattr(msg, "id", 0)
                reply, out = Error(id=rid, message=f"a worker does not accept {type(msg).__name__}"), b""
        async with lock:
            writer.writelines(encode_frame(reply, out))
            await writer.drain()

    async def _forward(self, msg: Forward, payload: bytes) -> tuple[object, bytes | memoryview]:
        x = unpack_tensor(msg.tensor, payload)
        positions = x.shape[0] if x.ndim else 0
        if msg.start_pos + positions > self.stage.info.context_length:
            return Error(
                id=msg.id,
                message=f"positions {msg.start_pos}..{msg.start_pos + positions} exceed the context "
                f"length {self.stage.info.context_length}",
            ), b""

        def run() -> tuple[np.ndarray, float]:
            start = time.perf_counter()
            y = self.stage.forward(x, session=msg.session, start_pos=msg.start_pos, last_only=msg.last_only)
            return y, (time.perf_counter() - start) * 1000

        try:
            y, compute_ms = await self.compute.submit(run)
            tensor, out = pack_tensor(y)
        except (StageError, ProtocolError) as exc:
            return Error(id=msg.id, message=str(exc)), b""
        except Exception as exc:  # a bug in a stage must not take the worker down
            log.exception("forward %d failed", msg.id)
            return Error(id=msg.id, message=f"{type(exc).__name__}: {exc}"), b""
        self.forwards += 1
        return Result(id=msg.id, compute_ms=compute_ms, tensor=tensor), out


async def read_hello(reader: asyncio.StreamReader) -> Hello:
    """Read the client's Hello, refusing a frame too big to be one before reading any of it."""
    try:
        header_len, payload_len = PREFIX.unpack(await reader.readexactly(PREFIX.size))
        if payload_len or not 0 < header_len <= PREAUTH_MAX_HEADER:
            raise ProtocolError(
                f"a frame of {header_len} header and {payload_len} payload bytes before the handshake; "
                f"only a hello is accepted (header up to {PREAUTH_MAX_HEADER} bytes, no payload)"
            )
        hello = decode_header(await reader.readexactly(header_len))
    except asyncio.IncompleteReadError as exc:
        raise ProtocolError("closed before the handshake") from exc
    if not isinstance(hello, Hello):
        raise ProtocolError(f"expected hello, got {type(hello).__name__} before the handshake")
    return hello
