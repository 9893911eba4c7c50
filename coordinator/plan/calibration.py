"""Choose a split by plan: even, or measured (each layer timed at decode, then balanced by the planner).

The measuring runs in a process of its own (`python -m workers.calibrate`),
started with the workers' environment, so it computes with the threads and
libraries a worker would, and its weights leave with it. What it measures is
kept in the run store's file and reused by the next plan with the same inputs
(see coordinator.plan.cost_cache).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import msgspec

from coordinator.launch.base import LaunchError
from coordinator.launch.process import start_process, stop_process
from coordinator.plan.cost_cache import CostCache, cost_key
from coordinator.plan.split import Head, split, split_by_cost, stage_costs
from coordinator.store.file import MEMORY
from coordinator.units import quiet
from workers.calibrate import Costs, StageCosts
from workers.models import gguf_path
from workers.protocol.report import LayerRange

PLANS = ("even", "measured")
T = TypeVar("T", Costs, StageCosts)
CALIBRATE_TIMEOUT = 300.0
STDERR_TAIL = 10
# The exit status of `workers.calibrate` for a model or precision it cannot build: bad input, not a failure.
BAD_INPUT = 2


class CalibrationError(LaunchError):
    """Measuring the layers failed or took too long."""


def default_plan(model: str) -> str:
    """Measured for a real model (a GGUF file), where stages differ; even for the test models."""
    return "measured" if gguf_path(model) is not None else "even"


def check_plan(plan: str) -> str:
    """The plan's name, or a ValueError listing the plans that exist."""
    if plan not in PLANS:
        raise ValueError(f"unknown plan {plan!r}; accepted: {', '.join(PLANS)}")
    return plan


@dataclass(frozen=True)
class Plan:
    """A split and, when measured, what each layer costs (decode ms per token).

    reused: whether the costs were kept from an earlier measurement rather than measured now.
    source: where the costs come from, for a person ("" for an even plan).
    """

    ranges: list[LayerRange]
    costs: Costs | None = None
    reused: bool = False
    source: str = ""

    def predicted_ms(self, ranges: Sequence[LayerRange] | None = None) -> list[float]:
        """Each stage's predicted decode ms per token, for this split or another (measured plans only)."""
        assert self.costs is not None, "only a measured plan predicts"
        ranges = self.ranges if ranges is None else ranges
        return stage_costs(self.costs.layers, ranges, self.costs.stage_ms, head_of(self.costs))

    def summary(self, ranges: Sequence[LayerRange] | None = None) -> str:
        """The split (this one or another) and its predicted ms per token, e.g. "0..11 12.1 ms, … (1.02x)"."""
        ranges = self.ranges if ranges is None else ranges
        ms = self.predicted_ms(ranges)
        stages = ", ".join(f"{r} {t:.2f} ms" for r, t in zip(ranges, ms, strict=True))
        return f"{stages} (slowest {imbalance(ms):.2f}x the mean)"


def plan_lines(plan: Plan, n_layers: int) -> list[str]:
    """The split for a person: a line per stage; a measured plan's predicted times beside the even split's."""
    lines = [f"stage {i}: layers {r} ({len(r)} of {n_layers})" for i, r in enumerate(plan.ranges)]
    if plan.costs is None:
        return lines
    ms = plan.predicted_ms()
    lines = [f"{line}  {t:.2f} ms per token" for line, t in zip(lines, ms, strict=True)]
    lines.append(f"slowest stage: {imbalance(ms):.2f}x the mean (measured in {plan.costs.precision})")
    lines.append(f"even split: {plan.summary(split(n_layers, len(plan.ranges)))}")
    lines.append(f"each stage: {plan.costs.stage_ms:.2f} ms per token beyond its layers")
    if plan.costs.head_rows:
        lines.append(f"the head: {plan.costs.head_ms:.2f} ms per token, {plan.costs.head_rows} rows")
    lines.append(f"layer costs: {plan.source}")
    return lines


def head_of(costs: Costs) -> Head | None:
    """The head as measured, for a planner that may cut it; None when the last layer's cost holds it."""
    return Head(costs.head_rows, costs.head_ms) if costs.head_rows else None


def imbalance(stage_ms: Sequence[float]) -> float:
    """The slowest stage's time over the mean of all (1.0 when balanced, 0.0 when nothing takes time)."""
    total = sum(stage_ms)
    return max(stage_ms) * len(stage_ms) / total if total > 0 else 0.0


