"""Two TCP connections to one worker: requests on the event loop, forwards on a blocking socket.

Stats go over an asyncio connection, requests matched by id: one that times
out is only abandoned (its late reply is dropped when it comes). Forwards and
resets, which touch a session's state, go in order over a second connection
used as a blocking socket from one thread at a time (`ForwardLink`): no event
loop between the bytes and the caller, so a hop costs what the socket costs.
A forward or reset with no reply in time drops the link and with it the
worker: it may still be computing, and its late output must not be taken for
another's.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import socket
import threading
from collections.abc import Callable
from contextlib import suppress
from typing import TypeVar

import numpy as np

from workers.protocol import auth
from workers.protocol.address import parse_host_port
from workers.protocol.info import BatchItem
from workers.protocol.messages import (
    BatchEntry,
    BatchResult,
    Challenge,
    Done,
    Error,
    Forward,
    ForwardBatch,
    GetStats,
    Hello,
    Message,
    Reset,
    Result,
    Stats,
    Welcome,
)
from workers.protocol.report import NodeReport
from workers.protocol.wire import (
    DEFAULT_MAX_PAYLOAD,
    FrameSocket,
    ProtocolError,
    encode_frame,
    pack_tensor,
    read_frame,
    send,
    unpack_tensor,
)

log = logging.getLogger("coordinator.stages.client")

CONNECT_TIMEOUT = 10.0
REQUEST_TIMEOUT = 30.0
# Timed-out requests left waiting for a late reply on one connection; one more
# drops the connection, as a worker that leaves this many unanswered is not serving.
MAX_ABANDONED = 64

M = TypeVar("M", bound=Message)
T = TypeVar("T")


class WorkerError(Exception):
    """A request that failed: the worker said so, hung, or the connection is gone."""


class ConnectionLost(WorkerError):
    """The connection to the worker broke; every pending request fails with this."""


class WrongWorker(WorkerError):
    """The worker at the address cannot prove the ticket a join gave: it is another worker.

    report: what the worker there says it serves.
    """

    def __init__(self, message: str, report: NodeReport) -> None:
        super().__init__(message)
        self.report = report


class RequestTimeout(WorkerError):
    """A request other than a forward got no reply in time; the connection is kept."""


class ForwardLink:
    """A blocking connection to one worker for the requests that touch session state, one at a time.

    `lock` is held for a whole request; a caller that must order its requests
    against others' (a forward chain, a reset after it) may hold it across several.
    """

    def __init__(self, addr: str, sock: socket.socket) -> None:
        self.addr = addr
        self.lock = threading.RLock()
        self.lost: str | None = None
        self._sock = sock
        self._frames = FrameSocket(sock)
        self._ids = itertools.count(1)

    def request(
        self, msg: Callable[[int], Message], payload: bytes | memoryview, timeout: float
    ) -> tuple[Message, bytes]:
        """Send one request and read its reply; no reply within `timeout` drops the link."""
        if not self.lock.acquire(timeout=timeout):
            raise RequestTimeout(f"worker {self.addr}: its connection stayed busy for {timeout:g}s")
        try:
            if self.lost is not None:
                raise ConnectionLost(f"worker {self.addr}: {self.lost}")
            reply, data = self._exchange(msg(next(self._ids)), payload, timeout)
        finally:
            if self.lost is not None:
                self._sock.close()
            self.lock.release()
        if isinstance(reply, Error):
            raise WorkerError(f"worker {self.addr}: {reply.message}")
        return reply, data

    def _exchange(self, msg: Message, payload: bytes | memoryview, timeout: float) -> tuple[Message, bytes]:
        try:
            self._frames.settimeout(timeout)
            self._frames.send(msg, payload)
            frame = self._frames.recv()
            if frame is None:
                self.lost = self.lost or "the worker closed the connection"
                raise ConnectionLost(f"worker {self.addr}: {self.lost}")
            if (rid := getattr(frame[0], "id", -1)) != msg.id:
                raise ProtocolError(f"reply to request {rid} while request {msg.id} was waiting")
            return frame
        except TimeoutError:
            self.lost = f"no reply to {type(msg).__name__.lower()} within {timeout:g}s"
            raise WorkerError(
                f"worker {self.addr}: no reply within {timeout:g}s (connection dropped)"
            ) from None
        except ProtocolError as exc:
            self.lost = self.lost or f"protocol error: {exc}"
            log.warning("worker %s: %s", self.addr, self.lost)
        except OSError as exc:
            self.lost = self.lost or f"connection error: {exc}"
        raise ConnectionLost(f"worker {self.addr}: {self.lost}")

    def close(self, reason: str) -> None:
        """Drop the link from any thread; a request under way fails with `reason`."""
        if self.lost is None:
            self.lost = reason
        with suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        if self.lock.acquire(blocking=False):
            self._sock.close()
            self.lock.release()


class WorkerClient:
    """A live, authenticated connection to one worker."""

    def __init__(
        self,
        addr: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        report: NodeReport,
        link: ForwardLink,
    ) -> None:
        self.addr = addr
        self.report = report
        self.link = link
        self._reader = reader
        self._writer = writer
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._abandoned: set[int] = set()
        self._lost: str | None = None
        self._read_task = asyncio.create_task(self._read_replies())

    @classmethod
    async def connect(
        cls, addr: str, token: str, timeout: float = CONNECT_TIMEOUT, ticket: bytes | None = None
    ) -> WorkerClient:
        """Connect and run the HMAC handshake; raise WorkerError naming the address.

        ticket: the one a join gave the worker expected there; one that cannot prove it is WrongWorker.
        """
        try:
            host, port = parse_host_port(addr)
            return await asyncio.wait_for(cls._connect(addr, host, port, token, ticket), timeout)
        except TimeoutError:
            raise WorkerError(f"worker {addr}: no handshake within {timeout:.0f}s") from None
        except (OSError, ProtocolError, ValueError) as exc:
            raise WorkerError(f"worker {addr}: cannot connect: {exc}") from exc

    @classmethod
    async def _connect(
        cls, addr: str, host: str, port: int, token: str, ticket: bytes | None
    ) -> WorkerClient:
        reader, writer, report = await _handshake(host, port, token, ticket)
        try:
            # The link's transport is closed at once: its socket lives on, a blocking one, off the loop.
            _, link_writer, _ = await _handshake(host, port, token, ticket)
            link = ForwardLink(addr, link_writer.get_extra_info("socket").dup())
            link_writer.close()
        except BaseException:
            writer.close()
            raise
        return cls(addr, reader, writer, report, link)

    @property
    def lost(self) -> str | None:
        """Why the connection is gone, or None while it is up."""
        return self._lost or self.link.lost

    def drop(self, reason: str) -> None:
        """Close both connections at once; pending requests fail with `reason` (or the link's own)."""
        self._fail_all(self.link.lost or reason)

    async def _read_replies(self) -> None:
        reason = "the worker closed the connection"
        try:
            while (frame := await read_frame(self._reader, DEFAULT_MAX_PAYLOAD)) is not None:
                msg, payload = frame
                rid = getattr(msg, "id", -1)
                if rid in self._abandoned:
                    self._abandoned.discard(rid)
                    log.debug("worker %s: late reply to timed-out request %d dropped", self.addr, rid)
                    continue
                fut = self._pending.pop(rid, None)
                if fut is None or fut.done():
                    log.warning("worker %s: reply to no pending request: %s", self.addr, type(msg).__name__)
                    continue
                fut.set_result((msg, payload))
        except ProtocolError as exc:
            reason = f"protocol error: {exc}"
            log.warning("worker %s: %s", self.addr, reason)
        except (ConnectionError, OSError) as exc:
            reason = f"connection error: {exc}"
        finally:
            self._fail_all(reason)

    def _fail_all(self, reason: str) -> None:
        if self._lost is None:
            self._lost = reason
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ConnectionLost(f"worker {self.addr}: {self._lost}"))
        self._pending.clear()
        self._writer.close()
        self.link.close(self._lost)

    async def _request(
        self, make: Callable[[int], Message], payload: bytes | memoryview, timeout: float, *, poison: bool
    ) -> tuple[Message, bytes]:
        """Send one request and await its reply; on timeout drop the connection if `poison`, else abandon."""
        if self._lost is not None:
            raise ConnectionLost(f"worker {self.addr}: {self._lost}")
        rid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        msg = make(rid)
        kind = type(msg).__name__.lower()
        sent = False
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a
            # cancellation that lands as the reply arrives.
            async with asyncio.timeout(timeout):
                self._writer.writelines(encode_frame(msg, payload))
                await self._writer.drain()
                sent = True
                reply, data = await fut
        except TimeoutError:
            # A worker that does not even read its socket is not serving anyone: drop it too.
            if poison or not sent or len(self._abandoned) >= MAX_ABANDONED:
                self._fail_all(f"no reply to {kind} within {timeout:g}s")
                dropped = f"worker {self.addr}: no reply within {timeout:g}s (connection dropped)"
                raise WorkerError(dropped) from None
            self._abandoned.add(rid)
            kept = f"worker {self.addr}: {kind} timed out: no reply within {timeout:g}s (connection kept)"
            raise RequestTimeout(kept) from None
        except (ConnectionError, OSError) as exc:
            self._fail_all(f"connection error: {exc}")
            raise ConnectionLost(f"worker {self.addr}: {self._lost}") from exc
        finally:
            self._pending.pop(rid, None)
        if isinstance(reply, Error):
            raise WorkerError(f"worker {self.addr}: {reply.message}")
        return reply, data

    def forward_now(self, item: BatchItem, timeout: float = REQUEST_TIMEOUT) -> tuple[np.ndarray, float]:
        """Run the worker's stage on `item` over the link (blocking); return its output and compute_ms."""
        tensor, payload = pack_tensor(item.x)

        def make(rid: int) -> Forward:
            session, start_pos, last_only = item.session, item.start_pos, item.last_only
            return Forward(id=rid, session=session, start_pos=start_pos, tensor=tensor, last_only=last_only)

        reply, data = self.link.request(make, payload, timeout)
        if not isinstance(reply, Result):
            raise WorkerError(f"worker {self.addr}: answered a forward with {type(reply).__name__}")
        return unpack_tensor(reply.tensor, data), reply.compute_ms

    def forward_batch_now(
        self, x: np.ndarray, entries: list[BatchEntry], timeout: float = REQUEST_TIMEOUT
    ) -> tuple[np.ndarray, list[int], float]:
        """Run the worker's stage once on stacked rows (blocking); return the output, its rows, compute_ms."""
        tensor, payload = pack_tensor(x)
        reply, data = self.link.request(
            lambda rid: ForwardBatch(id=rid, entries=entries, tensor=tensor), payload, timeout
        )
        if not isinstance(reply, BatchResult):
            raise WorkerError(f"worker {self.addr}: answered a forward_batch with {type(reply).__name__}")
        if len(reply.rows) != len(entries):
            raise WorkerError(f"worker {self.addr}: {len(reply.rows)} outputs for a batch of {len(entries)}")
        return unpack_tensor(reply.tensor, data), reply.rows, reply.compute_ms

    async def reset(self, session: str, timeout: float = REQUEST_TIMEOUT) -> None:
        """Drop the worker's state for `session`, in order after the forwards sent before it."""
        request = functools.partial(self.link.request, lambda rid: Reset(id=rid, session=session), b"")
        reply, _ = await self._off_loop(request, timeout)
        if not isinstance(reply, Done):
            raise WorkerError(f"worker {self.addr}: answered a reset with {type(reply).__name__}")

    async def _off_loop(self, call: Callable[..., T], timeout: float) -> T:
        """Run a blocking link request on a thread; a link that broke takes the whole client down."""
        try:
            return await asyncio.to_thread(call, timeout=timeout)
        except ConnectionLost:
            self.drop("the link to the worker broke")
            raise
        except WorkerError:
            if self.link.lost is not None:
                self.drop("the link to the worker broke")
            raise

    async def stats(self, timeout: float = REQUEST_TIMEOUT) -> Stats:
        """Ask the worker for its live stats."""
        reply, _ = await self._request(lambda rid: GetStats(id=rid), b"", timeout, poison=False)
        if not isinstance(reply, Stats):
            raise WorkerError(f"worker {self.addr}: answered stats with {type(reply).__name__}")
        return reply

    async def close(self, reason: str = "closed by the coordinator") -> None:
        """Close the connection and wait for the reader to finish; pending requests fail with `reason`."""
        self._fail_all(reason)
        self._read_task.cancel()
        with suppress(asyncio.CancelledError):
            await self._read_task
        with suppress(Exception):
            await self._writer.wait_closed()


