"""One forward's walk through the stages, on a forward thread with each worker's blocking link.

No event loop stands between one stage's reply and the next stage's request,
so that a hop costs what the socket costs. A stage's timing hook still runs on
the loop, where the bus lives: the thread hands it over and goes on to the
next stage, and hooks run in order while it waits there. Before each stage the
thread asks the forward's `halt` (a run's cancel, read without the loop), so a
cancel stops the forward at the stage boundary it reaches first; a hook that
raised stops it too. `forward_ms` is taken around the link's request alone, so
it holds no hand-off; what the hand-offs cost shows as the forward's wall time
beyond its stages' sum. The last stage's hook is not handed over: the caller
runs it on the loop when the walk comes back (`settle`), as one wake of the loop
serves both. Handed over, it woke the loop while the thread still had its
outcome to return, and the two threads took the GIL from each other: 0.19 ms
from a reply to the thread's end, against 0.05 ms.

The walk ends in one typed outcome: Finished, or why it stopped (Cancelled,
StageDown, WorkerFailed, HookFailed); the pipeline matches on it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
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
# Raises (RunCancelled) when the forward must send to no further stage; called on the forward thread.
Halt = Callable[[], None]
# While a stage's hook runs: when that stage replied (time.monotonic()), as the hook runs later, on the
# loop, while the thread has gone on to the next stage.
replied_at: ContextVar[float | None] = ContextVar("replied_at", default=None)


class Keeper(Protocol):
    """What keeps a forward's inputs per stage, to refill a stage whose worker was replaced."""

    def before(self, node: Node, client: WorkerClient, x: Any) -> list[Any]:
        """Refill `client` with what it lacks before it takes `x` (blocking); what was refilled."""

    def after(self, node: Node, client: WorkerClient, x: Any) -> None:
        """Note that `client` took `x`."""


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
    """One forward's walk through the stages, run on a forward thread."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, on_stage: StageHook, halt: Halt = never_halt,
        keeper: Keeper | None = None,
    ) -> None:  # fmt: skip
        self.loop, self.on_stage, self.halt, self.keeper = loop, on_stage, halt, keeper
        self.hook_error: Exception | None = None  # set on the loop by the first hook that raised
        self.reached: tuple[int, Any] = (0, None)  # the stage last sent (its place in `nodes`) and its input
        self.refills: list[Any] = []  # what the keeper refilled on the way
        self._held: tuple[StageTiming, float] | None = None  # the last stage's timing, for `settle`
        self._stopped = threading.Event()

    def stop(self) -> None:
        """Send to no further stage (the forward's caller is gone)."""
        self._stopped.set()

    def run(self, nodes: list[Node], x: X, hop: Callable[[WorkerClient, X], tuple[X, float]]) -> Outcome[X]:
        """Send `x` through `nodes` in order; the link's lock keeps a reset from overtaking the forward."""
        for i, node in enumerate(nodes):
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
                    y, compute_ms = hop(client, x)
                except WorkerError as exc:
                    return WorkerFailed(node, client, exc)
                replied = time.monotonic()
                if self.keeper is not None:
                    self.keeper.after(node, client, x)
                x = y
            if self.on_stage is not no_hook:
                timing = stage_timing(node, (replied - started) * 1000, compute_ms)
                if i == len(nodes) - 1:
                    self._held = (timing, replied)
                else:
                    self.loop.call_soon_threadsafe(self._hook, timing, replied)
        return Finished(x)

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
