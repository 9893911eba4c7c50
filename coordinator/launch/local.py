"""Start local worker processes, read their reports, and stop them cleanly.

Each worker gets the shared token through its environment, a new session (so
a terminal's Ctrl-C reaches only the coordinator, which stops them in order),
and our pid so it exits by itself if we die without stopping it.

`WorkerLauncher` is what every way of making workers exist offers the
pipeline (local subprocesses here, Ray actors in coordinator.launch.ray):
start one, start all, stop one, stop all, and a `Worker` that says when and
how it ended.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections import deque
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field

import msgspec

from coordinator.launch.base import BUILD_TIMEOUT, LaunchError, WorkerLauncher, local_env
from coordinator.launch.process import STREAM_LIMIT, start_process, stop_process
from workers.protocol import auth
from workers.protocol.report import LayerRange, NodeReport, decode_report

log = logging.getLogger("coordinator.launch.local")

STDERR_TAIL = 20


@dataclass
class WorkerProcess:
    """One local worker process and what it has said so far."""

    index: int
    layers: LayerRange
    command: list[str]
    proc: asyncio.subprocess.Process
    report: NodeReport | None = None
    stderr_tail: deque[str] = field(default_factory=lambda: deque(maxlen=STDERR_TAIL))
    stdout_reader: asyncio.Task | None = None
    stderr_reader: asyncio.Task | None = None

    @property
    def name(self) -> str:
        return f"stage {self.index} (layers {self.layers})"

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def ended(self) -> str:
        """Wait until the process exits; say with what status."""
        status = await self.proc.wait()
        return f"worker process {self.proc.pid} exited with status {status}"

    def describe_failure(self, what: str) -> str:
        """A message naming the stage, its command and its last stderr lines."""
        tail = "\n".join(f"    {line}" for line in self.stderr_tail) or "    (nothing)"
        return f"{self.name} {what}\n  command: {' '.join(self.command)}\n  last stderr:\n{tail}"


class Launcher(WorkerLauncher):
    """Starts and stops the local workers of one model.

    threads: each worker's kernel and BLAS threads; None gives each its share of this host's cores.
    """

    def __init__(
        self,
        model: str,
        precision: str = "f32",
        host: str = "127.0.0.1",
        build_timeout: float = BUILD_TIMEOUT,
        token: str | None = None,
        extra_env: dict[str, str] | None = None,
        threads: int | None = None,
    ) -> None:
        self.model = model
        self.precision = precision
        self.host = host
        self.build_timeout = build_timeout
        self.token = token or auth.new_token()
        self.extra_env = extra_env or {}  # on top of local_env
        self.workers_here = 1  # how many workers share this host's cores (start_all knows)
        self.threads = threads  # each worker's threads, when they are given rather than a share of the cores
        # Keyed by pid, not stage: every process started is stopped by stop_all, even
        # if two starts for one stage ever overlap.
        self.workers: dict[int, WorkerProcess] = {}

    async def start_all(
        self, ranges: list[LayerRange], progress: Callable[[str], None] | None = None
    ) -> list[WorkerProcess]:
        """Start one worker per range, each with its share of this host's cores."""
        self.workers_here = len(ranges)
        return await super().start_all(ranges, progress)

    def command(self, layers: LayerRange) -> list[str]:
        """The command line of a worker holding `layers` (no secrets on it)."""
        return [
            # -P: never import from our current directory (a stray token.py would shadow the stdlib).
            sys.executable, "-P", "-m", "workers",
            "--model", self.model,
            "--layers", str(layers),
            "--host", self.host,
            "--port", "0",
            "--precision", self.precision,
            "--parent-pid", str(os.getpid()),
        ]  # fmt: skip

    async def start(self, index: int, layers: LayerRange) -> WorkerProcess:
        """Start one worker and wait for its report; on any failure it is stopped."""
        command = self.command(layers)
        env = os.environ | local_env(self.workers_here, self.threads) | self.extra_env
        env[auth.WORKER_TOKEN_ENV] = self.token
        proc = await start_process(command, env)
        worker = WorkerProcess(index, layers, command, proc)
        self.workers[proc.pid] = worker
        reported: asyncio.Future[NodeReport] = asyncio.get_running_loop().create_future()
        worker.stderr_reader = asyncio.create_task(self._read_stderr(worker))
        worker.stdout_reader = asyncio.create_task(self._read_stdout(worker, reported))
        try:
            worker.report = await asyncio.wait_for(asyncio.shield(reported), self.build_timeout)
        except BaseException as exc:
            reported.cancel()  # stopping the worker must not leave an unread failure behind
            await self.stop(worker)
            if isinstance(exc, TimeoutError):
                late = f"did not report within {self.build_timeout:.0f}s"
                raise LaunchError(worker.describe_failure(late)) from None
            raise
        log.info("%s reported from %s in %d ms", worker.name, worker.report.addr, worker.report.build_ms)
        return worker

    async def _read_stdout(self, worker: WorkerProcess, reported: asyncio.Future[NodeReport]) -> None:
        assert worker.proc.stdout is not None
        while line := await _readline(worker.proc.stdout):
            text = line.decode(errors="replace").strip()
            if reported.done():
                if text:
                    log.warning("%s stdout after its report: %s", worker.name, text[:200])
                continue
            if not text:
                continue
            try:
                obj = msgspec.json.decode(text)
            except (msgspec.DecodeError, RecursionError):
                obj = None
            if not isinstance(obj, dict):
                log.warning("%s printed a line that is not a report (skipped): %s", worker.name, text[:200])
                continue
            try:
                reported.set_result(decode_report(text))
            except ValueError as exc:
                invalid = worker.describe_failure(f"printed an invalid report: {exc}")
                reported.set_exception(LaunchError(invalid))
        if not reported.done():
            # Let stderr finish so the error shows the worker's last words.
            with suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(worker.stderr_reader), 2.0)
            with suppress(TimeoutError):
                await asyncio.wait_for(worker.proc.wait(), 2.0)
            status = worker.proc.returncode
            what = "exited" if status is None else f"exited with status {status}"
            reported.set_exception(LaunchError(worker.describe_failure(f"{what} before reporting")))

    async def _read_stderr(self, worker: WorkerProcess) -> None:
        assert worker.proc.stderr is not None
        while line := await _readline(worker.proc.stderr):
            text = line.decode(errors="replace").rstrip()
            worker.stderr_tail.append(text)
            log.info("[stage %d] %s", worker.index, text)

    async def stop(self, worker: WorkerProcess) -> int | None:
        """Terminate, wait a grace period, kill, wait: the process is gone after this."""
        proc = worker.proc
        await stop_process(proc, worker.name)
        readers = [task for task in (worker.stdout_reader, worker.stderr_reader) if task is not None]
        for task in readers:
            task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        if self.workers.get(proc.pid) is worker:
            del self.workers[proc.pid]
        return proc.returncode

    async def stop_all(self) -> None:
        """Stop every worker this launcher started, concurrently."""
        await asyncio.gather(*(self.stop(w) for w in list(self.workers.values())), return_exceptions=True)


async def _readline(stream: asyncio.StreamReader) -> bytes:
    """Read a line; a line over the stream limit is dropped (and said so), not fatal."""
    try:
        return await stream.readline()
    except ValueError:  # readline has discarded the over-long line
        return b"(a line longer than %d bytes was dropped)\n" % STREAM_LIMIT