async def _handshake(
    host: str, port: int, token: str, ticket: bytes | None = None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, NodeReport]:
    """Open a connection and prove, both ways, that each side knows the token (and the worker, the ticket)."""
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
    try:
        challenge = await _expect(reader, Challenge)
        nonce = auth.new_nonce()
        await send(writer, Hello(mac=auth.mac(token, "client", challenge.nonce), nonce=nonce))
        welcome = await _expect(reader, Welcome)
        if not auth.verify(token, "worker", nonce, welcome.mac):
            raise ProtocolError("the worker does not know our token")
        if ticket is not None and not auth.holds_ticket(ticket, nonce, welcome.joined):
            raise WrongWorker(f"worker {host}:{port} cannot prove its join ticket", welcome.report)
    except BaseException:
        writer.close()
        raise
    return reader, writer, welcome.report


async def _expect(reader: asyncio.StreamReader, kind: type[M]) -> M:
    frame = await read_frame(reader, DEFAULT_MAX_PAYLOAD)
    if frame is None:
        raise ProtocolError(f"closed before {kind.__name__.lower()}")
    msg = frame[0]
    if isinstance(msg, Error):
        raise ProtocolError(msg.message)
    if not isinstance(msg, kind):
        raise ProtocolError(f"expected {kind.__name__.lower()}, got {type(msg).__name__}")
    return msg
