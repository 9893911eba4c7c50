"""The join listener: workers dial in, offer what they can hold, and are given the stages that lack one.

`rlx-cluster serve --join HOST:PORT` opens a pipeline whose stages are all
vacant and listens there. A worker that dials in goes through the bounds a
worker's own server sets for strangers (a Hello-sized first frame, a short
handshake, a few at once per peer), proves the token in the role "joiner", and
offers its model's fingerprint, its memory, cores and serving address; one
holding another model is refused, and told why. Once as many workers have
joined as there are stages, the planner gives each a range (evenly, or by
memory); each builds it and reports Built, and the coordinator connects to it
as to an attached worker, trusting it once the worker there proves the ticket
its Assign carried and serves what was assigned (a worker whose address
reaches another is refused for good). The join connection stays open: when
it closes the worker is gone and its stage is `down`, a vacancy the next
worker to join (or a spare already waiting) takes exactly; no other stage is
touched.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import NoReturn

from coordinator.plan.costmodel import CostModelError, ModelShape
from coordinator.plan.place import (
    FirstPlan,
    Measured,
    Placement,
    Vacancy,
    host_of,
    place,
    shape_of,
)
from coordinator.plan.split import PlanError, split
from coordinator.stages.client import WorkerClient, WorkerError, WrongWorker
from coordinator.stages.link import probe_link
from coordinator.stages.members import Member, someone_else, unlike, waiting_for
from coordinator.stages.node import Node
from coordinator.stages.pipeline import FORWARD_TIMEOUT, Pipeline
from coordinator.stages.supervisor import JoinedSupervisor
from coordinator.units import quiet, size_text
from workers.models.footprint import Footprint, describe_fingerprint, fingerprint, footprint
from workers.protocol import auth
from workers.protocol.address import host_port, parse_host_port
from workers.protocol.gate import HandshakeGate, read_hello
from workers.protocol.info import ModelInfo
from workers.protocol.joining import COORDINATOR, JOINER, keep_alive
from workers.protocol.messages import Admit, Assign, Built, Challenge, Error, Hello, Offer
from workers.protocol.report import NodeReport
from workers.protocol.wire import ProtocolError, encode_frame, read_frame, send

log = logging.getLogger("coordinator.stages.join")

CLOSE_WAIT_S = 5.0
# An admitted joiner opens the model it was told (its header, its first MiB) and times its layers
# before it offers (Gemma 3 270M: ~5 s of CPU, 15 s on a busy host; nothing once kept on its host).
OFFER_TIMEOUT_S = 120.0


class JoinListener:
    """Listens for workers that join and keeps every stage of one pipeline held by one of them."""

    def __init__(
        self,
        info: ModelInfo,
        nodes: list[Node],
        token: str,
        forward_timeout: float,
        build_timeout: float,
        progress: Callable[[str], None] = quiet,
    ) -> None:
        # The listener fills and vacates the nodes through their supervisor, which tells it (stage_down)
        # of a node that went down; the pipeline forwards through them.
        self.supervisor = JoinedSupervisor(nodes, token, self)
        self.pipeline = Pipeline(info, self.supervisor, forward_timeout)
        self.model = info.name
        self.fingerprint = fingerprint(self.model)
        self.precision = ""  # told to joiners started without one
        self.token = token
        self.build_timeout = build_timeout
        self.progress = progress
        self.members: list[Member] = []
        self.planned = False
        self.plan_error: str | None = None
        self.placement = ""  # how the first plan was made
        self.objective = "latency"
        self.costs: list[float] = []
        self.addr = ""
        self._gate = HandshakeGate()
        self._footprints: dict[str, Footprint] = {}
        self._shape: ModelShape | None = None
        self._handlers: set[asyncio.Task] = set()
        self._server: asyncio.Server | None = None
        self._closing = False

    @classmethod
    async def open(
        cls,
        addr: str,
        info: ModelInfo,
        stages: int,
        token: str,
        forward_timeout: float = FORWARD_TIMEOUT,
        build_timeout: float = 120.0,
        progress: Callable[[str], None] = quiet,
        costs: Sequence[float] = (),
        precision: str = "",
        objective: str = "latency",
    ) -> JoinListener:
        """Open a pipeline of `stages` vacant stages and listen for workers at `addr` (HOST:PORT).

        With `costs` (each layer's measured cost) the first plan balances them
        within the workers' memory, rather than splitting evenly. `precision`
        is told to joiners started without one ("": each uses the model's default).
        `objective` is what a plan by the joiners' measurements minimizes
        (coordinator.plan.placement: "latency" or "throughput"), or "even" for
        the even (or memory) split in join order, its speed predicted by them.
        """
        host, port = parse_host_port(addr, listen=True)
        ranges = split(info.n_layers, stages)
        nodes = [Node(i, r, state="vacant", error=waiting_for(0, stages)) for i, r in enumerate(ranges)]
        listener = cls(info, nodes, token, forward_timeout, build_timeout, progress)
        listener.costs = list(costs)
        listener.precision = precision
        listener.objective = objective
        listener._server = await asyncio.start_server(listener._accept, host, port)
        listener.addr = host_port(*listener._server.sockets[0].getsockname()[:2])
        progress(f"waiting for {stages} worker(s) to join at {listener.addr} (rlx-worker --join HOST:PORT)")
        return listener

    def view(self) -> dict:
        """Who has joined and what the plan lacks, for /nodes."""
        members = [m.view(self.planned) for m in self.members]
        return {"join": self.addr, "members": members, "plan_error": self.plan_error,
                "placement": self.placement}  # fmt: skip

    async def close(self) -> None:
        """Stop listening and let every joined worker go (they drop their stages and dial again)."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        for member in self.members:
            member.writer.close()
        for task in self._handlers:
            task.cancel()
        if self._handlers:
            await asyncio.wait(self._handlers, timeout=CLOSE_WAIT_S)

    # ---------------------------------------------------------------- one joiner's connection

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            await self._handle(reader, writer)
        except asyncio.CancelledError:
            # Cancelled by close(): end quietly. This task is the stream server's own, and on
            # Python 3.11 it asks a cancelled one for its exception, logging a traceback.
            pass
        finally:
            self._handlers.discard(task)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = host_port(*writer.get_extra_info("peername")[:2])
        member, reason = None, "it closed the join connection"
        try:
            keep_alive(writer)
            hello = await self._gate.admit(writer, lambda: self._prove(reader, writer))
            offer = await asyncio.wait_for(self._admit(reader, writer, hello), OFFER_TIMEOUT_S)
            if (refusal := self._refusal(offer)) is not None:
                log.warning("refused the worker at %s (%s): %s", offer.addr, peer, refusal)
                await send(writer, Error(id=0, message=refusal))
                return
            # Timed before it is placed: the plan weighs its link.
            link = await probe_link(reader, writer, 4 * self.pipeline.info.hidden) if offer.probes else None
            member = Member(offer, peer, writer, link=link)
            self.members.append(member)
            free = size_text(offer.memory_bytes)
            self.progress(f"{member.name} joined from {peer}: {free} free, {offer.cores} cores")
            self._place()
            reason = await self._follow(member, reader)
        except ProtocolError as exc:
            reason = str(exc)
            log.warning("dropping the joiner at %s: %s", peer, exc)
        except TimeoutError:
            reason = "no handshake or offer in time"
            log.warning("dropping the joiner at %s: no handshake or offer in time", peer)
        except OSError as exc:
            reason = f"connection error: {exc}"
        finally:
            writer.close()
            if member is not None:
                await self._leave(member, member.dropped or reason)

    async def _prove(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Hello:
        """Challenge the joiner; its Hello once it has proved the token."""
        nonce = auth.new_nonce()
        await send(writer, Challenge(nonce=nonce))
        hello = await read_hello(reader)
        if not auth.verify(self.token, JOINER, nonce, hello.mac):
            await send(writer, Error(id=0, message="wrong token"))
            raise ProtocolError("handshake failed: wrong token")
        return hello

    async def _admit(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, hello: Hello) -> Offer:
        """Prove ourselves to a joiner that proved the token, and read its offer."""
        # The model and precision go to admitted joiners only: a path names part of this host's disk.
        mac = auth.mac(self.token, COORDINATOR, hello.nonce)
        await send(writer, Admit(mac=mac, model=self.model, precision=self.precision))
        frame = await read_frame(reader, max_payload=0)
        if frame is not None and isinstance(frame[0], Error):
            raise ProtocolError(f"it cannot serve the model: {frame[0].message}")
        if frame is None or not isinstance(frame[0], Offer):
            got = "nothing" if frame is None else type(frame[0]).__name__
            raise ProtocolError(f"expected an offer, got {got}")
        return frame[0]

    def _refusal(self, offer: Offer) -> str | None:
        """Why this coordinator cannot take the offer, or None."""
        if offer.fingerprint != self.fingerprint:
            # The same spec with another fingerprint: the worker's own file by that name differs.
            whose = f"--model {offer.model}" if offer.model != self.model else f"its copy of {offer.model}"
            return (
                f"model mismatch: the coordinator runs {describe_fingerprint(self.fingerprint)}, "
                f"the worker has {describe_fingerprint(offer.fingerprint)} ({whose})"
            )
        try:
            self._footprint(offer.precision)
        except ValueError as exc:
            return str(exc)
        return None

    async def _follow(self, member: Member, reader: asyncio.StreamReader) -> str:
        """Read what the member says until it goes; return why it went."""
        while (frame := await read_frame(reader, max_payload=0)) is not None:
            match frame[0]:
                case Built(report=report):
                    await self._built(member, report)
                case Error(message=message):
                    # A worker that cannot build what it was given is let go; the stage waits for another.
                    raise ProtocolError(f"could not build its layers: {message}")
                case other:
                    raise ProtocolError(f"a joined worker does not send {type(other).__name__}")
        return "it closed the join connection"

    async def _built(self, member: Member, report: NodeReport) -> None:
        node = member.node
        if node is None or node.state != "building":
            raise ProtocolError("built layers nobody assigned")
        if report.layers != node.layers:
            raise ProtocolError(f"built layers {report.layers}, was assigned {node.layers}")
        if member.timer is not None:
            member.timer.cancel()
        try:
            client = await WorkerClient.connect(report.addr, self.token, ticket=member.ticket)
        except WrongWorker as exc:
            await _refuse(member, someone_else(member, report.addr, exc.report))
        except WorkerError as exc:
            unreachable = (
                f"the coordinator cannot reach {report.addr}: {exc}; start the worker with "
                "--advertise HOST:PORT naming where the coordinator can reach it"
            )
            with suppress(OSError):
                await send(member.writer, Error(id=0, message=unreachable))
            raise ProtocolError(unreachable) from exc
        if member.node is not node or member not in self.members:
            await client.close()
            return
        if (differs := unlike(member, node, client.report)) is not None:
            await client.close()
            await _refuse(member, differs)
        await self.supervisor.fill(node, client)
        self.progress(f"{node.name}: {member.name} is up, built in {report.build_ms / 1000:.1f}s")
        if self.pipeline.unready() is None:
            self.progress(f"ready: all {len(self.pipeline.nodes)} stages are up")

    async def _leave(self, member: Member, reason: str) -> None:
        """Forget a member whose connection ended; its stage becomes a vacancy."""
        self.members.remove(member)
        if member.timer is not None:
            member.timer.cancel()
        node, member.node = member.node, None
        if self._closing:
            return
        why = f"{member.name} left: {reason}"
        log.warning("%s", why)
        if node is not None and node.state == "building":
            await self.supervisor.vacate(node, why)
        elif node is not None and node.state == "up":
            await self.supervisor.vacate(node, f"its worker left: {reason}")
        self._place()

    def stage_down(self, node: Node) -> None:
        """A stage went down under its worker (its connection broke): let the worker go, to join afresh."""
        for member in self.members:
            if member.node is node:
                member.dropped = f"its stage went down: {node.error}"
                member.writer.close()

    def _too_slow(self, member: Member) -> None:
        layers = member.node.layers if member.node else "?"
        member.dropped = f"did not build layers {layers} within {self.build_timeout:g}s"
        member.writer.close()

    # ---------------------------------------------------------------- placing workers

    def _place(self) -> None:
        """Give the stages that lack a worker to the members waiting, in the order they joined."""
        if self._closing:
            return
        waiting = [m for m in self.members if m.node is None]
        nodes = self.pipeline.nodes
        offers = [m.offer for m in waiting]
        if not self.planned:
            placement = self._first_plan(waiting)
            if not self.planned:
                for node in nodes:
                    node.error = waiting_for(len(waiting), len(nodes), self.plan_error)
                return
        else:
            held = {id(m.node) for m in self.members if m.node is not None}
            vacancies = [Vacancy(i, node.layers) for i, node in enumerate(nodes)
                         if node.state in ("vacant", "down") and id(node) not in held]  # fmt: skip
            placement = place(offers, vacancies, self._footprint)
        for given in placement.given:
            node = nodes[given.stage]
            node.layers = given.layers
            self._assign(waiting[given.member], node)
        for i, why in placement.why.items():
            waiting[i].why_spare = why
            self.progress(f"{waiting[i].name} waits as a spare: {why}")

    def _first_plan(self, waiting: list[Member]) -> Placement:
        """Plan every stage once enough members have joined; a plan that cannot be made is said once."""
        first = FirstPlan(self.pipeline.info.n_layers, len(self.pipeline.nodes))
        offers = [m.offer for m in waiting]
        try:
            measured = self._measured(waiting) if len(waiting) >= first.stages else None
            placement = place(offers, first, self._footprint, self.costs, measured)
        except PlanError as exc:
            if str(exc) != self.plan_error:
                log.error("cannot plan the stages: %s", exc)
                self.progress(f"cannot plan the stages: {exc}")
            self.plan_error = str(exc)
            return Placement([], list(range(len(offers))))
        if placement.given:
            self.planned, self.plan_error, self.placement = True, None, placement.how
            if placement.how:
                log.info("%s", placement.how)
                self.progress(placement.how)
        return placement

    def _measured(self, waiting: list[Member]) -> Measured | None:
        """The members' measurements as hosts for the planner; None when the model has no shape to plan."""
        if self._shape is None:
            try:
                self._shape = shape_of(self.model, self.pipeline.info, self._footprint(self.precision))
            except (CostModelError, ValueError) as exc:
                log.warning("placing joined workers without their measurements: %s", exc)
                return None
        links = [(m.link.rtt_ms, m.link.bandwidth) if m.link else None for m in waiting]
        hosts = [host_of(m.offer, link, self._shape.n_layers) for m, link in zip(waiting, links, strict=True)]
        return Measured(self._shape, hosts, self.objective)

    def _assign(self, member: Member, node: Node) -> None:
        member.node = node
        node.report = None
        node.set("building")
        member.ticket = auth.new_nonce()
        member.writer.writelines(encode_frame(Assign(layers=node.layers, ticket=member.ticket)))
        member.timer = asyncio.get_running_loop().call_later(self.build_timeout, self._too_slow, member)
        self.progress(f"{node.name}: assigned to {member.name}")

    def _footprint(self, precision: str) -> Footprint:
        if precision not in self._footprints:
            self._footprints[precision] = footprint(self.model, precision)
        return self._footprints[precision]


async def _refuse(member: Member, why: str) -> NoReturn:
    """Refuse a member for good: tell it (it stops rather than join again), then let it go."""
    with suppress(OSError):
        await send(member.writer, Error(id=0, message=why, final=True))
    raise ProtocolError(why)
