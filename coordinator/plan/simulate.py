"""A discrete-event simulation of concurrent generations through a placement, scheduled as the runner does.

What is modelled, after coordinator.runs: at most `max_active` runs execute at
once (the runner's MAX_ACTIVE), the rest wait their turn; a run forwards its
prompt in chunks of at most `chunk` positions (PREFILL_CHUNK), then one
decode step per further token. The scheduler's rules (coordinator.runs.scheduler):
up to `lanes` prompts in flight, each alone; decode steps go as batches on free
lanes once no member is between steps, each batch at most its share of the
decoding runs. A forward walks the stages in order through the coordinator:
half a stage's round trip and its bytes in, then the stage's queue (one
forward at a time, in order of arrival), its compute for the forward's rows,
then its bytes and the other half back. Not modelled: links shared by
several forwards at once (each forward has its link to itself), the
coordinator's own CPU beyond `between_ms` a step.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

# The runner's defaults (coordinator.runs: MAX_ACTIVE, LANES, PREFILL_CHUNK), which this wing may not
# import; tests/coordinator/plan/test_simulate.py checks they agree.
MAX_ACTIVE = 4
LANES = 2
PREFILL_CHUNK = 512


class SimStage(Protocol):
    """What the simulation needs of a stage (coordinator.plan.placement.PlannedStage has it)."""

    def compute_ms(self, rows: int = 1) -> float: ...

    def hop_ms(self, rows: int = 1, rows_out: int | None = None) -> float: ...


@dataclass(frozen=True)
class Workload:
    """The generations simulated: `runs` at once, each a prompt of `prompt` positions and `new_tokens` tokens.

    between_ms: what a run spends between its steps (sampling, the coordinator's bookkeeping), on the
        coordinator's one event loop: the runs of a batch take theirs in turn.
    """

    runs: int
    prompt: int = 32
    new_tokens: int = 32
    max_active: int = MAX_ACTIVE
    lanes: int = LANES
    chunk: int = PREFILL_CHUNK
    between_ms: float = 0.0

    def __post_init__(self) -> None:
        for name in ("runs", "prompt", "new_tokens", "max_active", "lanes", "chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class Prediction:
    """What the simulation predicts.

    tokens_per_s: every run's tokens over the time from the first run's start to the last's end.
    decode_tokens_per_s: decode tokens (all but each run's first) over the same time.
    ttft_ms: each run's time to its first token, from when it was submitted (all at 0).
    itl_ms: the gaps between a run's consecutive tokens, all runs'.
    stage_ms: each stage's mean time per decode forward, request sent to reply (queueing included).
    """

    tokens_per_s: float
    decode_tokens_per_s: float
    ttft_ms: list[float]
    itl_ms: list[float]
    stage_ms: list[float]
    makespan_ms: float

    def percentile(self, which: str, q: float) -> float:
        """A percentile of `ttft_ms` or `itl_ms` (0 when empty)."""
        values = getattr(self, which)
        return float(np.percentile(values, q)) if values else 0.0


@dataclass(eq=False)
class _Run:
    index: int
    forwards: list[int]  # rows of each forward still to send: prompt chunks, then 1 per step
    tokens: list[float] = field(default_factory=list)


@dataclass
class _Sim:
    """The simulation's state: the clock, the event queue, the stages' queues and the scheduler's counts."""

    stages: Sequence[SimStage]
    work: Workload
    now: float = 0.0
    events: list = field(default_factory=list)
    seq: int = 0
    free_at: list[float] = field(default_factory=list)
    waiting: list[_Run] = field(default_factory=list)
    members: int = 0
    sent: int = 0
    prompts: int = 0
    decode: dict[int, int] = field(default_factory=dict)
    queued: list[_Run] = field(default_factory=list)
    stage_times: list[list[float]] = field(default_factory=list)
    forwards: int = 0

    def at(self, when: float, action: Callable[[], None]) -> None:
        self.seq += 1
        heapq.heappush(self.events, (when, self.seq, action))

    def admit(self) -> None:
        while self.queued and self.members < self.work.max_active:
            self.members += 1
            self.waiting.append(self.queued.pop(0))

    def send_ready(self) -> None:
        """The scheduler's _send_ready, on the simulated runs."""
        prompts = [r for r in self.waiting if r.forwards[0] > 1]
        for run in prompts[: max(0, self.work.lanes - self.prompts)]:
            self.prompts += 1
            self.send([run], prompt=True)
        steps = [r for r in self.waiting if r.forwards[0] == 1]
        if self.members - len(self.waiting) - self.sent > 0:
            return
        share = -(-(len(steps) + sum(self.decode.values())) // self.work.lanes)
        while steps and len(self.decode) < self.work.lanes:
            group, steps = steps[:share], steps[share:]
            self.send(group, prompt=False)

    def send(self, group: list[_Run], prompt: bool) -> None:
        for run in group:
            self.waiting.remove(run)
        self.sent += len(group)
        rows = sum(r.forwards[0] for r in group)
        rows_out = 1 if prompt else len(group)
        self.forwards += 1
        key = self.forwards
        if not prompt:
            self.decode[key] = len(group)
        self.walk(group, 0, rows, rows_out, key, prompt, self.now)

    def walk(
        self, group: list[_Run], i: int, rows: int, rows_out: int, key: int, prompt: bool, t: float
    ) -> None:
        """The forward reaches stage i's link at time t (the coordinator sends it)."""
        if i == len(self.stages):
            self.at(t, lambda: self.back(group, key, prompt))
            return
        stage = self.stages[i]
        half = stage.hop_ms(rows, rows_out if i == len(self.stages) - 1 else None) / 2

        def arrive() -> None:
            start = max(self.now, self.free_at[i])
            self.free_at[i] = start + stage.compute_ms(rows)
            if not prompt:
                self.stage_times[i].append(self.free_at[i] + half - t)
            self.walk(group, i + 1, rows, rows_out, key, prompt, self.free_at[i] + half)

        self.at(t + half, arrive)

    def back(self, group: list[_Run], key: int, prompt: bool) -> None:
        """A forward came back: its runs take their tokens and are between steps."""
        self.sent -= len(group)
        if prompt:
            self.prompts -= 1
        self.decode.pop(key, None)
        for turn, run in enumerate(group, 1):
            run.forwards.pop(0)
            if not prompt or not run.forwards or run.forwards[0] == 1:  # a prompt's last chunk gives a token
                run.tokens.append(self.now)
            if run.forwards:
                # One loop serves every run: the batch's runs take their turns one after another.
                self.at(self.now + turn * self.work.between_ms, lambda r=run: self.waiting.append(r))
            else:
                self.members -= 1
        self.admit()


def simulate(stages: Sequence[SimStage], work: Workload) -> Prediction:
    """Run `work` through `stages` in simulated time; what it predicts."""
    if not stages:
        raise ValueError("no stages to simulate")
    chunks = [min(work.chunk, work.prompt - s) for s in range(0, work.prompt, work.chunk)]
    runs = [_Run(i, chunks + [1] * (work.new_tokens - 1)) for i in range(work.runs)]
    # The runner gives its scheduler no more lanes than stages.
    work = dataclasses.replace(work, lanes=min(work.lanes, len(stages)))
    sim = _Sim(stages, work, free_at=[0.0] * len(stages), stage_times=[[] for _ in stages])
    sim.queued = list(runs)
    sim.admit()
    sim.send_ready()
    while sim.events:
        sim.now, _, action = heapq.heappop(sim.events)
        action()
        if not sim.events or sim.events[0][0] > sim.now:  # the scheduler wakes once things settle
            sim.send_ready()
    end = max(r.tokens[-1] for r in runs)
    tokens = sum(len(r.tokens) for r in runs)
    return Prediction(
        tokens_per_s=tokens * 1000 / end if end else math.inf,
        decode_tokens_per_s=(tokens - len(runs)) * 1000 / end if end else math.inf,
        ttft_ms=[r.tokens[0] for r in runs],
        itl_ms=[b - a for r in runs for a, b in zip(r.tokens, r.tokens[1:], strict=False)],
        stage_ms=[sum(t) / len(t) if t else 0.0 for t in sim.stage_times],
        makespan_ms=end,
    )
