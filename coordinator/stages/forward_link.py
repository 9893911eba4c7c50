"""The blocking connection to a worker that carries the requests touching a session's state, in order.

Forwards and resets go over it one at a time, from a forward thread or from
the event loop (see ForwardLink). A request with no reply in time drops the
link: the worker may still be computing, and its late output must not be
taken for another's.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import threading
from collections.abc import Callable
from contextlib import suppress

from workers.protocol.messages import Error, Message
from workers.protocol.wire import FrameSocket, ProtocolError, loop_waits

log = logging.getLogger("coordinator.stages.forward_link")


class WorkerError(Exception):
    """A request that failed: the worker said so, hung, or the connection is gone."""


class ConnectionLost(WorkerError):
    """The connection to the worker broke; every pending request fails with this."""


class RequestTimeout(WorkerError):
    """A request other than a forward got no reply in time; the connection is kept."""


class ForwardLink:
    """A blocking connection to one worker for the requests that touch session state, one at a time.

    `lock` is held for a whole request; a caller that must order its requests
    against others' (a forward chain, a reset after it) may hold it across several.
    The event loop may hold it too (`take_on_loop`), for requests it awaits
    (`request_on_loop`) rather than hands to a thread: one wake of the loop
    per reply, where a thread's request costs a wake of the thread and then
    one of the loop. As the loop's thread could take the reentrant lock again
    while it awaits, `on_loop` says that it holds it.
    """

    def __init__(self, addr: str, sock: socket.socket) -> None:
        self.addr = addr
        self.lock = threading.RLock()
        self.lost: str | None = None
        self.on_loop = False  # the event loop holds `lock` (set and read on the loop's thread only)
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
        return _answer(self.addr, reply, data)

    def take_on_loop(self) -> bool:
        """Hold the link for requests from the event loop if nobody holds it; False if somebody does."""
        if self.on_loop or not self.lock.acquire(blocking=False):
            return False
        self.on_loop = True
        return True

    def give_back_on_loop(self) -> None:
        """Let go of the link the loop took; a link lost meanwhile is closed now, as `close` left it."""
        self.on_loop = False
        if self.lost is not None:
            self._sock.close()
        self.lock.release()

    async def request_on_loop(
        self, msg: Callable[[int], Message], payload: bytes | memoryview, timeout: float
    ) -> tuple[Message, bytes]:
        """`request`, awaited on the event loop, which took the link (`take_on_loop`)."""
        if self.lost is not None:
            raise ConnectionLost(f"worker {self.addr}: {self.lost}")
        m = msg(next(self._ids))
        readable, writable = loop_waits(self._sock)
        try:
            async with asyncio.timeout(timeout):
                await self._frames.send_on_loop(writable, m, payload)
                frame = await self._frames.recv_on_loop(readable)
            reply, data = self._checked(m, frame)
        except (OSError, ProtocolError) as exc:  # TimeoutError is an OSError
            raise self._lost_by(m, exc, timeout) from None
        except asyncio.CancelledError:  # (the loop closing) its reply would be read as the next one's
            self.lost = self.lost or f"{type(m).__name__.lower()} cancelled before its reply"
            raise
        return _answer(self.addr, reply, data)

    def _exchange(self, msg: Message, payload: bytes | memoryview, timeout: float) -> tuple[Message, bytes]:
        try:
            self._frames.settimeout(timeout)
            self._frames.send(msg, payload)
            return self._checked(msg, self._frames.recv())
        except (OSError, ProtocolError) as exc:
            raise self._lost_by(msg, exc, timeout) from None

    def _checked(self, msg: Message, frame: tuple[Message, bytes] | None) -> tuple[Message, bytes]:
        """The reply `frame` to `msg`; ConnectionLost for none (the worker closed the link)."""
        if frame is None:
            self.lost = self.lost or "the worker closed the connection"
            raise ConnectionLost(f"worker {self.addr}: {self.lost}")
        if (rid := getattr(frame[0], "id", -1)) != msg.id:
            raise ProtocolError(f"reply to request {rid} while request {msg.id} was waiting")
        return frame

    def _lost_by(self, msg: Message, exc: Exception, timeout: float) -> WorkerError:
        """The link is lost by `exc` (a timeout, a broken frame, a socket error): the error to raise."""
        if isinstance(exc, TimeoutError):
            self.lost = f"no reply to {type(msg).__name__.lower()} within {timeout:g}s"
            return WorkerError(f"worker {self.addr}: no reply within {timeout:g}s (connection dropped)")
        if isinstance(exc, ProtocolError):
            self.lost = self.lost or f"protocol error: {exc}"
            log.warning("worker %s: %s", self.addr, self.lost)
        else:
            self.lost = self.lost or f"connection error: {exc}"
        return ConnectionLost(f"worker {self.addr}: {self.lost}")

    def close(self, reason: str) -> None:
        """Drop the link from any thread; a request under way fails with `reason`."""
        if self.lost is None:
            self.lost = reason
        with suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        # Not while the loop holds it: its thread would take the lock again and close the socket under
        # the request it awaits, whose descriptor the loop still watches.
        if not self.on_loop and self.lock.acquire(blocking=False):
            self._sock.close()
            self.lock.release()


def _answer(addr: str, reply: Message, data: bytes) -> tuple[Message, bytes]:
    """A request's reply, or the WorkerError the worker's Error reply names."""
    if isinstance(reply, Error):
        raise WorkerError(f"worker {addr}: {reply.message}")
    return reply, data
