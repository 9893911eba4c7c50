"""Supervisors: who keeps each stage's worker alive, one kind per way workers come to exist.

The pipeline only forwards; a supervisor owns the nodes' lifecycles and is
the one the pipeline tells when a forward finds a stage's connection lost.
"A stage went down" → "its supervisor brought it back" (`wait_up`) → "the
forwards resume" is the seam between them.

- Attached workers (`Supervisor`): started elsewhere, so a node that goes down
  is only marked down; whoever runs the worker brings it back.
- Launched workers (`LaunchedSupervisor`, local processes or Ray actors through
  a `WorkerLauncher`): a node whose worker dies is restarted with the same
  layers while the other stages keep running: at most RESTART_BUDGET automatic
  restarts in any RESTART_WINDOW_S seconds (a sliding window, so a stage that
  stays up is forgiven), after which the node is `failed` until someone
  restarts it by hand. One restart at a time per stage: concurrent manual
  restarts share one, and a manual restart replaces an automatic one in progress.
- Joined workers (`JoinedSupervisor`, see coordinator.stages.join): the stages
  start `vacant`; the join listener fills them as workers build them and
  vacates them as they leave, and is told (its `Vacancies.stage_down`) of a
  node that went down, which is its to fill again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from contextlib import suppress
from typing import Protocol

from coordinator.events import EventBus, NodeChanged, Subscription
from coordinator.launch.base import LaunchError, Worker, WorkerLauncher
from coordinator.stages.client import WorkerClient, WorkerError
from coordinator.stages.node import Node, RestartPolicy
from coordinator.stages.pipeline import FORWARD_TIMEOUT, RECOVER_TIMEOUT, Pipeline, StageFailed
from workers.protocol.info import ModelInfo
from workers.protocol.report import LayerRange, check_stages

log = logging.getLogger("coordinator.stages.supervisor")


class Supervisor:
    """Keeps the nodes of attached workers: marks a node down, and says when one is up again.

    nodes: the stages, in pipeline order; each one's changes are published on `bus` from now on.
    token: the token the workers accept.
    bus: where node changes are published (a new one when None; one per cluster).
    """

    # Why this kind cannot restart a node: its workers run where the coordinator does not start them.
    cannot_restart = "workers were attached, not launched: restart them where they run"
    # A node that went down stays down: nothing reconnects to an attached worker.
    revives = False

    def __init__(self, nodes: list[Node], token: str, bus: EventBus | None = None) -> None:
        self.nodes = nodes
        self.token = token
        self.bus = bus if bus is not None else EventBus()
        self._closing = False
        self._waiting: set[Subscription] = set()  # the changes each wait_up follows, ended by close
        for node in nodes:
            node.publish_to(self.bus)

    def mark_down(self, node: Node, reason: str) -> None:
        """Record that a node that was up is gone, and why; then let this kind of supervisor act on it."""
        if node.state != "up" or self._closing:
            return
        node.set("down", reason)
        log.error("%s is down: %s", node.name, reason)
        self._went_down(node)

    def _went_down(self, node: Node) -> None:
        """What this kind does once a node is down: for attached workers, nothing more."""

    async def restart(self, index: int) -> Node:
        """Restart one node now; attached workers cannot be (StageFailed says where to do it)."""
        raise StageFailed(self.cannot_restart)

    async def wait_up(self, index: int, timeout: float) -> Node:
        """Wait until stage `index` is up (at once if it is) and return it.

        Raises TimeoutError naming the stage, its state and why when it is not up within
        `timeout` seconds, and StageFailed when the supervisor closes first.
        """
        node = self.node(index)
        if not timeout >= 0:
            raise ValueError(f"wait_up timeout must be a number of seconds >= 0, got {timeout!r}")
        changes = self.bus.subscribe(accept=lambda e: isinstance(e, NodeChanged) and e.stage == index)
        self._waiting.add(changes)
        try:
            async with asyncio.timeout(timeout):
                while node.state != "up" or node.client is None:
                    # Each change of the node is an event; a Lagged one (missed events) looks again too.
                    if self._closing or await changes.get() is None:
                        raise StageFailed(f"{node.name} will not come back: its supervisor is closed")
        except TimeoutError:
            why = f"{node.state}: {node.error or 'not connected'}"
            raise TimeoutError(f"{node.name} is not up after {timeout:g}s; it is {why}") from None
        finally:
            self._waiting.discard(changes)
            changes.close()
        return node

    def node(self, index: int) -> Node:
        """Stage `index`; a ValueError naming the stages there are when there is none."""
        if not 0 <= index < len(self.nodes):
            raise ValueError(f"no stage {index}: the stages are 0..{len(self.nodes) - 1}")
        return self.nodes[index]

    async def close(self) -> None:
        """End every wait_up, close every node's connection; a node that goes down now is not acted on."""
        self._closing = True
        for changes in list(self._waiting):
            changes.close()
        for node in self.nodes:
            if node.client is not None:
                await node.client.close()


