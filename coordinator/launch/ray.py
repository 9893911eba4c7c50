"""Place the workers with Ray: a placement group with one bundle per stage, one actor in each bundle.

Ray only places and supervises. Each actor (`StageHost`) starts the ordinary
worker command on its node, listening on that node's address, exactly as the
local launcher does, with as many kernel and BLAS threads as its bundle has
CPUs, and hands back the worker's NodeReport line; the coordinator then
connects to the worker over the usual wire protocol and handshake, so no
activation ever passes through Ray's object store. The
worker token reaches an actor through the variables of its runtime
environment (never an argument), and the worker through its environment.

A worker that dies is seen through its actor (`ended`), and so is an actor
that dies; the pipeline then stops what is left of that stage and starts its
next worker in the same bundle: in the same actor when that one still lives,
else in a new one. Every actor started here is killed by `stop_all`, which
also removes the placement group; `close` then leaves the Ray cluster,
shutting it down when it was started here.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from coordinator.launch import base as local
from coordinator.launch.base import BUILD_TIMEOUT, RAY_STRATEGIES, LaunchError, Worker, WorkerLauncher
from coordinator.launch.local import Launcher
from coordinator.units import quiet, size_text
from workers.models.footprint import footprint
from workers.protocol import auth
from workers.protocol.report import HeadRows, LayerRange, NodeReport, decode_report, encode_report

# Ray's crash handler would abort the coordinator 3 s after a SIGTERM, while it still stops its workers
# (the coordinator handles SIGTERM itself); Ray reads this when it is imported.
os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")

import ray
from ray.exceptions import RayError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

log = logging.getLogger("coordinator.launch.ray")

STAGE_CPUS = 1.0
# What a worker holds besides its stage's weights (the interpreter, numpy, buffers): a fake stage's
# worker is ~60 MB resident; the bundle asks for more so that a full node is not overcommitted.
WORKER_BASE_BYTES = 256 * 10**6
# Seconds Ray may take to start an actor's process before the worker's own build timeout begins.
ACTOR_START_S = 30.0
# An actor stops its worker within TERM_GRACE + KILL_WAIT; past this it is killed with its worker.
STOP_S = local.TERM_GRACE + local.KILL_WAIT + 2.0


class StageHost:
    """A Ray actor on one node that runs one stage's worker (on `threads` threads) and answers for it."""

    def __init__(self, model: str, precision: str, build_timeout: float, threads: int) -> None:
        self.model, self.precision, self.build_timeout = model, precision, build_timeout
        self.threads = threads
        self.launcher: Launcher | None = None
        self.worker = None

    async def start(
        self, index: int, start: int, end: int, head: tuple[int, int] | None = None
    ) -> dict[str, str]:
        """Start the worker on this node; its report line, or the error that stopped it.

        head: the head's rows the stage holds, when the head is cut (LayerRange.head).
        """
        token = os.environ.get(auth.WORKER_TOKEN_ENV, "")
        if not token:
            return {"error": f"the actor's environment has no ${auth.WORKER_TOKEN_ENV}"}
        host = ray.util.get_node_ip_address()
        self.launcher = Launcher(
            self.model, self.precision, host, self.build_timeout, token, threads=self.threads
        )
        try:
            rows = None if head is None else HeadRows(*head)
            self.worker = await self.launcher.start(index, LayerRange(start, end, rows))
        except (LaunchError, OSError) as exc:
            return {"error": f"on Ray node {host}: {exc}"}
        assert self.worker.report is not None
        return {"report": encode_report(self.worker.report)}

    async def ended(self) -> str:
        """Wait until the worker exits; say how."""
        assert self.worker is not None
        how = await self.worker.ended()
        return f"{how} on Ray node {ray.util.get_node_ip_address()}"

    async def stop(self) -> None:
        """Stop the worker: terminate, wait, kill."""
        if self.launcher is not None:
            await self.launcher.stop_all()


@functools.cache
def _stage_host() -> Any:
    """StageHost as a Ray actor class (made once; Ray needs it only when a launcher is used)."""
    # No restarts by Ray: a new actor per restart keeps the pipeline's budget and backoff in charge.
    return ray.remote(max_restarts=0)(StageHost)


