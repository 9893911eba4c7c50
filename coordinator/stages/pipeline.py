"""The live pipeline: one node per stage, forwards driven through them in order.

The pipeline only forwards. Its nodes' lifecycles (watching workers, restarts,
workers that join or leave) are its supervisor's (coordinator.stages.supervisor),
which it tells when a forward finds a stage's connection lost; the supervisor
module also builds pipelines of launched or attached workers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from typing import Protocol, TypeVar

import msgspec
import numpy as np

from coordinator.events import EventBus
from coordinator.stages.chain import Chain, Halt, Halted, StageHook
from coordinator.stages.client import WorkerClient, WorkerError, split_rows, stack_batch
from coordinator.stages.node import Node
from coordinator.stats import StageTiming
from workers.protocol.info import BatchItem, ModelInfo
from workers.protocol.wire import BatchEntry

log = logging.getLogger("coordinator.stages.pipeline")

FORWARD_TIMEOUT = 60.0
# Forwards that may be under way at once (each on its thread); different stages serve different ones.
FORWARD_THREADS = 8
X = TypeVar("X")
Batch = tuple[np.ndarray, list[BatchEntry]]


class StageFailed(Exception):
    """A forward that failed at one stage; the message names the stage and address."""


class Supervision(Protocol):
    """What keeps a pipeline's nodes, as the pipeline and its holders see it (coordinator.stages.supervisor).

    nodes: the stages, in pipeline order. bus: where their changes are published.
    """

    nodes: list[Node]
    bus: EventBus

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
        self, info: ModelInfo, supervisor: Supervision, forward_timeout: float = FORWARD_TIMEOUT
    ) -> None:
        self.info = info
        self.supervisor = supervisor
        self.nodes = supervisor.nodes
        self.bus = supervisor.bus
        self.forward_timeout = forward_timeout
        self._closing = False
        # Forwards run on threads with blocking sockets, off the event loop: a lean hop.
        self._forwarders = ThreadPoolExecutor(FORWARD_THREADS, thread_name_prefix="forward")

    async def forward(
        self,
        x: np.ndarray,
        *,
        session: str,
        start_pos: int,
        last_only: bool = False,
        on_stage: Callable[[StageTiming], None] | None = None,
        halt: Halt = None,
    ) -> np.ndarray:
        """Send `x` through every stage in order; report each stage's timing as it finishes.

        halt, called before each stage on the forward thread, stops the forward by raising (a cancel).
        """

        def hop(client: WorkerClient, x: np.ndarray) -> tuple[np.ndarray, float]:
            return client.forward_now(
                x, session=session, start_pos=start_pos, last_only=last_only, timeout=self.forward_timeout
            )

        return await self._chain(x, hop, on_stage, halt)

    async def forward_batch(
        self, items: list[BatchItem], on_stage: Callable[[StageTiming], None] | None = None
    ) -> tuple[list[np.ndarray], list[StageTiming]]:
        """Send several sessions' rows through every stage as one forward; return outputs and timings.

        Each stage computes the whole batch at once, so its one compute_ms and
        forward_ms are the batch's; every item shares them.
        """
        timings: list[StageTiming] = []

        def keep(t: StageTiming) -> None:
            timings.append(t)
            if on_stage is not None:
                on_stage(t)

        def hop(client: WorkerClient, batch: Batch) -> tuple[Batch, float]:
            x, entries = batch
            y, rows, compute_ms = client.forward_batch_now(x, entries, timeout=self.forward_timeout)
            return (
                y,
                [msgspec.structs.replace(e, rows=n) for e, n in zip(entries, rows, strict=True)],
            ), compute_ms

        y, entries = await self._chain(stack_batch(items), hop, keep)
        return split_rows(y, [e.rows for e in entries]), timings

    async def _chain(
        self, x: X, hop: Callable[[WorkerClient, X], tuple[X, float]], on_stage: StageHook, halt: Halt = None
    ) -> X:
        """Drive `x` through every stage on a forward thread; hooks run on the loop, in stage order.

        The thread does not wait for a stage's hook: before each stage it asks `halt`, and stops
        if that or a hook that already ran raised (a run cancelled), the error then the forward's.
        """
        if (why := self.unready()) is not None:
            raise StageFailed(why)
        if self._closing:
            raise StageFailed("the pipeline is closed")
        chain = Chain(asyncio.get_running_loop(), on_stage, halt)
        try:
            out = await asyncio.get_running_loop().run_in_executor(
                self._forwarders, chain.run, list(self.nodes), x, hop
            )
        except Halted as halted:
            if chain.hook_error is not None:
                raise chain.hook_error from None
            node, client, why = halted.args
            if client is None:  # the node was down, or the forward cancelled, before its turn
                raise StageFailed(why) from None
            if client.lost is not None:
                client.drop(str(why))
                self.supervisor.mark_down(node, str(why))
            raise StageFailed(f"{node.name} failed: {why}") from why
        except asyncio.CancelledError:
            chain.stop()
            raise
        # The last stage's hook ran before the result came back (one queue, in order); it may have raised.
        if chain.hook_error is not None:
            raise chain.hook_error
        return out

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

    async def close(self) -> None:
        """Close the supervisor (every connection, every launched worker), the forward threads, the bus."""
        self._closing = True
        await self.supervisor.close()
        self._forwarders.shutdown(wait=False, cancel_futures=True)
        self.bus.close()
