"""A worker dies with its coordinator even when it is stopped and cannot notice by itself."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from tests.conftest import eventually, worker_pids


def state(pid: int) -> str:
    """The process's state letter (R, S, T, Z, ...), or "" when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


async def test_a_stopped_worker_is_killed_when_its_coordinator_is_killed(rlx_cluster):
    c = await rlx_cluster.astart("fake:layers=2", 2)
    workers = worker_pids(c.pid)
    assert sorted(workers) == sorted(s.pid for s in c.stages())
    paused = c.pause_stage(0)
    await eventually(lambda: state(paused) == "T", 5, "the worker to stop")

    c.signal(signal.SIGKILL)
    await c.aio.exit_code(10)
    # Once the coordinator is gone its workers are no longer its children at once; a killed worker
    # still needs the CPU to finish exiting, which a loaded machine gives it late: wait on each's state.
    await eventually(lambda: worker_pids(c.pid) == [], 10, "every worker to leave the coordinator")
    await eventually(lambda: all(state(pid) in ("", "Z") for pid in workers), 10, "every worker to exit")


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