@dataclass(eq=False)
class RayWorker:
    """One stage's actor and what its worker said; `pid` is the worker's process id on its node."""

    index: int
    layers: LayerRange
    actor: Any
    report: NodeReport | None = None
    _end: Any = None

    @property
    def name(self) -> str:
        return f"stage {self.index} (layers {self.layers})"

    @property
    def pid(self) -> int:
        return self.report.pid if self.report is not None else 0

    async def ended(self) -> str:
        """Wait until the worker or its actor is gone; say which and how."""
        try:
            return await self._end
        except RayError as exc:
            return f"the Ray actor of {self.name} is gone: {_first_line(exc)}"


class RayLauncher(WorkerLauncher):
    """Starts and stops the workers of one model as actors placed by Ray.

    address: the Ray cluster ("auto", or its HOST:PORT); "" starts a local
        instance (or uses the one this process already drives).
    strategy: how the bundles are spread over Ray's nodes (RAY_STRATEGIES).
    cpus: CPUs reserved for each stage's bundle.
    """

    def __init__(
        self,
        model: str,
        precision: str = "f32",
        *,
        address: str = "",
        strategy: str = "SPREAD",
        cpus: float = STAGE_CPUS,
        build_timeout: float = BUILD_TIMEOUT,
        token: str | None = None,
    ) -> None:
        if strategy not in RAY_STRATEGIES:
            raise ValueError(f"Ray strategy {strategy!r} is unknown; use one of {', '.join(RAY_STRATEGIES)}")
        if not cpus > 0:
            raise ValueError(f"CPUs per Ray stage must be > 0, got {cpus!r}")
        self.model, self.precision = model, precision
        self.address, self.strategy, self.cpus = address, strategy, cpus
        self.build_timeout = build_timeout
        self.token = token or auth.new_token()
        self.workers: set[RayWorker] = set()
        # A live actor per stage whose worker was stopped: the stage's next worker starts there, sooner.
        self._spare: dict[int, Any] = {}
        self.group: PlacementGroup | None = None
        self._bundles: list[dict[str, float]] = []
        self._joined = False

    async def connect(self) -> None:
        """Join the Ray cluster at `address`, or start a local one; a process already in one stays there."""
        if ray.is_initialized():
            return
        where = self.address or "a new local instance"
        try:
            # Workers' logs stay in Ray's session logs: their failures come back in LaunchErrors.
            await asyncio.to_thread(
                ray.init, address=self.address or None, include_dashboard=False, log_to_driver=False,
                logging_level=logging.WARNING,
            )  # fmt: skip
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise LaunchError(f"cannot connect to Ray at {where}: {exc}") from None
        self._joined = True

    async def close(self) -> None:
        """Stop every worker, remove the placement group, and leave Ray (shutting down what we started)."""
        await self.stop_all()
        if self._joined:
            self._joined = False
            await asyncio.to_thread(ray.shutdown)

    async def start_all(
        self, ranges: list[LayerRange], progress: Callable[[str], None] | None = None
    ) -> list[Worker]:
        """Reserve one bundle per range, within the build timeout, then start an actor in each."""
        await self._place(ranges, progress or quiet)
        return await super().start_all(ranges, progress)

    async def _place(self, ranges: list[LayerRange], say: Callable[[str], None]) -> None:
        cost = footprint(self.model, self.precision)
        self._bundles = [{"CPU": self.cpus, "memory": float(WORKER_BASE_BYTES + cost.stage_bytes(r))}
                         for r in ranges]  # fmt: skip
        say(f"placing {len(ranges)} stage(s) on Ray ({self.strategy}, {self.cpus:g} CPU each)")
        self.group = placement_group(self._bundles, strategy=self.strategy)
        if short := self._short():
            # Said at once rather than after the timeout: an autoscaler may still add what is missing.
            say(f"Ray cannot place them yet ({'; '.join(short)}): waiting up to {self.build_timeout:g} s")
        try:
            await asyncio.wait_for(self.group.ready(), self.build_timeout)
        except BaseException as exc:
            missing = self._unplaced() if isinstance(exc, TimeoutError) else ""
            remove_placement_group(self.group)
            self.group = None
            if missing:
                raise LaunchError(missing) from None
            raise

    def _short(self) -> list[str]:
        """What the bundles ask for beyond all the cluster has (CPUs, memory, nodes); empty if it may fit."""
        total = ray.cluster_resources()
        nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
        want_cpus = sum(b["CPU"] for b in self._bundles)
        want_memory = sum(b["memory"] for b in self._bundles)
        lacks = []
        if want_cpus > total.get("CPU", 0):
            lacks.append(f"{want_cpus:g} CPUs needed, the cluster has {total.get('CPU', 0):g}")
        if want_memory > total.get("memory", 0):
            lacks.append(f"{size_text(int(want_memory))} of memory needed, the cluster has "
                         f"{size_text(int(total.get('memory', 0)))}")  # fmt: skip
        if self.strategy == "STRICT_SPREAD" and len(self._bundles) > nodes:
            lacks.append(f"STRICT_SPREAD needs {len(self._bundles)} nodes, the cluster has {nodes}")
        return lacks

    def _unplaced(self) -> str:
        """Why the placement group is not placed: what it asks for against what the cluster has."""
        nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
        free = ray.available_resources()
        lacks = self._short() or [f"other work holds what is needed (free now: {free.get('CPU', 0):g} CPUs, "
                                  f"{size_text(int(free.get('memory', 0)))} of memory)"]  # fmt: skip
        per = f"{self.cpus:g} CPU and {size_text(int(max(b['memory'] for b in self._bundles)))} at most"
        return (f"Ray could not place {len(self._bundles)} stage(s) ({per} each, {self.strategy}) "
                f"within {self.build_timeout:g} s on {nodes} node(s): {'; '.join(lacks)}")  # fmt: skip

    async def start(self, index: int, layers: LayerRange) -> RayWorker:
        """Start a worker through an actor in its stage's bundle, wait for its report; on failure both go."""
        if self.group is None:
            raise LaunchError(f"stage {index}: no placement group (start_all places the stages first)")
        actor = self._spare.pop(index, None) or self._new_actor(index)
        worker = RayWorker(index, layers, actor)
        self.workers.add(worker)
        try:
            said = await asyncio.wait_for(
                actor.start.remote(index, layers.start, layers.end, _rows(layers)),
                self.build_timeout + ACTOR_START_S,
            )
            if "error" in said:
                raise LaunchError(said["error"])
            worker.report = decode_report(said["report"])
        except BaseException as exc:
            await self.stop(worker)
            if isinstance(exc, TimeoutError):
                late = f"did not report within {self.build_timeout + ACTOR_START_S:g} s of asking Ray"
                raise LaunchError(f"{worker.name} {late}") from None
            if isinstance(exc, RayError | ValueError):
                raise LaunchError(f"{worker.name}: its Ray actor failed: {_first_line(exc)}") from None
            raise
        worker._end = actor.ended.remote()
        log.info("%s reported from %s through Ray", worker.name, worker.report.addr)
        return worker

    def _new_actor(self, index: int) -> Any:
        bundle = self._bundles[index]
        in_bundle = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=index)
        return _stage_host().options(
            num_cpus=bundle["CPU"], memory=bundle["memory"], scheduling_strategy=in_bundle,
            runtime_env={"env_vars": {auth.WORKER_TOKEN_ENV: self.token}},
        ).remote(self.model, self.precision, self.build_timeout, bundle_threads(bundle["CPU"]))  # fmt: skip

    async def stop(self, worker: RayWorker) -> int | None:
        """Have the actor stop its worker (bounded); keep the actor for the stage's next worker, else kill it.

        A killed actor takes its worker along: the worker dies with its parent.
        """
        stopped = False
        if worker.report is not None:
            with suppress(RayError, TimeoutError):
                await asyncio.wait_for(worker.actor.stop.remote(), STOP_S)
                stopped = True
        self.workers.discard(worker)
        if stopped and self.group is not None and worker.index not in self._spare:
            self._spare[worker.index] = worker.actor
        else:
            _kill(worker.actor)
        return None

    async def stop_all(self) -> None:
        """Stop every worker and actor this launcher started, then give back the placement group."""
        await asyncio.gather(*(self.stop(w) for w in list(self.workers)), return_exceptions=True)
        for actor in self._spare.values():
            _kill(actor)
        self._spare.clear()
        if self.group is not None:
            with suppress(RayError):
                remove_placement_group(self.group)
            self.group = None


def bundle_threads(cpus: float) -> int:
    """A stage's kernel and BLAS threads: its bundle's whole CPUs, at least 1.

    Left to itself a worker sizes its pools to every core of its node (an actor may run on any of
    them): more threads than its bundle holds, fighting the node's other stages, and rounding
    otherwise than a local worker given the same cores does.
    """
    return max(1, int(cpus))


def _kill(actor: Any) -> None:
    with suppress(RayError):
        ray.kill(actor, no_restart=True)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _rows(layers: LayerRange) -> tuple[int, int] | None:
    """The head rows of a stage as the actor takes them: plain numbers, or None when the head is not cut."""
    return None if layers.head is None else (layers.head.start, layers.head.end)
