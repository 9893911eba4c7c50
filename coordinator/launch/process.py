"""Start a child process with its output piped, and stop it in bounded steps: terminate, grace, kill, wait."""

from __future__ import annotations

import asyncio
import logging
import signal
from contextlib import suppress

from coordinator.launch.base import KILL_WAIT, TERM_GRACE

log = logging.getLogger("coordinator.launch.process")

# The longest line read from a child's stdout or stderr; asyncio's default (64 KiB) is short for a log line.
STREAM_LIMIT = 1 << 20


async def start_process(command: list[str], env: dict[str, str]) -> asyncio.subprocess.Process:
    """Start `command` with exactly `env`, stdin closed, stdout and stderr piped, in a session of its own.

    A session of its own: a terminal's Ctrl-C reaches only the coordinator,
    which then stops the child itself, in order.
    """
    return await asyncio.create_subprocess_exec(
        *command,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
        start_new_session=True,
        limit=STREAM_LIMIT,
    )


async def stop_process(proc: asyncio.subprocess.Process, name: str) -> int | None:
    """Terminate, wait TERM_GRACE, kill, wait KILL_WAIT: the exit status, None if even a kill took longer."""
    if proc.returncode is not None:
        return proc.returncode
    with suppress(ProcessLookupError):
        proc.terminate()
        # A stopped worker (SIGSTOP: the hung stage a forward timed out on) acts on SIGTERM only once
        # continued; without this its replacement would wait out the whole grace.
        proc.send_signal(signal.SIGCONT)
    try:
        await asyncio.wait_for(proc.wait(), TERM_GRACE)
    except TimeoutError:
        log.warning("%s ignored SIGTERM for %.0fs; killing it", name, TERM_GRACE)
        with suppress(ProcessLookupError):
            proc.kill()
        with suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), KILL_WAIT)
    return proc.returncode
