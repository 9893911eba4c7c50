"""One forward's walk through the stages: each stage's request awaited on the loop, or sent from a
forward thread over the worker's blocking link.

On the loop (`run_on_loop`), a stage's reply wakes the loop itself, which
sends the next stage's request at once: one wake per hop. A forward thread's
walk (`run`) pays two more, one to start the thread and one to wake the loop
with its outcome (each 0.07-0.12 ms on this 2-core VM); the loop hands the
rest of a walk to a thread only from a stage whose link a thread holds (a
reset) or whose worker must first be refilled (a replay, which would hold
every other run up). Either way no stage's timing hook is waited for: a hook
is queued on the loop and runs once the next stage is sent, in stage order.
Before each stage the walk asks the forward's `halt` (a run's cancel, read
without the loop on a thread), so a cancel stops the forward at the stage
boundary it reaches first; a hook that raised stops it too. `forward_ms` is
taken around the link's request alone; what the hand-offs cost shows as the
forward's wall time beyond its stages' sum. The last stage's hook is left
to the caller (`settle`), which runs it on the loop as the walk comes back:
handed over from a thread, it woke the loop while the thread still had its
outcome to return, and the two threads took the GIL from each other (0.19 ms
from a reply to the thread's end, against 0.05 ms).

The walk ends in one typed outcome: Finished, or why it stopped (Cancelled,
StageDown, WorkerFailed, HookFailed); the pipeline matches on it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from coordinator.stages.client import WorkerClient, WorkerError
from coordinator.stages.replay import RecoveryHook, no_recovery_hook
from coordinator.stats import StageTiming
from workers.protocol.info import BatchItem

if TYPE_CHECKING:
    from coordinator.stages.node import Node

X = TypeVar("X")
# Told each stage's timing of a forward, on the loop, in stage order; raising stops the forward there.
StageHook = Callable[[StageTiming], None]
# Runs a Chain's `run` on a forward thread, as the loop's run_in_executor does: (run, nodes, x, hop, first).
Forwarder = Callable[..., Awaitable["Outcome"]]
# Raises (RunCancelled) when the forward must send to no further stage; called where the walk runs.
Halt = Callable[[], None]
# While a stage's hook runs: when that stage replied (time.monotonic()), as the hook runs later, on the
# loop, while the walk has gone on to the next stage.
replied_at: ContextVar[float | None] = ContextVar("replied_at", default=None)


class Keeper(Protocol):
    """What keeps a forward's inputs per stage, to refill a stage whose worker was replaced."""

    def before(self, node: Node, client: WorkerClient, x: Any) -> list[Any]:
        """Refill `client` with what it lacks before it takes `x` (blocking); what was refilled."""

    def after(self, node: Node, client: WorkerClient, x: Any) -> None:
        """Note that `client` took `x`."""

    def holds(self, node: Node, client: WorkerClient, x: Any) -> bool:
        """Whether `client` lacks nothing before `x` (`before` would refill nothing); never blocks."""


@dataclass(frozen=True)
class Hop(Generic[X]):
    """One stage's request of a forward: `now` blocks (on a forward thread), `on_loop` is awaited.

    Each takes the stage's client and input and gives its output and the worker's compute_ms.
    """

    now: Callable[[WorkerClient, X], tuple[X, float]]
    on_loop: Callable[[WorkerClient, X], Awaitable[tuple[X, float]]]


def no_hook(t: StageTiming) -> None:
    """The hook of a forward nobody times."""


def never_halt() -> None:
    """The halt of a forward nothing cancels."""


@dataclass(frozen=True)
class ForwardRequest:
    """One forward asked of the pipeline, passed as it is from the run to the stages.

    item: the session's rows and where they go (session, start_pos, last_only), as a stage takes them.
    on_stage: told each stage's timing as that stage replies (see StageHook).
    halt: asked before each stage, and while the forward waits for a lost stage to be back; raising
        stops the forward there, its error the forward's (see Halt).
    on_recovery: told when a stage the forward needs is lost and once it is back and refilled.
    """

    item: BatchItem
    on_stage: StageHook = no_hook
    halt: Halt = never_halt
    on_recovery: RecoveryHook = no_recovery_hook


@dataclass(frozen=True)
class Finished(Generic[X]):
    """Every stage replied; output is the last one's."""

    output: X


@dataclass(frozen=True)
class Cancelled:
    """The forward was stopped before a stage: its halt raised `error`, or (None) its caller left."""

    error: Exception | None


@dataclass(frozen=True)
class StageDown:
    """`node` was not up when its turn came; why: its state and what took it down."""

    node: Node
    why: str


@dataclass(frozen=True)
class WorkerFailed:
    """The worker of `node` failed the forward: it refused it, or its connection broke or timed out."""

    node: Node
    client: WorkerClient
    error: WorkerError


@dataclass(frozen=True)
class HookFailed:
    """A stage's hook raised `error`: no further stage was sent the forward."""

    error: Exception


Outcome = Finished[X] | Cancelled | StageDown | WorkerFailed | HookFailed


