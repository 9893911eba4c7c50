"""A stage of the live pipeline: its state, its worker, and when it is restarted.

A node's state changes in one place, `Node.set`, which sets the state and why
together and then publishes one `NodeChanged`: whoever changes it (a
supervisor, the join listener), the event is complete when it is told. It
also wakes whoever waits for the change (`Node.changed`): a run waiting for
its lost stage goes on the moment the stage is up, not at its next look.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Literal

from coordinator.events import EventBus, NodeChanged
from coordinator.launch.base import Worker
from coordinator.stages.client import WorkerClient
from workers.protocol.report import LayerRange, NodeReport

# Automatic restarts of one stage allowed within RESTART_WINDOW_S; past it the stage is `failed`.
RESTART_BUDGET = 5
# Seconds a restart counts against the budget; a stage up this long has its count forgotten.
RESTART_WINDOW_S = 60.0
# Wait before the n-th automatic restart within the window (the last value repeats).
RESTART_BACKOFF_S = (0.5, 1.0, 2.0)
NodeState = Literal["up", "down", "restarting", "failed", "vacant", "building"]


@dataclass(frozen=True)
class RestartPolicy:
    """When a dead local stage is restarted automatically.

    budget: at most this many automatic restarts of one stage within window_s
        seconds; a stage that needs one more is `failed` instead.
    window_s: seconds a restart counts against the budget (a sliding window).
    backoff_s: seconds to wait before the n-th restart in the window, the last repeating.
    """

    budget: int = RESTART_BUDGET
    window_s: float = RESTART_WINDOW_S
    backoff_s: tuple[float, ...] = RESTART_BACKOFF_S

    def __post_init__(self) -> None:
        if not isinstance(self.budget, int) or self.budget < 0:
            raise ValueError(f"restart budget must be an integer >= 0, got {self.budget!r}")
        if not 0 < self.window_s < math.inf:
            raise ValueError(f"restart window must be a finite number of seconds > 0, got {self.window_s!r}")
        if not self.backoff_s or not all(0 <= b < math.inf for b in self.backoff_s):
            raise ValueError(f"restart backoff must be one or more finite seconds >= 0, got {self.backoff_s}")

    def backoff(self, used: int) -> float:
        """Seconds to wait before a restart when `used` restarts are already in the window."""
        return self.backoff_s[min(used, len(self.backoff_s) - 1)]


@dataclass
class Node:
    """One stage of the live pipeline and its state.

    state: "up", "down", "restarting", "failed" (out of automatic restarts),
        "vacant" (no worker has joined for it yet) or "building" (a joined worker builds it).
    report: what its worker said of itself; None while no worker holds it.
    restarts: restarts made by the coordinator so far, automatic and manual.
    error: why the node last went down, and for a failed node what to do.
    policy: when it is restarted automatically.
    restart_times: monotonic times of its automatic restarts, the oldest first.
    bus: where each change of its state is published (see `publish_to`); None publishes nothing.
    """

    index: int
    layers: LayerRange
    report: NodeReport | None = None
    client: WorkerClient | None = None
    process: Worker | None = None
    state: NodeState = "up"
    restarts: int = 0
    error: str | None = None
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    restart_times: deque[float] = field(default_factory=deque)
    bus: EventBus | None = field(default=None, repr=False, compare=False)
    # Set (and dropped) at the next change of state; made by the first to wait for it.
    _change: asyncio.Event | None = field(default=None, init=False, repr=False, compare=False)

    def set(self, state: NodeState, error: str | None = None) -> None:
        """Put the node in `state` for the reason `error`; publish one NodeChanged if the state changed.

        The error is kept whether or not the state changed (a restart that fails again says why anew).
        """
        changed = state != self.state
        self.state, self.error = state, error
        if changed:
            self._publish()
            if self._change is not None:
                self._change.set()
                self._change = None

    async def changed(self, timeout: float) -> None:
        """Return at the node's next change of state, or after `timeout` seconds, whichever comes first."""
        if self._change is None:
            self._change = asyncio.Event()
        with suppress(TimeoutError):
            await asyncio.wait_for(self._change.wait(), timeout)

    def publish_to(self, bus: EventBus) -> None:
        """Publish this node's changes on `bus` from now on, starting with its state now."""
        self.bus = bus
        self._publish()

    def _publish(self) -> None:
        if self.bus is not None:
            addr = self.report.addr if self.report is not None else ""
            self.bus.publish(NodeChanged(stage=self.index, addr=addr, state=self.state, error=self.error))

    @property
    def name(self) -> str:
        where = f"{self.report.addr}, " if self.report is not None else ""
        return f"stage {self.index} ({where}layers {self.layers})"

    @property
    def restarts_in_window(self) -> int:
        """Automatic restarts that count against the budget now; older ones are forgotten."""
        cutoff = time.monotonic() - self.policy.window_s
        while self.restart_times and self.restart_times[0] <= cutoff:
            self.restart_times.popleft()
        return len(self.restart_times)
