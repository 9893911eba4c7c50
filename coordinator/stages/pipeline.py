"""The live pipeline: one node per stage, forwards driven through them in order.

The pipeline only forwards. Its nodes' lifecycles (watching workers, restarts,
workers that join or leave) are its supervisor's (coordinator.stages.supervisor),
which it tells when a forward finds a stage's connection lost; the supervisor
module also builds pipelines of launched or attached workers.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from typing import Protocol, TypeVar

import msgspec
import numpy as np

from coordinator.events import EventBus
from coordinator.stages.batch import split_rows, stack_batch
from coordinator.stages.chain import (
    Cancelled,
    Chain,
    Finished,
    ForwardRequest,
    Halt,
    HookFailed,
    Outcome,
    StageDown,
    StageHook,
    WorkerFailed,
    never_halt,
    no_hook,
    why_down,
)
from coordinator.stages.client import WorkerClient, WorkerError
from coordinator.stages.node import Node
from coordinator.stages.replay import InputLog, Part, RecoveryHook, Refill, no_recovery_hook
from coordinator.stats import Recovery, StageTiming
from workers.protocol.info import BatchItem, ModelInfo
from workers.protocol.messages import BatchEntry

log = logging.getLogger("coordinator.stages.pipeline")

FORWARD_TIMEOUT = 60.0
# Seconds a forward that lost a stage waits for it to be back (a restart takes ~0.6 s; a joined
# worker's replacement, or Ray's, longer); 0 fails the forward at once, naming the stage.
RECOVER_TIMEOUT = 30.0
# Seconds between looks at a waiting run's cancel (and the recover timeout) while its lost stage is
# away; the stage's coming back ends the wait at once (Node.changed).
RECOVER_POLL_S = 0.02
# Forwards that may be under way at once (each on its thread); different stages serve different ones.
FORWARD_THREADS = 8
X = TypeVar("X")
Batch = tuple[np.ndarray, list[BatchEntry]]


class StageFailed(Exception):
    """A forward that failed at one stage; the message names the stage and address.

    stage, addr: the stage it failed at and its worker's address; None where no one stage is to
        blame (the pipeline is closed) or no worker holds the stage (addr of a vacant one).
    reason: why, without the stage's name: the worker's error, or the state the stage was in.
    lost: whether the forward lost the stage's connection (it broke, or no reply came in time),
        which took the stage down; False when the worker refused the forward or the stage was not up.
    """

    def __init__(
        self,
        message: str,
        *,
        stage: int | None = None,
        addr: str | None = None,
        reason: str | None = None,
        lost: bool = False,
    ) -> None:
        super().__init__(message)
        self.stage, self.addr, self.lost = stage, addr, lost
        self.reason = message if reason is None else reason

    @classmethod
    def at(cls, node: Node, message: str, reason: str, *, lost: bool = False) -> StageFailed:
        """A failure at `node`, named by its index and its worker's address."""
        addr = node.report.addr if node.report is not None else None
        return cls(message, stage=node.index, addr=addr, reason=reason, lost=lost)


class Supervision(Protocol):
    """What keeps a pipeline's nodes, as the pipeline and its holders see it (coordinator.stages.supervisor).

    nodes: the stages, in pipeline order. bus: where their changes are published.
    revives: whether a stage that went down can come back without anyone restarting it by hand (a
        restart, a worker joining in its place): what a forward that lost it may wait for.
    """

    nodes: list[Node]
    bus: EventBus
    revives: bool

    def mark_down(self, node: Node, reason: str) -> None:
        """Record that a node that was up is gone, and why (a forward lost its connection)."""

    async def restart(self, index: int) -> Node:
        """Restart stage `index` now, or raise StageFailed saying why it cannot be."""

    async def wait_up(self, index: int, timeout: float) -> Node:
        """Wait until stage `index` is up; TimeoutError naming it when not within `timeout` seconds."""

    async def close(self) -> None:
        """Let every node go: connections closed, launched workers stopped."""


