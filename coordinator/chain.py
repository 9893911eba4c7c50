"""One forward's walk through the stages, on a forward thread with each worker's blocking link.

No event loop stands between one stage's reply and the next stage's request
(issue 12: a lean hop). A stage's timing hook still runs on the loop, where
the bus lives: the thread hands it over and, before sending to the next
stage, waits for it, so that a hook that raises (a run cancelled) stops the
forward there, as it did when the loop drove the forward. `forward_ms` is
taken around the link's request alone, so it holds no hand-off; what the
hand-offs cost shows as the forward's wall time beyond its stages' sum.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from coordinator.client import WorkerClient, WorkerError
from coordinator.stats import StageTiming

if TYPE_CHECKING:
    from coordinator.node import Node

X = TypeVar("X")
StageHook = Callable[[StageTiming], None] | None


class Halted(Exception):
    """A forward chain stopped early; args: the node, its client when its worker failed, and why.

    With no client the node was not up (or the forward was cancelled) and why is
    a sentence; with one, why is the WorkerError; a hook that raised leaves all three None.
    """


class Chain:
    """One forward's walk through the stages, run on a forward thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_stage: StageHook, timeout: float) -> None:
        self.loop, self.on_stage, self.timeout = loop, on_stage, timeout
        self.hook_error: Exception | None = None
        self._stopped = threading.Event()
        self._heard = threading.Event()

    def stop(self) -> None:
        """Send to no further stage (the forward's caller is gone)."""
        self._stopped.set()
        self._heard.set()

    def run(self, nodes: list[Node], x: X, hop: Callable[[WorkerClient, X], tuple[X, float]]) -> X:
        """Send `x` through `nodes` in order; the link's lock keeps a reset from overtaking the forward."""
        for i, node in enumerate(nodes):
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
                forward_ms = (time.monotonic() - started) * 1000
            if self.on_stage is not None:
                self._tell(stage_timing(node, forward_ms, compute_ms), wait=i + 1 < len(nodes))
        return x

    def _tell(self, timing: StageTiming, *, wait: bool) -> None:
        """Run the hook on the loop; before another stage, wait for it, and stop if it raised."""
        self._heard.clear()
        self.loop.call_soon_threadsafe(self._hook, timing)
        if wait:
            self._heard.wait(self.timeout)
            if self.hook_error is not None or self._stopped.is_set():
                raise Halted(None, None, None)

    def _hook(self, timing: StageTiming) -> None:
        try:
            if self.hook_error is None and not self._stopped.is_set():
                self.on_stage(timing)
        except Exception as exc:  # the forward's caller gets it, as if the hook had run in its task
            self.hook_error = exc
        finally:
            self._heard.set()


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
