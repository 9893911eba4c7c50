"""One TCP connection to one worker: handshake, then requests matched by id.

A forward with no reply in time drops the connection: the worker may still be
computing, and its late output must not be taken for another's. Any other
request (stats, reset) that times out is only abandoned: its late reply is
dropped when it comes, and the forwards on the same connection go on.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from contextlib import suppress
from typing import TypeVar

import numpy as np

from workers import auth
from workers.report import NodeReport
from workers.wire import (
    DEFAULT_MAX_PAYLOAD,
    Challenge,
    Done,
    Error,
    Forward,
    GetStats,
    Hello,
    Message,
    ProtocolError,
    Reset,
    Result,
    Stats,
    Welcome,
    encode_frame,
    pack_tensor,
    read_frame,
    send,
    unpack_tensor,
)

log = logging.getLogger("coordinator.client")

CONNECT_TIMEOUT = 10.0
REQUEST_TIMEOUT = 30.0
# Timed-out requests left waiting for a late reply on one connection; one more
# drops the connection, as a worker that leaves this many unanswered is not serving.
MAX_ABANDONED = 64

M = TypeVar("M", bound=Message)


class WorkerError(Exception):
    """A request that failed: the worker said so, hung, or the connection is gone."""


class ConnectionLost(WorkerError):
    """The connection to the worker broke; every pending request fails with this."""


class RequestTimeout(WorkerError):
    """A request other than a forward got no reply in time; the connection is kept."""


class WorkerClient:
    """A live, authenticated connection to one worker."""

    def __init__(
        self, addr: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, report: NodeReport
    ) -> None:
        self.addr = addr
        self.report = report
        self._reader = reader
        self._writer = writer
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._abandoned: set[int] = set()
        self._lost: str | None = None
        self._read_task = asyncio.create_task(self._read_replies())

    @classmethod
    async def connect(cls, addr: str, token: str, timeout: float = CONNECT_TIMEOUT) -> WorkerClient:
        """Connect and run the HMAC handshake; raise WorkerError naming the address."""
        host, _, port = addr.rpartition(":")
        try:
            return await asyncio.wait_for(cls._connect(addr, host, int(port), token), timeout)
        except TimeoutError:
            raise WorkerError(f"worker {addr}: no handshake within {timeout:.0f}s") from None
        except (OSError, ProtocolError, ValueError) as exc:
            raise WorkerError(f"worker {addr}: cannot connect: {exc}") from exc

    @classmethod
    async def _connect(cls, addr: str, host: str, port: int, token: str) -> WorkerClient:
        reader, writer = await asyncio.open_connection(host.strip("[]"), port, limit=1 << 20)
        try:
            challenge = await _expect(reader, Challenge)
            nonce = auth.new_nonce()
            await send(writer, Hello(mac=auth.mac(token, "client", challenge.nonce), nonce=nonce))
            welcome = await _expect(reader, Welcome)
            if not auth.verify(token, "worker", nonce, welcome.mac):
                raise ProtocolError("the worker does not know our token")
        except BaseException:
            writer.close()
            raise
        return cls(addr, reader, writer, welcome.report)

    @property
    def lost(self) -> str | None:
        """Why the connection is gone, or None while it is up."""
        return self._lost

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

    async def forward(
        self,
        x: np.ndarray,
        *,
        session: str,
        start_pos: int,
        last_only: bool = False,
        timeout: float = REQUEST_TIMEOUT,
    ) -> tuple[np.ndarray, float]:
        """Run the worker's stage on `x`; return its output and its compute_ms."""
        tensor, payload = pack_tensor(x)

        def make(rid: int) -> Forward:
            return Forward(id=rid, session=session, start_pos=start_pos, tensor=tensor, last_only=last_only)

        reply, data = await self._request(make, payload, timeout, poison=True)
        if not isinstance(reply, Result):
            raise WorkerError(f"worker {self.addr}: answered a forward with {type(reply).__name__}")
        return unpack_tensor(reply.tensor, data), reply.compute_ms

    async def reset(self, session: str, timeout: float = REQUEST_TIMEOUT) -> None:
        """Drop the worker's state for `session`."""
        reply, _ = await self._request(lambda rid: Reset(id=rid, session=session), b"", timeout, poison=False)
        if not isinstance(reply, Done):
            raise WorkerError(f"worker {self.addr}: answered a reset with {type(reply).__name__}")

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