class Pipeline:
    """Drives forwards through every node in order.

    supervisor: keeps the nodes (`nodes` are its) and is told of a stage whose connection a forward
        lost; closed with the pipeline.
    bus: the supervisor's, where node changes are published, and the runner's events too (one per cluster).
    """

    def __init__(
        self, info: ModelInfo, supervisor: Supervision, forward_timeout: float = FORWARD_TIMEOUT,
        recover_timeout: float = RECOVER_TIMEOUT,
    ) -> None:  # fmt: skip
        if not 0 <= recover_timeout < math.inf:
            raise ValueError(
                f"recover_timeout must be a finite number of seconds >= 0, got {recover_timeout!r}"
            )
        self.info = info
        self.supervisor = supervisor
        self.nodes = supervisor.nodes
        self.bus = supervisor.bus
        self.forward_timeout = forward_timeout
        self.recover_timeout = recover_timeout
        self.log = InputLog()  # what each stage was sent per session, to refill a replaced one
        self._closing = False
        # Forwards run on threads with blocking sockets, off the event loop: a lean hop.
        self._forwarders = ThreadPoolExecutor(FORWARD_THREADS, thread_name_prefix="forward")

    async def forward(self, request: ForwardRequest) -> np.ndarray:
        """Send the request's rows through every stage in order; tell its hook each stage's timing.

        Its halt, asked before each stage on the forward thread, stops the forward by raising (a cancel).
        """
        item = request.item

        def hop(client: WorkerClient, x: np.ndarray) -> tuple[np.ndarray, float]:
            return client.forward_now(item._replace(x=x), timeout=self.forward_timeout)

        def parts(x: np.ndarray) -> list[Part]:
            return [(item.session, item.start_pos, x)]

        return await self._chain(item.x, hop, request.on_stage, request.halt, parts, request.on_recovery)

    async def forward_batch(
        self, items: list[BatchItem], on_stage: StageHook = no_hook, halt: Halt = never_halt,
        on_recovery: RecoveryHook = no_recovery_hook,
    ) -> tuple[list[np.ndarray], list[StageTiming]]:  # fmt: skip
        """Send several sessions' rows through every stage as one forward; return outputs and timings.

        Each stage computes the whole batch at once, so its one compute_ms and
        forward_ms are the batch's; every item shares them. A lost stage is waited for and
        refilled for every session of the batch (see `forward`); `halt` ends that wait.
        """
        timings: list[StageTiming] = []

        def keep(t: StageTiming) -> None:
            timings.append(t)
            on_stage(t)

        def hop(client: WorkerClient, batch: Batch) -> tuple[Batch, float]:
            x, entries = batch
            y, rows, compute_ms = client.forward_batch_now(x, entries, timeout=self.forward_timeout)
            return (
                y,
                [msgspec.structs.replace(e, rows=n) for e, n in zip(entries, rows, strict=True)],
            ), compute_ms

        def parts(batch: Batch) -> list[Part]:
            x, entries = batch
            rows = split_rows(x, [e.rows for e in entries])
            return [(e.session, e.start_pos, r) for e, r in zip(entries, rows, strict=True)]

        y, entries = await self._chain(stack_batch(items), hop, keep, halt, parts, on_recovery)
        return split_rows(y, [e.rows for e in entries]), timings

    async def _chain(
        self,
        x: X,
        hop: Callable[[WorkerClient, X], tuple[X, float]],
        on_stage: StageHook,
        halt: Halt = never_halt,
        parts: Callable[[X], list[Part]] | None = None,
        on_recovery: RecoveryHook = no_recovery_hook,
    ) -> X:
        """Drive `x` through every stage on a forward thread; hooks run on the loop, in stage order.

        The thread does not wait for a stage's hook: before each stage it asks `halt`, and stops
        if that or a hook that already ran raised (a run cancelled), the error then the forward's.
        When a stage is lost under the forward and recovery is on, the forward waits for the stage to
        be back, refills it from the log and goes on from that stage with the input it had.
        """
        if self._closing:
            raise StageFailed("the pipeline is closed")
        recovers = self.recovers and parts is not None
        if not recovers and (why := self.unready()) is not None:
            down = next(n for n in self.nodes if n.state != "up" or n.client is None)
            raise StageFailed.at(down, why, why_down(down))
        keeper = _Keeper(self.log, parts, self.forward_timeout) if recovers and parts is not None else None
        loop = asyncio.get_running_loop()
        nodes, start = list(self.nodes), 0
        waited: dict[tuple[str, int], Recovery] = {}  # the stages this forward waited for, per session
        while True:
            chain = Chain(loop, on_stage, halt, keeper)
            try:
                outcome = await loop.run_in_executor(self._forwarders, chain.run, nodes[start:], x, hop)
            except asyncio.CancelledError:
                chain.stop()
                raise
            chain.settle()
            reached, x = chain.reached
            passed = len(nodes) if isinstance(outcome, Finished) else start + reached
            _tell_recovered(chain.refills, waited, passed, nodes, on_recovery)
            lost = self._outcome(chain, outcome, recovers)
            if lost is None:
                return outcome.output
            node, reason, addr = lost
            assert parts is not None
            start += reached
            await self._wait_back(node, reason, addr, parts(x), halt, on_recovery, waited)

    def _outcome(self, chain: Chain, outcome: Outcome, recovers: bool) -> tuple[Node, str, str] | None:
        """None for a forward that finished; the stage lost, why and its worker's address when it can be
        waited for; else raise.

        The address is read now: a replacement may already hold the node by the time the wait begins.
        """
        # Every stage's hook has run (Chain.settle ran the last): one may have raised.
        match outcome:
            case Finished() if chain.hook_error is None:
                return None
            case Finished() | HookFailed():
                raise chain.hook_error
            case Cancelled(error=Exception() as error):
                raise error
            case Cancelled():  # the caller left: nobody is waiting for this
                raise asyncio.CancelledError()
            case StageDown(node, why):
                if recovers and node.state != "failed":
                    return node, why, node.report.addr if node.report is not None else ""
                raise StageFailed.at(node, f"{node.name} is {why}", why)
            case WorkerFailed(node, client, error):
                lost = client.lost is not None
                if lost:  # the worker may still be computing: its late reply must not be taken for another's
                    client.drop(str(error))
                    self.supervisor.mark_down(node, str(error))
                if chain.hook_error is not None:  # a hook raised as the stage computed: it stopped first
                    raise chain.hook_error
                if lost and recovers and node.state != "failed":
                    return node, str(error), client.report.addr
                why = str(error)
                if lost and node.state == "failed":  # out of restarts before the loss was seen here: say so
                    why = f"{error}; it is {why_down(node)}"
                raise StageFailed.at(node, f"{node.name} failed: {why}", why, lost=lost) from error
        raise AssertionError(f"a forward chain ended in {outcome!r}")

    async def _wait_back(
        self, node: Node, reason: str, addr: str, parts: list[Part], halt: Halt, on_recovery: RecoveryHook,
        waited: dict[tuple[str, int], Recovery],
    ) -> None:  # fmt: skip
        """Wait, at most the recover timeout, for a lost stage to be up again; StageFailed when it is not.

        Its halt is asked all along (a cancel ends the wait); a stage out of restarts ends it too.
        """
        began = time.monotonic()
        recoveries = []
        for session, start, _ in parts:
            recovery = waited[session, node.index] = Recovery(stage=node.index, addr=addr, at_position=start)
            recoveries.append(recovery)
            on_recovery(session, recovery, reason)
        log.warning(
            "%s lost under a forward (%s): waiting up to %gs for it", node.name, reason, self.recover_timeout
        )
        while node.state != "up" or node.client is None:
            waited_s = time.monotonic() - began
            if node.state == "failed" or self._closing:
                why = why_down(node) if not self._closing else "closed: the pipeline is closing"
                raise StageFailed.at(node, f"{node.name} is {why}", why, lost=True)
            if waited_s >= self.recover_timeout:
                why = (
                    f"not back within the recover timeout: waited {waited_s:.1f}s (at most "
                    f"{self.recover_timeout:g}s) for it to be up again after {reason}; it is {why_down(node)}"
                )
                raise StageFailed.at(node, f"{node.name} is {why}", why, lost=True)
            halt()
            await node.changed(RECOVER_POLL_S)
        for recovery in recoveries:
            recovery.waited_ms = (time.monotonic() - began) * 1000

    def unready(self) -> str | None:
        """Why a run cannot go through every stage now (naming the stages), or None when all are up."""
        missing = [f"{node.name} is {node.state}: {node.error or 'not connected'}" for node in self.nodes
                   if node.state != "up" or node.client is None]  # fmt: skip
        return "; ".join(missing) or None

    async def reset(self, session: str) -> None:
        """Drop `session` on every node that is up (best effort)."""
        for node in self.nodes:
            if node.state == "up" and node.client is not None:
                with suppress(WorkerError):
                    await node.client.reset(session, timeout=self.forward_timeout)
        self.log.drop(session)

    @property
    def recovers(self) -> bool:
        """Whether a forward that loses a stage waits for it to be back (some supervisor brings it back)."""
        return self.recover_timeout > 0 and getattr(self.supervisor, "revives", False)

    async def close(self) -> None:
        """Close the supervisor (every connection, every launched worker), the forward threads, the bus."""
        self._closing = True
        await self.supervisor.close()
        self._forwarders.shutdown(wait=False, cancel_futures=True)
        self.bus.close()


