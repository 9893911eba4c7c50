"""The live pipeline: one node per stage, forwards driven through them in order.

In local mode a node whose worker dies is restarted with the same layers
(bounded retries with backoff) while the other stages keep running.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Literal

import numpy as np

from coordinator.client import WorkerClient, WorkerError
from coordinator.launcher import Launcher, LaunchError, WorkerProcess
from coordinator.stats import StageTiming
from workers.report import LayerRange, NodeReport
from workers.stage import ModelInfo

log = logging.getLogger("coordinator.pipeline")

FORWARD_TIMEOUT = 60.0
MAX_RESTARTS = 3
RESTART_BACKOFF_S = (0.5, 1.0, 2.0)
NodeState = Literal["up", "down", "restarting"]


class StageFailed(Exception):
    """A forward that failed at one stage; the message names the stage and address."""


@dataclass
class Node:
    """One stage of the live pipeline and its state.

    state: "up", "down" or "restarting".
    restarts: restarts made by the coordinator so far.
    error: why the node last went down.
    """

    index: int
    layers: LayerRange
    report: NodeReport
    client: WorkerClient | None = None
    process: WorkerProcess | None = None
    state: NodeState = "up"
    restarts: int = 0
    error: str | None = None

    @property
    def name(self) -> str:
        return f"stage {self.index} ({self.report.addr}, layers {self.layers})"


class Pipeline:
    """Drives forwards through every node in order and keeps the nodes alive."""

    def __init__(
        self,
        info: ModelInfo,
        nodes: list[Node],
        token: str,
        launcher: Launcher | None = None,
        forward_timeout: float = FORWARD_TIMEOUT,
    ) -> None:
        self.info = info
        self.nodes = nodes
        self.token = token
        self.launcher = launcher
        self.forward_timeout = forward_timeout
        self._watchers: dict[int, asyncio.Task] = {}
        self._restarts: dict[int, asyncio.Task] = {}
        self._closing = False
        for node in nodes:
            self._watch(node)

    @classmethod
    async def launch(
        cls,
        launcher: Launcher,
        info: ModelInfo,
        ranges: list[LayerRange],
        forward_timeout: float = FORWARD_TIMEOUT,
        progress: Callable[[str], None] | None = None,
    ) -> Pipeline:
        """Start local workers for `ranges` and connect to each; all or nothing."""
        workers = await launcher.start_all(ranges, progress)
        nodes: list[Node] = []
        try:
            for w in workers:
                assert w.report is not None
                client = await WorkerClient.connect(w.report.addr, launcher.token)
                nodes.append(Node(w.index, w.layers, w.report, client, w))
        except BaseException:
            for node in nodes:
                await node.client.close()
            await launcher.stop_all()
            raise
        return cls(info, nodes, launcher.token, launcher, forward_timeout)

    @classmethod
    async def attach(
        cls, info: ModelInfo, addrs: list[str], token: str, forward_timeout: float = FORWARD_TIMEOUT
    ) -> Pipeline:
        """Connect to workers already running elsewhere, in pipeline order."""
        nodes: list[Node] = []
        try:
            for i, addr in enumerate(addrs):
                client = await WorkerClient.connect(addr, token)
                nodes.append(Node(i, client.report.layers, client.report, client))
            _check_contiguous(nodes, info.n_layers)
        except BaseException:
            for node in nodes:
                await node.client.close()
            raise
        return cls(info, nodes, token, None, forward_timeout)

    async def forward(
        self,
        x: np.ndarray,
        *,
        session: str,
        start_pos: int,
        last_only: bool = False,
        on_stage: Callable[[StageTiming], None] = lambda t: None,
    ) -> np.ndarray:
        """Send `x` through every stage in order; report each stage's timing as it finishes."""
        for node in self.nodes:
            if node.state != "up" or node.client is None:
                raise StageFailed(f"{node.name} is {node.state}: {node.error or 'not connected'}")
            started = time.monotonic()
            try:
                x, compute_ms = await node.client.forward(
                    x, session=session, start_pos=start_pos, last_only=last_only, timeout=self.forward_timeout
                )
            except WorkerError as exc:
                if node.client.lost is not None:
                    self.mark_down(node, str(exc))
                raise StageFailed(f"{node.name} failed: {exc}") from exc
            on_stage(
                StageTiming(
                    addr=node.report.addr,
                    layers=node.layers,
                    device=node.report.device,
                    build_ms=node.report.build_ms,
                    forward_ms=(time.monotonic() - started) * 1000,
                    resident_bytes=node.report.resident_bytes,
                    compute_ms=compute_ms,
                    stage=node.index,
                    precision=node.report.precision,
                )
            )
        return x

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

    def mark_down(self, node: Node, reason: str) -> None:
        """Record that a node is gone; in local mode schedule its restart."""
        if node.state != "up" or self._closing:
            return
        node.state = "down"
        node.error = reason
        log.error("%s is down: %s", node.name, reason)
        if self.launcher is not None and node.restarts < MAX_RESTARTS:
            self._restarts[node.index] = asyncio.create_task(self._restart_with_backoff(node))

    async def restart(self, index: int) -> Node:
        """Restart one local node with the same layers; the others keep running."""
        if self.launcher is None:
            raise StageFailed("workers were attached, not launched: restart them where they run")
        node = self.nodes[index]
        if (pending := self._restarts.pop(index, None)) is not None:
            pending.cancel()
            with suppress(asyncio.CancelledError):
                await pending
        node.state = "restarting"
        await self._replace(node)
        return node

    async def _restart_with_backoff(self, node: Node) -> None:
        while node.restarts < MAX_RESTARTS and not self._closing:
            await asyncio.sleep(RESTART_BACKOFF_S[min(node.restarts, len(RESTART_BACKOFF_S) - 1)])
            node.state = "restarting"
            try:
                await self._replace(node)
                return
            except (LaunchError, WorkerError) as exc:
                node.state = "down"
                node.error = f"restart {node.restarts} failed: {exc}"
                log.error("%s: %s", node.name, node.error)
        log.error("%s stays down after %d restarts", node.name, node.restarts)

    async def _replace(self, node: Node) -> None:
        assert self.launcher is not None
        node.restarts += 1
        log.warning("restarting %s (restart %d)", node.name, node.restarts)
        if (watcher := self._watchers.pop(node.index, None)) is not None:
            watcher.cancel()
        if node.client is not None:
            await node.client.close()
            node.client = None
        if node.process is not None:
            await self.launcher.stop(node.process)
        try:
            process = await self.launcher.start(node.index, node.layers)
            assert process.report is not None
            client = await WorkerClient.connect(process.report.addr, self.token)
        except BaseException as exc:
            node.state = "down"
            node.error = str(exc)
            raise
        node.process, node.client, node.report = process, client, process.report
        node.state, node.error = "up", None
        self._watch(node)
        log.warning("%s is up again", node.name)

    def _watch(self, node: Node) -> None:
        if node.process is not None:
            self._watchers[node.index] = asyncio.create_task(self._watch_process(node, node.process))

    async def _watch_process(self, node: Node, process: WorkerProcess) -> None:
        status = await process.proc.wait()
        if node.process is process:
            self.mark_down(node, f"worker process {process.proc.pid} exited with status {status}")

    async def close(self) -> None:
        """Close every connection and stop every local worker."""
        self._closing = True
        for task in [*self._watchers.values(), *self._restarts.values()]:
            task.cancel()
        await asyncio.gather(*self._watchers.values(), *self._restarts.values(), return_exceptions=True)
        for node in self.nodes:
            if node.client is not None:
                await node.client.close()
        if self.launcher is not None:
            await self.launcher.stop_all()


def _check_contiguous(nodes: list[Node], n_layers: int) -> None:
    """Attached stages must cover 0..n_layers in order, without gaps or overlaps."""
    expected = 0
    for node in nodes:
        if node.layers.start != expected:
            raise StageFailed(f"{node.name} does not follow layer {expected}: the stages must be contiguous")
        expected = node.layers.end
    if expected != n_layers:
        raise StageFailed(f"the stages end at layer {expected}, the model has {n_layers}")