class Chain:
    """One forward's walk through the stages, on the loop or on a forward thread (see the module)."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, on_stage: StageHook, halt: Halt = never_halt,
        keeper: Keeper | None = None,
    ) -> None:  # fmt: skip
        self.loop, self.on_stage, self.halt, self.keeper = loop, on_stage, halt, keeper
        self.hook_error: Exception | None = None  # set on the loop by the first hook that raised
        self.reached: tuple[int, Any] = (0, None)  # the stage last sent (its place in `nodes`) and its input
        self.refills: list[Any] = []  # what the keeper refilled on the way
        self._held: tuple[StageTiming, float] | None = None  # the last stage's timing, for `settle`
        self._queued = False  # a hook was queued on the loop by `run_on_loop`
        self._stopped = threading.Event()

    def stop(self) -> None:
        """Send to no further stage (the forward's caller is gone)."""
        self._stopped.set()

    def run(self, nodes: list[Node], x: X, hop: Hop[X], first: int = 0) -> Outcome[X]:
        """Send `x` through `nodes` in order from `first`; the link's lock keeps a reset from overtaking."""
        for i in range(first, len(nodes)):
            node = nodes[i]
            self.reached = (i, x)
            if (stopped := self._stopped_before()) is not None:
                return stopped
            client = node.client
            if node.state != "up" or client is None:
                return StageDown(node, why_down(node))
            with client.link.lock:
                if self._stopped.is_set():
                    return Cancelled(None)
                try:
                    if self.keeper is not None:
                        self.refills += self.keeper.before(node, client, x)
                    started = time.monotonic()
                    y, compute_ms = hop.now(client, x)
                except WorkerError as exc:
                    return WorkerFailed(node, client, exc)
                replied = time.monotonic()
                if self.keeper is not None:
                    self.keeper.after(node, client, x)
                x = y
            self._timed(node, i == len(nodes) - 1, started, replied, compute_ms, on_loop=False)
        return Finished(x)

    async def run_on_loop(self, nodes: list[Node], x: X, hop: Hop[X], thread: Forwarder) -> Outcome[X]:
        """`run`, with each stage's request awaited on the loop; from a stage whose link is held
        elsewhere, or whose worker must first be refilled, the rest is `run` on a thread (`thread`).

        A caller that leaves does not stop a request under way (its reply must be read, or the link
        would be out of step): it shields this and calls `stop`, as for `run`. As from `run`, the
        hooks of the stages before the last have run by the time the outcome comes back.
        """
        outcome = await self._walk_on_loop(nodes, x, hop, thread)
        if self._queued:  # the loop runs what was queued before this task's next step: those hooks
            await asyncio.sleep(0)
        return outcome

    async def _walk_on_loop(self, nodes: list[Node], x: X, hop: Hop[X], thread: Forwarder) -> Outcome[X]:
        for i, node in enumerate(nodes):
            self.reached = (i, x)
            if (stopped := self._stopped_before()) is not None:
                return stopped
            if self._stopped.is_set():
                return Cancelled(None)
            client = node.client
            if node.state != "up" or client is None:
                return StageDown(node, why_down(node))
            link = client.link
            if not link.take_on_loop():
                return await thread(self.run, nodes, x, hop, i)
            try:
                if self.keeper is not None and not self.keeper.holds(node, client, x):
                    link.give_back_on_loop()
                    return await thread(self.run, nodes, x, hop, i)
                started = time.monotonic()
                y, compute_ms = await hop.on_loop(client, x)
            except WorkerError as exc:
                link.give_back_on_loop()
                return WorkerFailed(node, client, exc)
            except BaseException:
                link.give_back_on_loop()
                raise
            replied = time.monotonic()
            if self.keeper is not None:
                self.keeper.after(node, client, x)
            link.give_back_on_loop()
            x = y
            self._timed(node, i == len(nodes) - 1, started, replied, compute_ms, on_loop=True)
        return Finished(x)

    def _timed(
        self, node: Node, last: bool, started: float, replied: float, compute_ms: float, *, on_loop: bool
    ) -> None:  # fmt: skip
        """Hand the hook a stage's timing, to run on the loop once the next stage is sent; the last
        stage's is left for `settle`."""
        if self.on_stage is no_hook:
            return
        timing = stage_timing(node, (replied - started) * 1000, compute_ms)
        if last:
            self._held = (timing, replied)
        elif on_loop:
            self._queued = True
            self.loop.call_soon(self._hook, timing, replied)
        else:
            self.loop.call_soon_threadsafe(self._hook, timing, replied)

    def settle(self) -> None:
        """On the loop, once `run` returned: run the last stage's hook, which `run` left to the caller.

        The hooks handed over before it were queued on the loop earlier, so they have run by now.
        """
        held, self._held = self._held, None
        if held is not None:
            self._hook(*held)

    def _stopped_before(self) -> HookFailed | Cancelled | None:
        """Why the next stage must not be sent: a hook that already raised, or the halt raising now."""
        if (error := self.hook_error) is not None:
            return HookFailed(error)
        try:
            self.halt()
        except Exception as exc:
            return Cancelled(exc)
        return None

    def _hook(self, timing: StageTiming, replied: float) -> None:
        """Run the hook on the loop for a stage that replied, unless a hook raised or the caller left."""
        if self.hook_error is not None or self._stopped.is_set():
            return
        token = replied_at.set(replied)
        try:
            self.on_stage(timing)
        except Exception as exc:  # the forward's caller gets it, as if the hook had run in its task
            self.hook_error = exc
        finally:
            replied_at.reset(token)


def why_down(node: Node) -> str:
    """What keeps a node from taking a forward: its state and what took it there."""
    return f"{node.state}: {node.error or 'not connected'}"


def stage_timing(node: Node, forward_ms: float, compute_ms: float) -> StageTiming:
    """What one stage of a forward cost, as the coordinator saw it and as its worker reported."""
    report = node.report
    return StageTiming(
        addr=report.addr,
        layers=node.layers,
        device=report.device,
        build_ms=report.build_ms,
        forward_ms=forward_ms,
        resident_bytes=report.resident_bytes,
        compute_ms=compute_ms,
        stage=node.index,
        precision=report.precision,
    )