class _Keeper:
    """The input log as a forward's chain uses it: its input cut into sessions' parts."""

    def __init__(self, log: InputLog, parts: Callable[[X], list[Part]], timeout: float) -> None:
        self.log, self.parts, self.timeout = log, parts, timeout

    def before(self, node: Node, client: WorkerClient, x: X) -> list[Refill]:
        return self.log.refill(node.index, client, self.parts(x), self.timeout)

    def after(self, node: Node, client: WorkerClient, x: X) -> None:
        self.log.keep(node.index, client, self.parts(x))


def _tell_recovered(
    refills: list[Refill], waited: dict[tuple[str, int], Recovery], passed: int, nodes: list[Node],
    on_recovery: RecoveryHook,
) -> None:  # fmt: skip
    """Tell of each stage refilled on the way, and of each waited for that the forward has passed since.

    A refill nobody waited for is a stage whose worker was replaced between two forwards.
    """
    for r in refills:
        recovery = waited.pop((r.session, r.stage), None) or Recovery(
            stage=r.stage, addr=r.addr, at_position=r.positions
        )
        recovery.new_addr, recovery.replayed_positions, recovery.replay_ms = r.new_addr, r.positions, r.ms
        on_recovery(r.session, recovery, None)
    for (session, stage), recovery in list(waited.items()):
        if stage < passed:  # back, and nothing to refill (the forward was the session's first)
            report = nodes[stage].report
            recovery.new_addr = report.addr if report is not None else ""
            del waited[session, stage]
            on_recovery(session, recovery, None)
