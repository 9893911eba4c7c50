"""What every way of making workers exist offers: start, stop, and a Worker that says how it ended."""

from __future__ import annotations

import asyncio
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import suppress
from typing import Protocol

from coordinator.units import quiet
from workers.protocol.report import LayerRange, NodeReport

BUILD_TIMEOUT = 120.0


# Stopping a process (launch.process): seconds it has to exit after SIGTERM, then after SIGKILL.
TERM_GRACE = 3.0
KILL_WAIT = 5.0


# Stages of one pipeline take turns on the same cores. OpenBLAS threads spin for
# 2**28 cycles after each call by default, stealing the cores from the next
# stage (decode ran 4x slower); 2**17 cycles keeps them warm within a stage only.
WORKER_ENV = {"OPENBLAS_THREAD_TIMEOUT": "17"}


# The ways workers come to exist (local subprocesses, Ray actors), and how Ray may spread stages over nodes.
LAUNCHERS = ("local", "ray")


RAY_STRATEGIES = ("SPREAD", "STRICT_SPREAD", "PACK")


class LaunchError(Exception):
    """A worker that could not be started, or exited or hung before reporting."""


class Worker(Protocol):
    """A started worker, whichever launcher started it: its stage, its report, its end."""

    index: int
    layers: LayerRange
    report: NodeReport | None

    @property
    def name(self) -> str: ...

    async def ended(self) -> str:
        """Wait until the worker is gone; say how it went."""
        ...


class WorkerLauncher(ABC):
    """Makes the workers of one model exist, and go away again; `token` is the one they accept."""

    token: str

    @abstractmethod
    async def start(self, index: int, layers: LayerRange) -> Worker:
        """Start one worker and wait for its report; on any failure it is stopped."""

    @abstractmethod
    async def stop(self, worker: Worker) -> int | None:
        """Stop one worker, within bounded waits; its exit status when known."""

    @abstractmethod
    async def stop_all(self) -> None:
        """Stop every worker this launcher started."""

    async def start_all(
        self, ranges: list[LayerRange], progress: Callable[[str], None] | None = None
    ) -> list[Worker]:
        """Start one worker per range, concurrently; if any fails, stop them all."""
        say = progress or quiet
        started = time.monotonic()

        async def start_one(i: int, layers: LayerRange) -> Worker:
            worker = await self.start(i, layers)
            assert worker.report is not None
            report = worker.report
            built = f"built in {report.build_ms / 1000:.1f}s"
            say(f"stage {i} (layers {layers}): ready at {report.addr}, {built}")
            return worker

        tasks = [asyncio.create_task(start_one(i, r)) for i, r in enumerate(ranges)]
        ticker = asyncio.create_task(self._progress(tasks, started, say))
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.stop_all()
            raise
        finally:
            ticker.cancel()
            with suppress(asyncio.CancelledError):
                await ticker

    async def _progress(self, tasks: list[asyncio.Task], started: float, say: Callable[[str], None]) -> None:
        while True:
            await asyncio.sleep(1.0)
            waiting = [str(i) for i, task in enumerate(tasks) if not task.done()]
            say(f"building: stage {', '.join(waiting)} … {time.monotonic() - started:.1f}s")


# What sizes a worker's kernel and BLAS thread pools.
THREAD_VARS = ("RLX_THREADS", "OPENBLAS_NUM_THREADS")


def thread_env(workers: int) -> dict[str, str]:
    """Kernel and BLAS threads for one of `workers` on this host: cores // workers, at least 1, unless set.

    Workers each running a pool as wide as the host fight over the cores (spinning pools made decode
    slower by 10x and more); one pool per worker sized to its share does not.
    """
    return threads_env(len(os.sched_getaffinity(0)) // max(1, workers))


def threads_env(threads: int) -> dict[str, str]:
    """Kernel and BLAS threads for a worker given `threads` cores (at least 1), unless set.

    A count given here is the most the worker's kernels use: it times its decode steps and computes
    with fewer threads while they are faster (RLX_THREAD_RULE=measured, workers.threads), as when
    other processes hold some of the cores. An RLX_THREADS set in our environment is the count.
    """
    n = str(max(1, threads))
    env = {k: n for k in THREAD_VARS if k not in os.environ}
    if "RLX_THREADS" in env and "RLX_THREAD_RULE" not in os.environ:
        env["RLX_THREAD_RULE"] = "measured"
    return env


def local_env(workers: int, threads: int | None = None) -> dict[str, str]:
    """What each of `workers` workers started on this host gets on top of our environment.

    `threads` cores each when given, else its share of the cores (thread_env); and each of
    WORKER_ENV that our environment does not set. Anything else started to compute as a worker
    would (the layer measuring) gets the same.
    """
    share = thread_env(workers) if threads is None else threads_env(threads)
    return share | {k: v for k, v in WORKER_ENV.items() if k not in os.environ}
