"""Record a run as it executes: each forward's stage timings in the run record and on the event bus.

The record keeps the first step's forwards (the prompt's, one per chunk; or
the single forward) and the last KEPT_STEPS decode steps as StepTimings (times
relative to the run's start on the coordinator's monotonic clock) and counts
the decode steps it let go; the bus hears every stage of every
forward (StageForward) and every token (TokenGenerated). A cancel takes
effect here, at the next forward boundary: once the stage in flight has
replied, before the next stage or step is sent.
"""

from __future__ import annotations

import time

from coordinator.events import EventBus, RunRecovered, RunRecovering, StageForward, TokenGenerated
from coordinator.stages.chain import StageHook, replied_at
from coordinator.stats import KEPT_STEPS, ClusterRun, Recovery, StageTiming, StepTiming


class RunCancelled(Exception):
    """The run was cancelled; it stopped at a forward boundary."""


class Recorder:
    """The timeline of one run being executed, and whether it has been asked to stop."""

    def __init__(self, run: ClusterRun, bus: EventBus, recover_timeout: float = 0.0) -> None:
        self.run, self.bus, self.recover_timeout = run, bus, recover_timeout
        self.cancelled = False
        self.started = time.monotonic()
        self._step: StepTiming | None = None
        self._first = 0  # the first step's forwards in `run.steps`: the ones kept for good

    def start(self) -> None:
        """The run starts executing now: its times count from here."""
        self.started = time.monotonic()

    def _ms(self, at: float | None = None) -> float:
        """Milliseconds since the run started, until `at` (time.monotonic()) or now."""
        return ((time.monotonic() if at is None else at) - self.started) * 1000

    def check(self) -> None:
        """Raise RunCancelled when a cancel was asked for."""
        if self.cancelled:
            raise RunCancelled("cancelled while running")

    def begin(self, step: int, positions: int, keep: StageHook) -> StageHook:
        """Start timing forward `step`; return the hook its stages report to (each told to `keep` too)."""
        self.check()
        self._step = StepTiming(step=step, positions=positions, start_ms=self._ms())
        steps = self.run.steps
        # The first step's forwards are kept for good (a long prompt's are bounded by the context, a
        # chunk each); the decode steps after them are a sliding window.
        if step == 0:
            self._first += 1
        elif len(steps) - self._first >= KEPT_STEPS:
            del steps[self._first]
            self.run.steps_omitted += 1
        steps.append(self._step)

        def hook(t: StageTiming) -> None:
            keep(t)
            self._stage(t)

        return hook

    def _stage(self, t: StageTiming) -> None:
        """Note one stage's part of the current step, tell the bus, and stop here if cancelled."""
        step = self._step
        assert step is not None
        # The stage was sent its forward_ms before it replied (the hook runs later, on the loop).
        now = self._ms(replied_at.get())
        step.stage_start_ms.append(now - t.forward_ms)
        step.forward_ms.append(t.forward_ms)
        step.compute_ms.append(t.compute_ms)
        step.wall_ms = now - step.start_ms
        self.bus.publish(
            StageForward(
                run=self.run.id, step=step.step, stage=t.stage, addr=t.addr, forward_ms=t.forward_ms,
                compute_ms=t.compute_ms, positions=step.positions,
            )
        )  # fmt: skip
        self.check()

    def recovery(self, session: str, recovery: Recovery, reason: str | None) -> None:
        """A stage of the current forward was lost (`reason`), or (None) is back and refilled: record it."""
        r = recovery
        if reason is not None:
            r.start_ms = self._ms()
            self.bus.publish(
                RunRecovering(
                    run=self.run.id, stage=r.stage, addr=r.addr, at_position=r.at_position, reason=reason,
                    timeout_s=self.recover_timeout,
                )
            )  # fmt: skip
            return
        if r.start_ms == 0 and r.waited_ms == 0:  # replaced between forwards: nothing was waited for
            r.start_ms = self._ms() - r.replay_ms
        self.run.recoveries.append(r)
        if self._step is not None:
            self._step.replayed.append(r.stage)
        self.bus.publish(
            RunRecovered(
                run=self.run.id, stage=r.stage, addr=r.addr, new_addr=r.new_addr, waited_ms=r.waited_ms,
                replayed_positions=r.replayed_positions, replay_ms=r.replay_ms,
            )
        )  # fmt: skip

    def end(self) -> None:
        """The current step is done (its output used): its wall time runs until now."""
        assert self._step is not None
        self._step.wall_ms = self._ms() - self._step.start_ms

    def token(self, index: int, token: int, text: str) -> None:
        """Tell the bus of a generated token, with the per-stage times of the step that made it."""
        stage_ms = list(self._step.forward_ms) if self._step is not None else []
        event = TokenGenerated(run=self.run.id, index=index, token=token, text=text, stage_ms=stage_ms)
        self.bus.publish(event)
