"""The live pipeline: one node per stage, forwards driven through them in order.

With launched workers (local processes or Ray actors) a node whose worker dies
is restarted with the same layers while the other stages keep running: at
most RESTART_BUDGET automatic restarts in any RESTART_WINDOW_S seconds (a
sliding window, so a stage that stays up is forgiven), after which the node
is `failed` until someone restarts it by hand. One restart at a time per
stage: concurrent manual restarts share one, and a manual restart replaces an
automatic one in progress.

With workers that join (coordinator.stages.join) the stages start `vacant` and the
join listener fills them (`fill`) as workers build them (`building`); a node
that goes down is its to fill again, told through `on_down`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from typing import TypeVar

import msgspec
import numpy as np

from coordinator.events import EventBus, NodeChanged
from coordinator.launch.base import LaunchError, Worker, WorkerLauncher
from coordinator.stages.chain import (
    Cancelled,
    Chain,
    Finished,
    ForwardRequest,
    Halt,
    HookFailed,
    StageDown,
    StageHook,
    WorkerFailed,
    never_halt,
    no_hook,
    why_down,
)
from coordinator.stages.client import WorkerClient, WorkerError, split_rows, stack_batch
from coordinator.stages.node import Node, NodeState, RestartPolicy
from coordinator.stats import StageTiming
from workers.protocol.info import BatchItem, ModelInfo
from workers.protocol.report import LayerRange
from workers.protocol.wire import BatchEntry

log = logging.getLogger("coordinator.stages.pipeline")

FORWARD_TIMEOUT = 60.0
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


class Pipeline:
    """Drives forwards through every node in order and keeps the nodes alive.

    restart: when a dead local stage is restarted automatically.
    bus: where every node's state changes are published, and the runner's events too (one per cluster).
    """

    def __init__(
        self,
        info: ModelInfo,
        nodes: list[Node],
        token: str,
        launcher: WorkerLauncher | None = None,
        forward_timeout: float = FORWARD_TIMEOUT,
        restart: RestartPolicy = RestartPolicy(),
        bus: EventBus | None = None,
    ) -> None:
        self.info = info
        self.bus = bus if bus is not None else EventBus()
        self.nodes = nodes
        self.token = token
        self.launcher = launcher
        self.forward_timeout = forward_timeout
        self._watchers: dict[int, asyncio.Task] = {}
        self._auto: dict[int, asyncio.Task] = {}
        self._manual: dict[int, asyncio.Task] = {}
        self._closing = False
        # Forwards run on threads with blocking sockets, off the event loop (issue 12: a lean hop).
        self._forwarders = ThreadPoolExecutor(FORWARD_THREADS, thread_name_prefix="forward")
        # Told of a node that went down, when something other than a launcher brings it back.
        self.on_down: Callable[[Node], None] | None = None
        for node in nodes:
            node.policy = restart
            node.on_state = self._state_changed
            self._announce(node, node.state)
            self._watch(node)

    @classmethod
    async def launch(
        cls,
        launcher: WorkerLauncher,
        info: ModelInfo,
        ranges: list[LayerRange],
        forward_timeout: float = FORWARD_TIMEOUT,
        progress: Callable[[str], None] | None = None,
        restart: RestartPolicy = RestartPolicy(),
    ) -> Pipeline:
        """Start workers for `ranges` wherever the launcher puts them, and connect to each; all or nothing."""
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
        return cls(info, nodes, launcher.token, launcher, forward_timeout, restart)

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

    async def forward(self, request: ForwardRequest) -> np.ndarray:
        """Send the request's rows through every stage in order; tell its hook each stage's timing.

        Its halt, asked before each stage on the forward thread, stops the forward by raising (a cancel).
        """
        item = request.item

        def hop(client: WorkerClient, x: np.ndarray) -> tuple[np.ndarray, float]:
            return client.forward_now(item._replace(x=x), timeout=self.forward_timeout)

        return await self._chain(item.x, hop, request.on_stage, request.halt)

    async def forward_batch(
        self, items: list[BatchItem], on_stage: StageHook = no_hook
    ) -> tuple[list[np.ndarray], list[StageTiming]]:
        """Send several sessions' rows through every stage as one forward; return outputs and timings.

        Each stage computes the whole batch at once, so its one compute_ms and
        forward_ms are the batch's; every item shares them.
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

        y, entries = await self._chain(stack_batch(items), hop, keep)
        return split_rows(y, [e.rows for e in entries]), timings

    async def _chain(
        self,
        x: X,
        hop: Callable[[WorkerClient, X], tuple[X, float]],
        on_stage: StageHook,
        halt: Halt = never_halt,
    ) -> X:
        """Drive `x` through every stage on a forward thread; hooks run on the loop, in stage order.

        The thread does not wait for a stage's hook: before each stage it asks `halt`, and stops
        if that or a hook that already ran raised (a run cancelled), the error then the forward's.
        """
        if (why := self.unready()) is not None:
            down = next(n for n in self.nodes if n.state != "up" or n.client is None)
            raise StageFailed.at(down, why, why_down(down))
        if self._closing:
            raise StageFailed("the pipeline is closed")
        loop = asyncio.get_running_loop()
        chain = Chain(loop, on_stage, halt)
        try:
            outcome = await loop.run_in_executor(self._forwarders, chain.run, list(self.nodes), x, hop)
        except asyncio.CancelledError:
            chain.stop()
            raise
        # The last stage's hook ran before the outcome came back (one queue, in order): it may have raised.
        match outcome:
            case Finished(output) if chain.hook_error is None:
                return output
            case Finished() | HookFailed():
                raise chain.hook_error
            case Cancelled(error=Exception() as error):
                raise error
            case Cancelled():  # the caller left: nobody is waiting for this
                raise asyncio.CancelledError()
            case StageDown(node, why):
                raise StageFailed.at(node, f"{node.name} is {why}", why)
            case WorkerFailed(node, client, error):
                lost = client.lost is not None
                if lost:  # the worker may still be computing: its late reply must not be taken for another's
                    client.drop(str(error))
                    self.mark_down(node, str(error))
                if chain.hook_error is not None:  # a hook raised as the stage computed: it stopped first
                    raise chain.hook_error
                raise StageFailed.at(node, f"{node.name} failed: {error}", str(error), lost=lost) from error
        raise AssertionError(f"a forward chain ended in {outcome!r}")

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
        if self.launcher is not None:
            self._track(self._auto, node.index, self._restart_with_backoff(node))
        if self.on_down is not None:
            self.on_down(node)

    async def fill(self, node: Node, client: WorkerClient) -> None:
        """Put a worker that joined into a node that lacks one."""
        old, node.client = node.client, client
        node.report, node.state, node.error = client.report, "up", None
        if old is not None:
            await old.close()
        log.warning("%s is up", node.name)

    async def vacate(self, node: Node, reason: str) -> None:
        """Mark a node down and close its connection: its worker has left."""
        self.mark_down(node, reason)
        if node.client is not None:
            await node.client.close(reason)

    async def restart(self, index: int) -> Node:
        """Restart one local node now, outside the automatic budget; concurrent calls share one restart.

        A second request while one is under way gets that restart's outcome
        (the node, or the same exception) instead of starting another worker.
        """
        if self.launcher is None:
            raise StageFailed("workers were attached, not launched: restart them where they run")
        node = self.nodes[index]
        task = self._manual.get(index) or self._track(self._manual, index, self._restart_now(node))
        await asyncio.shield(task)
        return node

    def _track(self, tasks: dict[int, asyncio.Task], index: int, work: Coroutine) -> asyncio.Task:
        """Run `work` as the stage's restart of this kind, forgotten once it is done."""
        task = tasks[index] = asyncio.create_task(work)
        task.add_done_callback(lambda done: tasks.pop(index) if tasks.get(index) is done else None)
        return task

    async def _restart_now(self, node: Node) -> None:
        # An automatic restart under way yields: two restarts of one stage would race for its worker.
        if (auto := self._auto.get(node.index)) is not None:
            auto.cancel()
            with suppress(asyncio.CancelledError):
                await auto
        # Someone looked at the stage: its automatic budget starts afresh.
        node.restart_times.clear()
        node.state = "restarting"
        await self._replace(node)

    async def _restart_with_backoff(self, node: Node) -> None:
        """Restart a dead node while its budget lasts; past it the node is failed until restarted by hand."""
        while (used := node.restarts_in_window) < node.policy.budget:
            await asyncio.sleep(node.policy.backoff(used))
            node.restart_times.append(time.monotonic())
            node.state = "restarting"
            try:
                await self._replace(node)
                return
            except (LaunchError, WorkerError, OSError) as exc:
                node.state = "down"
                node.error = f"restart {node.restarts} failed: {exc}"
                log.error("%s: %s", node.name, node.error)
        node.state = "failed"
        policy = node.policy
        node.error = (
            f"out of automatic restarts ({policy.budget} allowed in {policy.window_s:g} s); "
            f"last error: {node.error}; POST /nodes/{node.index}/restart or restart the coordinator"
        )
        log.error("%s is failed: %s", node.name, node.error)

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
        process = None
        try:
            process = await self.launcher.start(node.index, node.layers)
            assert process.report is not None
            client = await WorkerClient.connect(process.report.addr, self.token)
        except BaseException as exc:
            # Cancelled or failed after the worker started: stop it, or it would run untracked.
            if process is not None:
                await self.launcher.stop(process)
            node.state = "down"
            node.error = str(exc) or f"restart interrupted ({type(exc).__name__})"
            raise
        node.process, node.client, node.report = process, client, process.report
        node.state, node.error = "up", None
        self._watch(node)
        log.warning("%s is up again", node.name)

    def _state_changed(self, node: Node) -> None:
        # Published once the change is complete: a state is often set just before its error.
        asyncio.get_running_loop().call_soon(self._announce, node, node.state)

    def _announce(self, node: Node, state: NodeState) -> None:
        addr = node.report.addr if node.report is not None else ""
        self.bus.publish(NodeChanged(stage=node.index, addr=addr, state=state, error=node.error))

    def _watch(self, node: Node) -> None:
        if node.process is not None:
            self._watchers[node.index] = asyncio.create_task(self._watch_process(node, node.process))

    async def _watch_process(self, node: Node, process: Worker) -> None:
        how = await process.ended()
        if node.process is process:
            self.mark_down(node, how)

    async def close(self) -> None:
        """Close every connection, stop every local worker, and end every subscription to the bus."""
        self._closing = True
        tasks = [*self._watchers.values(), *self._auto.values(), *self._manual.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for node in self.nodes:
            if node.client is not None:
                await node.client.close()
        if self.launcher is not None:
            await self.launcher.stop_all()
        self._forwarders.shutdown(wait=False, cancel_futures=True)
        self.bus.close()


def _check_contiguous(nodes: list[Node], n_layers: int) -> None:
    """Attached stages must cover 0..n_layers in order, without gaps or overlaps."""
    expected = 0
    for node in nodes:
        if node.layers.start != expected:
            raise StageFailed(f"{node.name} does not follow layer {expected}: the stages must be contiguous")
        expected = node.layers.end
    if expected != n_layers:
        raise StageFailed(f"the stages end at layer {expected}, the model has {n_layers}")
