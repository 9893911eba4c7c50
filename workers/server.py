"""The worker's TCP server: handshake on the event loop, then each connection on a thread of its own.

Once a client is authenticated its socket leaves the event loop: a thread
reads a request, computes, and writes the reply, with no hand-off in between
(so that a hop costs what the socket costs). The kernels' thread count is
chosen as the stage serves, by timing its decode steps (workers.threads),
unless the count is fixed. Requests on one connection are answered in
order; stats on another connection are answered while a forward computes,
as only stage calls take the compute lock. A stage that hangs never
blocks the process from exiting (the threads are daemons). A stranger gets
little: before the handshake only a Hello-sized frame is read, for
HANDSHAKE_TIMEOUT at most, and a few connections per peer may wait in the
handshake at once (the gate's bounds: past them the longest-waiting goes).
A worker that joined proves, in its Welcome, that it holds the ticket its
assignment came with, so the coordinator knows it reached this worker.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from typing import TypeVar

import numpy as np

from workers.protocol import auth
from workers.protocol.gate import HANDSHAKE_TIMEOUT, HandshakeGate, read_hello
from workers.protocol.info import BatchItem
from workers.protocol.messages import (
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
from workers.protocol.report import NodeReport, resident_bytes
from workers.protocol.wire import (
    DEFAULT_MAX_PAYLOAD,
    FrameSocket,
    ProtocolError,
    pack_tensor,
    send,
    unpack_tensor,
)
from workers.stage import Stage, StageError
from workers.threads import ThreadChoice, kernels_loaded, rule_from_env

log = logging.getLogger("workers.server")
T = TypeVar("T")

# Seconds close() waits for the serving threads (a forward under way finishing) before it lets the stage go.
CLOSE_GRACE_S = 2.0


class WorkerServer:
    """Serves one built Stage to any client that passes the handshake."""

    def __init__(
        self, stage: Stage, token: str, max_payload: int = DEFAULT_MAX_PAYLOAD, ticket: bytes = b""
    ) -> None:
        self.stage = stage
        self.token = token
        self.ticket = ticket  # from the join that assigned the stage; b"" for a worker that did not join
        self.max_payload = max_payload
        self.report: NodeReport | None = None
        self.forwards = 0
        self.gate = HandshakeGate()
        # Stage calls one at a time, whichever connection asks (the Stage contract).
        self._compute = threading.Lock()
        # The kernels' threads, if the stage computes with them: sized by its build, chosen from here on
        # (None: the count stays as built).
        kernels, measured = kernels_loaded(), rule_from_env() == "measured"
        most = kernels.threads() if kernels is not None else 1
        self._kernels = kernels
        self.threads = ThreadChoice(most) if kernels is not None and measured and most > 1 else None
        self._serving: dict[socket.socket, threading.Thread] = {}
        self._serving_lock = threading.Lock()

    def close(self) -> None:
        """Hang up on every client; wait (CLOSE_GRACE_S at most) for their threads, which hold the stage."""
        with self._serving_lock:
            serving = dict(self._serving)
        for sock in serving:
            _hang_up(sock)
        deadline = time.monotonic() + CLOSE_GRACE_S
        for thread in serving.values():
            thread.join(max(0.0, deadline - time.monotonic()))

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
        """Run the handshake, then hand the connection to a serving thread of its own."""
        peer = writer.get_extra_info("peername")
        sock = None
        try:
            hello = await self.gate.admit(writer, lambda: self._prove(reader, writer))
            await asyncio.wait_for(self._welcome(writer, hello), HANDSHAKE_TIMEOUT)
            # A second descriptor of the same socket outlives the transport closed below.
            sock = writer.get_extra_info("socket").dup()
        except ProtocolError as exc:
            log.warning("dropping %s: %s", peer, exc)
        except TimeoutError:
            log.warning("dropping %s: no handshake within %.0fs", peer, HANDSHAKE_TIMEOUT)
        except (ConnectionError, OSError) as exc:
            log.info("client %s gone: %s", peer, exc)
        finally:
            writer.close()
            with suppress(Exception):
                await writer.wait_closed()
        if sock is not None:
            log.info("client %s connected", peer)
            serving = threading.Thread(
                target=self._serve, args=(sock, peer), name=f"client {peer}", daemon=True
            )
            with self._serving_lock:
                self._serving[sock] = serving
            serving.start()

    async def _prove(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Hello:
        """Challenge the client; its Hello once it has proved the token."""
        nonce = auth.new_nonce()
        await send(writer, Challenge(nonce=nonce))
        hello = await read_hello(reader)
        if not auth.verify(self.token, "client", nonce, hello.mac):
            await send(writer, Error(id=0, message="handshake failed: wrong token"))
            raise ProtocolError("handshake failed: wrong token")
        return hello

    async def _welcome(self, writer: asyncio.StreamWriter, hello: Hello) -> None:
        """Prove ourselves to a client that proved the token, and say what we serve."""
        assert self.report is not None
        # From the Welcome on, what the client sends is the serving thread's to read, not the loop's.
        writer.transport.pause_reading()
        joined = auth.ticket_proof(self.ticket, hello.nonce) if self.ticket else b""
        mac = auth.mac(self.token, "worker", hello.nonce)
        await send(writer, Welcome(mac=mac, report=self.report, joined=joined))

    def _serve(self, sock: socket.socket, peer: object) -> None:
        """Answer requests in order until the client closes or breaks the protocol (a blocking socket)."""
        frames = FrameSocket(sock, self.max_payload)
        try:
            while (frame := frames.recv()) is not None:
                frames.send(*self._answer(*frame))
                del frame  # hold no request while waiting for the next one
            log.info("client %s closed the connection", peer)
        except ProtocolError as exc:
            log.warning("dropping %s: %s", peer, exc)
        except OSError as exc:
            log.info("client %s gone: %s", peer, exc)
        finally:
            with self._serving_lock:
                self._serving.pop(sock, None)
            sock.close()

    def _answer(self, msg: Message, payload: bytes | memoryview) -> tuple[Message, bytes | memoryview]:
        match msg:
            case Forward():
                return self._forward(msg, payload)
            case ForwardBatch():
                return self._forward_batch(msg, payload)
            case Reset(id=rid, session=session):
                with self._compute:
                    self.stage.reset(session)
                return Done(id=rid), b""
            case GetStats(id=rid):
                sessions, forwards, held = self.stage.n_sessions(), self.forwards, self.stage.kv_bytes()
                return Stats(
                    id=rid,
                    resident_bytes=resident_bytes(),
                    sessions=sessions,
                    forwards=forwards,
                    kv_bytes=sum(held.values()),
                    kv_session_bytes=held,
                ), b""
            case _:
                rid = getattr(msg, "id", 0)
                return Error(id=rid, message=f"a worker does not accept {type(msg).__name__}"), b""

    def _forward(self, msg: Forward, payload: bytes | memoryview) -> tuple[Message, bytes | memoryview]:
        x = unpack_tensor(msg.tensor, payload)
        if (beyond := self._beyond_context(msg.start_pos, x)) is not None:
            return Error(id=msg.id, message=beyond), b""

        def run() -> np.ndarray:
            return self.stage.forward(
                x, session=msg.session, start_pos=msg.start_pos, last_only=msg.last_only
            )

        outcome = self._compute_call(msg.id, run, rows=x.shape[0] if x.ndim else 0)
        if isinstance(outcome, Error):
            return outcome, b""
        y, compute_ms = outcome
        try:
            tensor, out = pack_tensor(y)
        except ProtocolError as exc:
            return Error(id=msg.id, message=str(exc)), b""
        return Result(id=msg.id, compute_ms=compute_ms, tensor=tensor), out

    def _forward_batch(
        self, msg: ForwardBatch, payload: bytes | memoryview
    ) -> tuple[Message, bytes | memoryview]:
        x = unpack_tensor(msg.tensor, payload)
        items, row = [], 0
        for entry in msg.entries:
            part = x[row : row + entry.rows]
            row += entry.rows
            if (beyond := self._beyond_context(entry.start_pos, part)) is not None:
                return Error(id=msg.id, message=f"session {entry.session}: {beyond}"), b""
            items.append(BatchItem(part, entry.session, entry.start_pos, entry.last_only))
        outcome = self._compute_call(msg.id, lambda: self.stage.forward_batch(items), rows=row)
        if isinstance(outcome, Error):
            return outcome, b""
        ys, compute_ms = outcome
        try:
            tensor, out = pack_tensor(_stack(ys, len(items)))
        except (ProtocolError, StageError) as exc:
            return Error(id=msg.id, message=str(exc)), b""
        return BatchResult(id=msg.id, compute_ms=compute_ms, rows=[len(y) for y in ys], tensor=tensor), out

    def _beyond_context(self, start_pos: int, x: np.ndarray) -> str | None:
        """Why rows at `start_pos` do not fit the model's context, or None when they do."""
        end = start_pos + (x.shape[0] if x.ndim else 0)
        if end > (limit := self.stage.info.context_length):
            return f"positions {start_pos}..{end} exceed the context length {limit}"
        return None

    def _compute_call(self, rid: int, run: Callable[[], T], rows: int) -> tuple[T, float] | Error:
        """Run a stage call of `rows` rows under the compute lock, timed; a failure becomes its Error."""
        with self._compute:
            choice, kernels = self.threads, self._kernels
            if choice is not None and kernels is not None and choice.threads() != kernels.threads():
                kernels.set_threads(choice.threads())
            start = time.perf_counter()
            try:
                result = run()
            except StageError as exc:
                return Error(id=rid, message=str(exc))
            except Exception as exc:  # a bug in a stage must not take the worker down
                log.exception("forward %d failed", rid)
                return Error(id=rid, message=f"{type(exc).__name__}: {exc}")
            compute_ms = (time.perf_counter() - start) * 1000
            if choice is not None:
                choice.timed(rows, compute_ms)
            self.forwards += 1
        return result, compute_ms


def _stack(ys: list[np.ndarray], expected: int) -> np.ndarray:
    """One array of the batch's outputs in order; they must agree on everything but their rows."""
    if len(ys) != expected:
        raise StageError(f"the stage returned {len(ys)} outputs for a batch of {expected}")
    if any(y.ndim == 0 or y.shape[1:] != ys[0].shape[1:] or y.dtype != ys[0].dtype for y in ys):
        kinds = [(y.dtype.name, y.shape) for y in ys]
        raise StageError(f"the stage's batch outputs differ in more than their rows: {kinds}")
    return np.concatenate(ys)


def _hang_up(sock: socket.socket) -> None:
    """End a connection from another thread: its reader wakes to the end of the stream."""
    with suppress(OSError):  # already gone
        sock.shutdown(socket.SHUT_RDWR)
