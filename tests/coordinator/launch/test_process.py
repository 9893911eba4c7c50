"""A child process is started in a session of its own and stopped in bounded steps, whatever it does."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import pytest

from coordinator.launch import process
from coordinator.launch.process import start_process, stop_process

# A child that says it is ready, then waits; with IGNORE it shrugs off SIGTERM, with TELL it says it got
# one before it dies of it.
CHILD = """
import os, signal, sys, time
def tell(signum, frame):
    print("terminated", flush=True)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
if sys.argv[1] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if sys.argv[1] == "tell":
    signal.signal(signal.SIGTERM, tell)
print("ready", flush=True)
time.sleep(60)
"""


async def started(how: str) -> asyncio.subprocess.Process:
    proc = await start_process([sys.executable, "-c", CHILD, how], dict(os.environ))
    assert proc.stdout is not None
    assert await asyncio.wait_for(proc.stdout.readline(), 30) == b"ready\n"
    return proc


async def test_a_child_is_started_in_a_session_of_its_own_with_its_output_piped():
    proc = await started("obey")
    try:
        assert os.getsid(proc.pid) == proc.pid != os.getsid(0)
        assert proc.stdin is None and proc.stdout is not None and proc.stderr is not None
    finally:
        await stop_process(proc, "child")


async def test_a_child_that_obeys_sigterm_is_stopped_by_it():
    proc = await started("tell")
    begun = time.monotonic()
    status = await asyncio.wait_for(stop_process(proc, "child"), 10)
    assert proc.stdout is not None
    assert await asyncio.wait_for(proc.stdout.read(), 10) == b"terminated\n"
    assert time.monotonic() - begun < process.TERM_GRACE  # no SIGKILL after the grace was needed
    # The status is asyncio's child watcher's to tell: 255 when another waiter in this long test
    # process reaped that pid first (pids are reused within a run); the child's own word says SIGTERM.
    assert status in (-signal.SIGTERM, 255)


async def test_a_child_that_ignores_sigterm_is_killed_after_the_grace_and_said_so(monkeypatch, caplog):
    monkeypatch.setattr(process, "TERM_GRACE", 0.3)
    proc = await started("ignore")
    begun = time.monotonic()
    assert await asyncio.wait_for(stop_process(proc, "the stubborn child"), 10) == -signal.SIGKILL
    assert time.monotonic() - begun >= 0.3
    assert "the stubborn child ignored SIGTERM" in caplog.text


async def test_a_child_that_has_exited_is_left_alone_and_its_status_given():
    proc = await start_process([sys.executable, "-c", "raise SystemExit(7)"], dict(os.environ))
    await asyncio.wait_for(proc.wait(), 30)
    assert await stop_process(proc, "child") == 7


@pytest.mark.parametrize("reaped", [True, False])
async def test_stopping_a_child_that_died_already_is_no_error(reaped):
    proc = await started("obey")
    os.kill(proc.pid, signal.SIGKILL)
    if reaped:
        await asyncio.wait_for(proc.wait(), 10)
    status = await asyncio.wait_for(stop_process(proc, "child"), 10)
    # Unreaped, the status is asyncio's child watcher's to tell: it says 255 when another waiter in this
    # test process reaped that pid first (pids are reused within a long run). Either way no error.
    assert status == -signal.SIGKILL if reaped else status in (-signal.SIGKILL, 255)