class LaunchedSupervisor(Supervisor):
    """Keeps launched workers alive: watches each, restarts a dead one within its budget, or by hand.

    launcher: what started the workers, and starts their replacements (its token is theirs).
    restart: when a dead stage is restarted automatically.
    """

    revives = True

    def __init__(
        self,
        nodes: list[Node],
        launcher: WorkerLauncher,
        restart: RestartPolicy = RestartPolicy(),
        bus: EventBus | None = None,
    ) -> None:
        super().__init__(nodes, launcher.token, bus)
        self.launcher = launcher
        self._watchers: dict[int, asyncio.Task] = {}
        self._auto: dict[int, asyncio.Task] = {}
        self._manual: dict[int, asyncio.Task] = {}
        for node in nodes:
            node.policy = restart
            self._watch(node)

    def _went_down(self, node: Node) -> None:
        self._track(self._auto, node.index, self._restart_with_backoff(node))

    async def restart(self, index: int) -> Node:
        """Restart one node now, outside the automatic budget; concurrent calls share one restart.

        A second request while one is under way gets that restart's outcome
        (the node, or the same exception) instead of starting another worker.
        """
        node = self.node(index)
        if self._closing:
            raise StageFailed(f"{node.name} is not restarted: the supervisor is closed")
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
        node.set("restarting", node.error)
        try:
            await self._replace(node)
        except BaseException as exc:
            node.set("down", str(exc) or _interrupted(exc))
            raise

    async def _restart_with_backoff(self, node: Node) -> None:
        """Restart a dead node while its budget lasts; past it the node is failed until restarted by hand."""
        while (used := node.restarts_in_window) < node.policy.budget:
            await asyncio.sleep(node.policy.backoff(used))
            node.restart_times.append(time.monotonic())
            node.set("restarting", node.error)
            try:
                await self._replace(node)
                return
            except (LaunchError, WorkerError, OSError) as exc:
                node.set("down", f"restart {node.restarts} failed: {exc}")
                log.error("%s: %s", node.name, node.error)
            except BaseException as exc:
                node.set("down", str(exc) or _interrupted(exc))
                raise
        policy = node.policy
        node.set("failed", (
            f"out of automatic restarts ({policy.budget} allowed in {policy.window_s:g} s); "
            f"last error: {node.error}; POST /nodes/{node.index}/restart or restart the coordinator"
        ))  # fmt: skip
        log.error("%s is failed: %s", node.name, node.error)

    async def _replace(self, node: Node) -> None:
        """Stop the node's worker and start another for its layers; on failure stop what started and raise."""
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
        except BaseException:
            # Cancelled or failed after the worker started: stop it, or it would run untracked.
            if process is not None:
                await self.launcher.stop(process)
            raise
        node.process, node.client, node.report = process, client, process.report
        node.set("up")
        self._watch(node)
        log.warning("%s is up again", node.name)

    def _watch(self, node: Node) -> None:
        if node.process is not None:
            self._watchers[node.index] = asyncio.create_task(self._watch_process(node, node.process))

    async def _watch_process(self, node: Node, process: Worker) -> None:
        how = await process.ended()
        if node.process is process:
            self.mark_down(node, how)

    async def close(self) -> None:
        """Stop watching and restarting, close every connection, and stop every launched worker."""
        self._closing = True
        tasks = [*self._watchers.values(), *self._auto.values(), *self._manual.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await super().close()
        await self.launcher.stop_all()


class Vacancies(Protocol):
    """The join side, as a joined supervisor sees it: what fills the stages that lack a worker."""

    def stage_down(self, node: Node) -> None:
        """`node` went down while its worker held it: let that worker go, and fill the stage afresh."""


class JoinedSupervisor(Supervisor):
    """Keeps the nodes of workers that join: filled and vacated by the join side, which it tells of a loss.

    vacancies: the join side, told of each node that goes down.
    """

    cannot_restart = "workers joined, not launched: restart the worker where it runs and it joins again"
    revives = True  # a spare, or the next worker to join, takes a vacant stage

    def __init__(
        self, nodes: list[Node], token: str, vacancies: Vacancies, bus: EventBus | None = None
    ) -> None:
        super().__init__(nodes, token, bus)
        self.vacancies = vacancies

    def _went_down(self, node: Node) -> None:
        self.vacancies.stage_down(node)

    async def fill(self, node: Node, client: WorkerClient) -> None:
        """Put a worker that joined and built its layers into a node that lacks one."""
        old, node.client, node.report = node.client, client, client.report
        node.set("up")
        if old is not None:
            await old.close()
        log.warning("%s is up", node.name)

    async def vacate(self, node: Node, reason: str) -> None:
        """The node's worker has left: the node is down for `reason`, its connection closed."""
        if node.state != "up":
            node.set("down", reason)  # it was still building
            return
        self.mark_down(node, reason)
        if node.client is not None:
            await node.client.close(reason)


def _interrupted(exc: BaseException) -> str:
    return f"restart interrupted ({type(exc).__name__})"


async def launch_pipeline(
    launcher: WorkerLauncher,
    info: ModelInfo,
    ranges: list[LayerRange],
    forward_timeout: float = FORWARD_TIMEOUT,
    progress: Callable[[str], None] | None = None,
    restart: RestartPolicy = RestartPolicy(),
    bus: EventBus | None = None,
    recover_timeout: float = RECOVER_TIMEOUT,
) -> Pipeline:
    """Start workers for `ranges` wherever the launcher puts them and connect to each; all or nothing.

    The pipeline forwards through them; its `supervisor` (a LaunchedSupervisor) keeps them alive, and
    a forward that loses one waits up to `recover_timeout` seconds for it to be back.
    """
    try:
        check_stages(ranges, info.n_layers, info.vocab)  # before any worker starts
    except ValueError as exc:
        raise StageFailed(str(exc)) from None
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
    supervisor = LaunchedSupervisor(nodes, launcher, restart, bus)
    return Pipeline(info, supervisor, forward_timeout, recover_timeout)


async def attach_pipeline(
    info: ModelInfo,
    addrs: list[str],
    token: str,
    forward_timeout: float = FORWARD_TIMEOUT,
    bus: EventBus | None = None,
) -> Pipeline:
    """Connect to workers already running elsewhere, in pipeline order; its supervisor only marks down."""
    nodes: list[Node] = []
    try:
        for i, addr in enumerate(addrs):
            client = await WorkerClient.connect(addr, token)
            nodes.append(Node(i, client.report.layers, client.report, client))
        _check_contiguous(nodes, info)
    except BaseException:
        for node in nodes:
            await node.client.close()
        raise
    return Pipeline(info, Supervisor(nodes, token, bus), forward_timeout)


def _check_contiguous(nodes: list[Node], info: ModelInfo) -> None:
    """Attached stages must cover 0..n_layers in order, without gaps or overlaps (a cut head's rows too)."""
    try:
        check_stages([node.layers for node in nodes], info.n_layers, info.vocab)
    except ValueError as exc:
        raise StageFailed(str(exc)) from None
