"""One forward's walk through the stages, on a forward thread with each worker's blocking link.

No event loop stands between one stage's reply and the next stage's request
(issue 12: a lean hop). A stage's timing hook still runs on the loop, where
the bus lives: the thread hands it over and goes on to the next stage, and
hooks run in order while it waits there. Before each stage the thread asks
the forward's `halt` (a run's cancel, read without the loop), so a cancel
stops the forward at the stage boundary it reaches first; a hook that raised
stops it too. `forward_ms` is taken around the link's request alone, so it
holds no hand-off; what the hand-offs cost shows as the forward's wall time
beyond its stages' sum.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, TypeVar

from coordinator.stages.client import WorkerClient, WorkerError
from coordinator.stats import StageTiming

if TYPE_CHECKING:
    from coordinator.stages.node import Node

X = TypeVar("X")
StageHook = Callable[[StageTiming], None] | None
# Raises (RunCancelled) when the forward must send to no further stage; called on the forward thread.
Halt = Callable[[], None] | None
# While a stage's hook runs: when that stage replied (time.monotonic()), as the hook runs later, on the
# loop, while the thread has gone on to the next stage.
replied_at: ContextVar[float | None] = ContextVar("replied_at", default=None)


class Halted(Exception):
    """A forward chain stopped early; args: the node, its client when its worker failed, and why.

    With no client the node was not up (or the forward was cancelled) and why is
    a sentence; with one, why is the WorkerError; a hook that raised leaves all three None.
    """


class Chain:
    """One forward's walk through the stages, run on a forward thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_stage: StageHook, halt: Halt = None) -> None:
        self.loop, self.on_stage, self.halt = loop, on_stage, halt
        self.hook_error: BaseException | None = None  # a hook's or halt's: the forward's error
        self._hook_raised = False
        self._stopped = threading.Event()

    def stop(self) -> None:
        """Send to no further stage (the forward's caller is gone)."""
        self._stopped.set()

    def run(self, nodes: list[Node], x: X, hop: Callable[[WorkerClient, X], tuple[X, float]]) -> X:
        """Send `x` through `nodes` in order; the link's lock keeps a reset from overtaking the forward."""
        for node in nodes:
            self._check()
            client = node.client
            if node.state != "up" or client is None:
                raise Halted(node, None, f"{node.name} is {node.state}: {node.error or 'not connected'}")
            with client.link.lock:
                if self._stopped.is_set():
                    raise Halted(node, None, "the forward was cancelled")
                started = time.monotonic()
                try:
                    x, compute_ms = hop(client, x)
                except WorkerError as exc:
                    raise Halted(node, client, exc) from exc
                replied = time.monotonic()
            if self.on_stage is not None:
                timing = stage_timing(node, (replied - started) * 1000, compute_ms)
                self.loop.call_soon_threadsafe(self._hook, timing, replied)
        return x

    def _check(self) -> None:
        """Stop here if a hook raised or the forward's halt does (its error becomes the forward's)."""
        if self.halt is not None and self.hook_error is None:
            try:
                self.halt()
            except Exception as exc:
                self.hook_error = exc
        if self.hook_error is not None:
            raise Halted(None, None, None)

    def _hook(self, timing: StageTiming, replied: float) -> None:
        """Run the hook on the loop for a stage that replied, unless a hook raised or the caller left."""
        token = replied_at.set(replied)
        try:
            if not self._hook_raised and not self._stopped.is_set():
                self.on_stage(timing)
        except Exception as exc:  # the forward's caller gets it, as if the hook had run in its task
            self._hook_raised = True
            if self.hook_error is None:
                self.hook_error = exc
        finally:
            replied_at.reset(token)


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
