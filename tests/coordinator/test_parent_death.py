"""A worker dies with its coordinator even when it is stopped and cannot notice by itself."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from contextlib import suppress
from pathlib import Path

from tests.conftest import eventually, worker_pids


def state(pid: int) -> str:
    """The process's state letter (R, S, T, Z, ...), or "" when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


async def until_serving(proc: asyncio.subprocess.Process) -> None:
    assert proc.stderr is not None
    seen = []
    while not any("serving on" in line for line in seen):
        line = await proc.stderr.readline()
        assert line, "the coordinator exited before serving:\n" + "".join(seen)
        seen.append(line.decode())


async def test_a_stopped_worker_is_killed_when_its_coordinator_is_killed():
    coordinator = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "coordinator", "serve", "--model", "fake:layers=2", "--stages", "2",
        "--db", ":memory:", "--http", "127.0.0.1:0",
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        await asyncio.wait_for(until_serving(coordinator), 60)
        workers = worker_pids(coordinator.pid)
        assert len(workers) == 2
        os.kill(workers[0], signal.SIGSTOP)
        await eventually(lambda: state(workers[0]) == "T", 5, "the worker to stop")

        coordinator.kill()
        await asyncio.wait_for(coordinator.wait(), 10)
        await eventually(lambda: worker_pids(coordinator.pid) == [], 10, "every worker to exit")
        assert all(state(pid) in ("", "Z") for pid in workers)
    finally:
        for pid in worker_pids(coordinator.pid):  # SIGKILL ends a stopped process too
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if coordinator.returncode is None:
            coordinator.kill()
            await asyncio.wait_for(coordinator.wait(), 10)


async def test_a_worker_whose_parent_is_already_gone_does_not_start():
    not_our_parent = os.getppid()  # the worker's parent is this process, not ours
    worker = await asyncio.create_subprocess_exec(
        sys.executable, "-P", "-m", "workers", "--model", "fake:layers=2", "--layers", "0..2",
        "--parent-pid", str(not_our_parent),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(worker.communicate(), 30)
    assert worker.returncode != 0 and out == b""
    assert f"parent {not_our_parent} is gone".encode() in err
