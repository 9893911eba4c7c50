"""Stop the coordinator once the process that started it is gone (`--exit-with-parent PID`).

The pytest fixture starts every coordinator so: a pytest that dies without its
teardown (SIGKILL, a timeout that ends the process) leaves none behind. As a
worker does with its coordinator, the kernel's parent-death signal says so at
once and a poll twice a second says so where there is none; either stops the
coordinator as SIGTERM does (workers stopped, the run in progress stored
`interrupted`). One that has not ended PARENT_GONE_GRACE_S later is killed; its
workers then die by their own parent-death signal.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from contextlib import suppress

log = logging.getLogger("coordinator")

PARENT_POLL_S = 0.5
# Seconds a coordinator whose parent is gone has to stop by itself before it is killed.
PARENT_GONE_GRACE_S = 10.0
# The kernel sends the parent-death signal when the thread that started us ends, which need not be
# the whole parent (a test may start a cluster from a thread): so it is one that only makes us look.
PARENT_DEATH_SIGNAL = signal.SIGUSR1
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent(pid: int) -> None:
    """Ask the kernel to signal us when our parent dies; exit now if process `pid` no longer is it."""
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(PARENT_DEATH_SIGNAL), 0, 0, 0) != 0:
            log.warning("no parent-death signal: prctl failed: %s", os.strerror(ctypes.get_errno()))
    # A parent that died before prctl took effect sends nothing: look once more.
    if os.getppid() != pid:
        sys.exit(f"rlx-cluster: parent {pid} is gone (our parent is now {os.getppid()}); not starting")


def watch_parent(pid: int, stop: Callable[[], None]) -> asyncio.Task:
    """Call `stop` once process `pid` is no longer our parent, and kill us if we then outstay the grace."""
    loop = asyncio.get_running_loop()
    told = asyncio.Event()
    loop.add_signal_handler(PARENT_DEATH_SIGNAL, told.set)

    async def watch() -> None:
        while True:
            told.clear()
            if os.getppid() != pid:
                break
            with suppress(TimeoutError):
                async with asyncio.timeout(PARENT_POLL_S):
                    await told.wait()
        log.warning("parent %d is gone; stopping as on SIGTERM", pid)
        # A thread, not the loop: the kill must come even if stopping blocks the loop.
        killer = threading.Timer(PARENT_GONE_GRACE_S, os.kill, (os.getpid(), signal.SIGKILL))
        killer.daemon = True
        killer.start()
        stop()

    return loop.create_task(watch())
