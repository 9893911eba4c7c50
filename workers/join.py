"""Join a coordinator: dial it, offer what this worker can hold, build the layers it assigns, serve them.

The coordinator challenges the joiner, which answers with a Hello in the role
"joiner"; the coordinator proves itself in the role "coordinator" (Admit).
These roles are not the client/worker handshake's, so no answer from one can
be replayed in the other. Admit names the model the coordinator runs and its
precision: a worker started without --model (or --precision) takes those,
resolving the spec on its own disk. The joiner then binds its stage server,
offers its memory, cores, serving address and its model's fingerprint (which
the coordinator compares with its own, so a local file that differs is
refused), and waits (a spare, while nothing is vacant) for an Assign. It
builds those layers, serves them and reports them (Built) on the same
connection, which stays open: its closing is how each side learns that the
other has gone. When the coordinator goes, the worker drops its stage and
dials again with backoff, so that a restarted coordinator gets its workers
back without anyone touching them.

An Error in place of Admit (a wrong token) or of Assign (another model) is a
refusal: dialing again would not change it, so the worker stops (Refused);
so is a final Error after Built (the coordinator reached another worker at
the address offered: the stage server proves the Assign's ticket in each
Welcome, and another worker cannot). A model it is told but cannot open
stops it too (ModelSpecError), the coordinator told why in place of an Offer.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import socket
import sys
import time
from contextlib import suppress
from dataclasses import dataclass

from workers import measured, memory
from workers.calibrate import Costs
from workers.models import ModelSpecError, build, default_precision, describe
from workers.models.footprint import fingerprint
from workers.protocol import auth
from workers.protocol.address import host_port
from workers.protocol.gate import HANDSHAKE_TIMEOUT
from workers.protocol.joining import COORDINATOR, JOINER, described, keep_alive, next_message
from workers.protocol.messages import (
    PROTOCOL_VERSION,
    Admit,
    Assign,
    Built,
    Challenge,
    Error,
    Fingerprint,
    Hello,
    Offer,
    Probe,
)
from workers.protocol.report import encode_report
from workers.protocol.wire import ProtocolError, read_frame, send
from workers.server import WorkerServer
from workers.threads import on_own_thread

log = logging.getLogger("workers.join")

CONNECT_TIMEOUT = 10.0
FIRST_RETRY_S = 0.5
MAX_RETRY_S = 5.0
QUIET_S = 5.0  # at most one line about failed attempts this often
WILDCARDS = ("", "0.0.0.0", "::")
# The largest probe frame a waiting joiner echoes (a long prompt's activations).
PROBE_MAX = 16 << 20
# What a worker started without --model serves when the coordinator does not say (one older than
# Admit's model field): the model every worker assumed before coordinators told it. A newer one always
# names its model (gemma3 too, resolved to the file joined on the worker's own host).
ASSUMED_MODEL = "smollm2"


class Refused(Exception):
    """The coordinator will not take this worker; dialing again would not change that."""


class BuildFailed(Exception):
    """The assigned layers could not be built; the message says why."""


@dataclass(frozen=True)
class JoinOptions:
    """How to join, and what to offer.

    coordinator: host and port of the coordinator's join listener.
    model: the model spec this worker holds; None for the one the coordinator runs.
    precision: the precision it builds in; None for the coordinator's, else the model's default.
    token: the shared worker token.
    host: address the stage server listens on; None for this end of the connection to the coordinator.
    port: port the stage server listens on (0: any free port).
    advertise: `host:port` the coordinator reaches the stage server at; None for the
        listening address, or this end of the connection when listening on all interfaces.
    max_payload: the largest tensor the stage server accepts.
    """

    coordinator: tuple[str, int]
    model: str | None
    precision: str | None
    token: str
    host: str | None = None
    port: int = 0
    advertise: str | None = None
    max_payload: int = 256 * 1024 * 1024

    @property
    def where(self) -> str:
        host, port = self.coordinator
        return f"{host}:{port}"


@dataclass(frozen=True)
class Serving:
    """What this worker offers on one join connection.

    model: the model spec it builds from.
    precision: the precision it builds in.
    fingerprint: the model's fingerprint, read from its own disk.
    """

    model: str
    precision: str
    fingerprint: Fingerprint


class Joiner:
    """Joins a coordinator and serves what it assigns, joining again whenever it goes."""

    def __init__(self, opts: JoinOptions) -> None:
        self.opts = opts
        # By spec: a worker told its model reads each file once, however often it joins again.
        self._fingerprints: dict[str, Fingerprint] = {}
        if opts.model is not None:
            self._fingerprints[opts.model] = fingerprint(opts.model)
        self._failures = 0
        self._said_at = -float("inf")
        self._costs: dict[tuple[str, str], tuple[Costs, str] | None] = {}  # (model, precision) -> measured

    async def run(self, stop: asyncio.Event) -> None:
        """Join and serve until `stop` is set; raise Refused or BuildFailed when trying again is useless."""
        # Read the model's metadata first: a broken file is an error before joining, and the
        # parsed header stays cached for every build to come. A model told later is read then.
        if self.opts.model is not None:
            await asyncio.to_thread(describe, self.opts.model)
        delay = FIRST_RETRY_S
        while not stop.is_set():
            attempt = asyncio.create_task(self.join_once())
            stopping = asyncio.create_task(stop.wait())
            await asyncio.wait({attempt, stopping}, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            if not attempt.done():
                attempt.cancel()
                with suppress(asyncio.CancelledError):
                    await attempt
                return
            try:
                if attempt.result():  # it was admitted: the coordinator was there until now
                    delay = FIRST_RETRY_S
            except (OSError, ProtocolError, TimeoutError) as exc:
                self._complain(
                    f"cannot join the coordinator at {self.opts.where}: {exc or type(exc).__name__}", delay
                )
            with suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
            delay = min(2 * delay, MAX_RETRY_S)

    def _complain(self, text: str, delay: float) -> None:
        """Log a failed attempt, at most once every QUIET_S, counting the ones not logged."""
        self._failures += 1
        now = time.monotonic()
        if now - self._said_at < QUIET_S:
            return
        more = f" ({self._failures} attempts since the last line)" if self._failures > 1 else ""
        log.warning("%s; trying again in %.1fs%s", text, delay, more)
        self._said_at, self._failures = now, 0

    async def join_once(self) -> bool:
        """Dial, join, serve what is assigned until the connection ends; True once admitted."""
        host, port = self.opts.coordinator
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT)
        try:
            keep_alive(writer)
            admit = await asyncio.wait_for(self._handshake(reader, writer), HANDSHAKE_TIMEOUT)
            self._failures = 0
            serving = await self._serving(admit, writer)
            costs = await self._measured(serving)
            with await self._bind(writer) as sock:
                addr = self._advertised(writer, sock)
                await send(writer, self._offer(serving, addr, costs))
                log.info("joined the coordinator at %s, offering %s (%s, %s)",
                         self.opts.where, addr, serving.model, serving.precision)  # fmt: skip
                assign = await self._assignment(reader, writer)
                if assign is not None:
                    await self._serve(reader, writer, serving, assign, sock, addr)
            return True
        finally:
            writer.close()
            with suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1.0)

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Admit:
        challenge = await next_message(reader)
        if not isinstance(challenge, Challenge):
            raise ProtocolError(f"expected a challenge, got {described(challenge)}")
        if challenge.version != PROTOCOL_VERSION:
            raise Refused(
                f"the coordinator speaks protocol {challenge.version}, this worker {PROTOCOL_VERSION}"
            )
        nonce = auth.new_nonce()
        await send(writer, Hello(mac=auth.mac(self.opts.token, JOINER, challenge.nonce), nonce=nonce))
        answer = await next_message(reader)
        if isinstance(answer, Error):
            unset = f" ({auth.WORKER_TOKEN_ENV} is not set)" if not self.opts.token else ""
            raise Refused(f"refused: {answer.message}{unset}")
        if not isinstance(answer, Admit):
            raise ProtocolError(f"expected admit, got {described(answer)}")
        if not auth.verify(self.opts.token, COORDINATOR, nonce, answer.mac):
            raise Refused("refused: the coordinator does not know our token")
        return answer

    async def _serving(self, admit: Admit, writer: asyncio.StreamWriter) -> Serving:
        """The model and precision to offer: the ones this worker was given, else the coordinator's."""
        model = self.opts.model or admit.model or ASSUMED_MODEL
        if model not in self._fingerprints:
            said = f"runs model {model!r}" if admit.model else f"does not say its model; assuming {model!r}"
            whose = f"the coordinator at {self.opts.where} {said}"
            try:
                await asyncio.to_thread(describe, model)
                self._fingerprints[model] = await asyncio.to_thread(fingerprint, model)
            except (ValueError, OSError) as exc:  # ModelSpecError, or a file the model reader refused
                cannot = f"{whose}, which this worker cannot open: {exc}"
                with suppress(OSError):
                    await send(writer, Error(id=0, message=cannot))
                raise ModelSpecError(f"{cannot}; start it with --model naming its own copy") from exc
            log.info("%s: this worker serves it", whose)
        precision = self.opts.precision or admit.precision or default_precision(model)
        return Serving(model, precision, self._fingerprints[model])

    async def _bind(self, writer: asyncio.StreamWriter) -> socket.socket:
        """A listening socket for the stage server, on --host or this end of the connection."""
        host = self.opts.host if self.opts.host is not None else writer.get_extra_info("sockname")[0]
        loop = asyncio.get_running_loop()
        family, kind, proto, _, sockaddr = (
            await loop.getaddrinfo(host, self.opts.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        )[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
            sock.listen(128)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return sock

    def _advertised(self, writer: asyncio.StreamWriter, sock: socket.socket) -> str:
        if self.opts.advertise is not None:
            return self.opts.advertise
        host, port = sock.getsockname()[:2]
        if host in WILDCARDS:
            host = writer.get_extra_info("sockname")[0]
        return host_port(host, port)

    async def _measured(self, serving: Serving) -> tuple[Costs, str] | None:
        """This host's layer costs, measured once a process (and kept on the host); None if they cannot be."""
        key = (serving.model, serving.precision)
        if key not in self._costs:
            started = time.monotonic()
            try:
                # On a thread that ends, as a build: the kernels' thread pool stays the server's alone.
                costs, how = await asyncio.to_thread(
                    on_own_thread, lambda: measured.own_costs(*key), "calibrate"
                )
            except Exception as exc:  # the worker joins unmeasured and is placed as an older one is
                log.warning("cannot measure this host's layer costs, joining without: %s: %s",
                            type(exc).__name__, exc)  # fmt: skip
                self._costs[key] = None
            else:
                log.info("layer costs %s in %.1fs: %.2f ms a decode step through every layer", how,
                         time.monotonic() - started, sum(costs.layers) + costs.stage_ms)  # fmt: skip
                self._costs[key] = (costs, how)
        return self._costs[key]

    def _offer(self, serving: Serving, addr: str, timed: tuple[Costs, str] | None) -> Offer:
        costs, how = timed if timed is not None else (None, "")
        return Offer(
            addr=addr,
            model=serving.model,
            fingerprint=serving.fingerprint,
            precision=serving.precision,
            memory_bytes=measured.memory_available(),
            cores=measured.cores(),
            pid=os.getpid(),
            layer_ms=list(costs.layers) if costs else [],
            stage_ms=costs.stage_ms if costs else 0.0,
            calibration=how,
            probes=True,
            cpu_share=measured.cpu_share(),
        )

    async def _assignment(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Assign | None:
        """Wait as long as it takes for the layers to hold, echoing probes; None if the coordinator goes."""
        while True:
            try:
                frame = await read_frame(reader, max_payload=PROBE_MAX)
                if frame is None:
                    raise ConnectionError("the coordinator closed the connection")
                msg, payload = frame
                if isinstance(msg, Probe):
                    await send(writer, msg, payload)
                    continue
            except (ProtocolError, OSError) as exc:
                log.warning("the coordinator at %s is gone before assigning layers: %s", self.opts.where, exc)
                return None
            match msg:
                case Assign():
                    return msg
                case Error(message=message):
                    raise Refused(f"refused: {message}")
            raise ProtocolError(f"expected assign, got {described(msg)}")

    async def _serve(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        serving: Serving,
        assign: Assign,
        sock: socket.socket,
        addr: str,
    ) -> None:
        """Build the layers assigned, serve them and say so, until the coordinator goes; then drop them."""
        layers = assign.layers
        log.info("building layers %s", layers)
        started = time.monotonic()
        try:
            # On a thread that ends with the build, so that the kernels' only thread pool is the server's.
            stage = await asyncio.to_thread(
                on_own_thread, lambda: build(serving.model, layers, serving.precision)
            )
        except Exception as exc:  # whatever the build raised, the coordinator and the log are told
            failed = f"cannot build layers {layers}: {type(exc).__name__}: {exc}"
            with suppress(OSError):
                await send(writer, Error(id=0, message=failed))
            raise BuildFailed(failed) from exc
        worker = WorkerServer(stage, self.opts.token, self.opts.max_payload, assign.ticket)
        report = worker.describe(addr, round((time.monotonic() - started) * 1000), serving.model)
        del stage  # the server holds the only reference, so dropping it frees the layers
        clients: set[asyncio.StreamWriter] = set()

        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            clients.add(w)
            try:
                await worker.handle(r, w)
            finally:
                clients.discard(w)

        server = await asyncio.start_server(handle, sock=sock)
        try:
            await send(writer, Built(report=report))
            sys.stdout.write(encode_report(report) + "\n")
            sys.stdout.flush()
            log.info("stage %s serving at %s for the coordinator at %s", layers, addr, self.opts.where)
            gone = await _until_closed(reader)
        finally:
            server.close()
            for client in clients:
                client.close()
            worker.close()
        # The stage's arrays go back to its build thread's arena as they are freed: given back then.
        with memory.trimming():
            worker = None  # the only reference to it, shared with the handler: its stage goes now
            await asyncio.sleep(0)  # the closed server's last callbacks still hold the handler
            gc.collect()
        log.warning("the coordinator at %s is gone (%s): stage %s dropped", self.opts.where, gone, layers)


async def _until_closed(reader: asyncio.StreamReader) -> str:
    """Wait for the join connection to end; say how it ended. A final Error is a refusal (Refused)."""
    try:
        while (frame := await read_frame(reader, max_payload=0)) is not None:
            match frame[0]:
                case Error(message=message, final=True):
                    raise Refused(f"refused: {message}")
                case Error(message=message):
                    log.warning("the coordinator says: %s", message)
                case other:
                    log.warning("ignoring %s from the coordinator on the join connection", described(other))
    except (ProtocolError, OSError) as exc:
        return str(exc) or type(exc).__name__
    return "it closed the connection"