async def make_plan(
    plan: str,
    model: str,
    n_layers: int,
    stages: int,
    precision: str,
    env: dict[str, str],
    timeout: float = CALIBRATE_TIMEOUT,
    progress: Callable[[str], None] = quiet,
    db: str | Path = MEMORY,
    recalibrate: bool = False,
) -> Plan:
    """Split `n_layers` into `stages` by `plan`; a measured plan times the layers first, or reuses kept times.

    db: the run store file whose kept costs a measured plan reuses and where it
    keeps what it measures (":memory:" keeps nothing); recalibrate: measure even
    when costs are kept. A split that cannot be made is a PlanError, before anything is measured.
    """
    even = split(n_layers, stages)
    if check_plan(plan) == "even":
        return Plan(even)
    costs, reused, source = await _costs(model, n_layers, precision, env, timeout, progress, db, recalibrate)
    measured = Plan(split_by_cost(costs.layers, stages, head=head_of(costs)), costs, reused, source)
    progress(f"measured plan: {measured.summary()}; even split: {measured.summary(even)}")
    return measured


async def _costs(
    model: str,
    n_layers: int,
    precision: str,
    env: dict[str, str],
    timeout: float,
    progress: Callable[[str], None],
    db: str | Path,
    recalibrate: bool,
) -> tuple[Costs, bool, str]:
    """Each layer's costs, whether they were kept from before, and where they come from, in words."""
    key = cost_key(model, precision, env) if str(db) != MEMORY else None
    cache = CostCache(db)
    kept = await asyncio.to_thread(cache.get, key, n_layers) if key is not None and not recalibrate else None
    if kept is not None:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(kept.measured_at))
        progress(f"reusing each layer's decode time as measured {when} ({model}, {precision})")
        return kept.costs, True, f"reused, measured {when} (kept in {cache.db}; --recalibrate measures again)"
    progress(f"measuring each layer's decode time ({model}, {precision})")
    costs = await measure(model, precision, env, timeout)
    if len(costs.layers) != n_layers:
        raise CalibrationError(f"measured {len(costs.layers)} layers of {model}, which has {n_layers}")
    if key is None:
        why = "--db :memory: keeps nothing" if str(db) == MEMORY else "the model names no file"
        return costs, False, f"measured now, not kept ({why})"
    problem = await asyncio.to_thread(cache.put, key, costs)
    return costs, False, f"measured now, {f'not kept: {problem}' if problem else f'kept in {cache.db}'}"


async def measure(model: str, precision: str, env: dict[str, str], timeout: float) -> Costs:
    """Time each layer of `model` in `precision` in a process started with `env` on top of ours."""
    return await _calibrate(model, ["--precision", precision], Costs, env, timeout)


async def measure_stages(
    model: str, precision: str, ranges: Sequence[LayerRange], env: dict[str, str], timeout: float
) -> StageCosts:
    """Time whole stages of `model` as `measure` times layers: a check of a split's predicted times."""
    args = ["--precision", precision, "--stages", ",".join(map(str, ranges))]
    return await _calibrate(model, args, StageCosts, env, timeout)


async def _calibrate(model: str, args: list[str], type_: type[T], env: dict[str, str], timeout: float) -> T:
    """Run `workers.calibrate` on `model` with `args`; what it prints, as `type_`."""
    command = [sys.executable, "-P", "-m", "workers.calibrate", "--model", model, *args]
    proc = await start_process(command, os.environ | env)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        raise CalibrationError(f"measuring {model} took more than {timeout:.0f}s") from None
    finally:  # whatever way we leave, a terminal's Ctrl-C included: it has a session of its own
        await stop_process(proc, f"measuring {model}")
    said = err.decode(errors="replace").strip().splitlines()[-STDERR_TAIL:]
    if proc.returncode == BAD_INPUT and said:
        raise ValueError(said[-1].removeprefix("calibrate: "))
    if proc.returncode != 0:
        tail = "\n".join(f"    {line}" for line in said) or "    (nothing)"
        raise CalibrationError(
            f"measuring {model} failed (exit status {proc.returncode})\n"
            f"  command: {' '.join(command)}\n  last stderr:\n{tail}"
        )
    try:
        return msgspec.json.decode(out.strip().splitlines()[-1], type=type_)
    except (msgspec.DecodeError, IndexError) as exc:
        raise CalibrationError(f"measuring {model} printed no costs: {exc}") from None
