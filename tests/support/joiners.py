"""Workers that join a coordinator, for tests: started as `rlx-worker --join`, stopped in bounded steps."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from contextlib import suppress
from pathlib import Path

from workers.protocol import auth

TERM_GRACE_S = 3.0
KILL_WAIT_S = 5.0


class Joiner:
    """One `python -m workers --join` process and what it has written so far."""

    def __init__(self, proc: asyncio.subprocess.Process, command: list[str]) -> None:
        self.proc = proc
        self.command = command
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._readers = [
            asyncio.create_task(self._read(proc.stdout, self.stdout)),
            asyncio.create_task(self._read(proc.stderr, self.stderr)),
        ]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        """Everything it wrote on stderr, for assertions and failure messages."""
        return "\n".join(self.stderr)

    async def exited(self, timeout: float) -> int:
        """Its exit status, once it has exited by itself within `timeout` seconds."""
        status = await asyncio.wait_for(self.proc.wait(), timeout)
        await asyncio.wait_for(asyncio.gather(*self._readers), timeout)
        return status

    async def stop(self) -> None:
        """Terminate, wait a grace period, kill, wait; stop reading its output."""
        if self.proc.returncode is None:
            with suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), TERM_GRACE_S)
            except TimeoutError:
                with suppress(ProcessLookupError):
                    self.proc.kill()
                await asyncio.wait_for(self.proc.wait(), KILL_WAIT_S)
        with suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*self._readers), KILL_WAIT_S)
        for reader in self._readers:
            reader.cancel()

    def kill(self) -> None:
        """SIGKILL it, as a crash would."""
        with suppress(ProcessLookupError):
            self.proc.kill()

    @staticmethod
    async def _read(stream: asyncio.StreamReader | None, into: list[str]) -> None:
        assert stream is not None
        while line := await stream.readline():
            into.append(line.decode(errors="replace").rstrip())


class Joiners:
    """Starts joiners for one test and stops every one of them at its end."""

    def __init__(self) -> None:
        self.started: list[Joiner] = []

    async def start(
        self, coordinator: str, model: str | None, token: str | None, *extra: str, cwd: Path | None = None
    ) -> Joiner:
        """Start `rlx-worker --join coordinator --model model`, `token` in its environment (None: unset).

        model: None starts it without --model, to be told the coordinator's.
        cwd: the directory it runs in (a relative model path is resolved there); None for ours.
        """
        given = [] if model is None else ["--model", model]
        command = [sys.executable, "-P", "-m", "workers", "--join", coordinator, *given,
                   "--parent-pid", str(os.getpid()), *extra]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != auth.WORKER_TOKEN_ENV}
        if token is not None:
            env[auth.WORKER_TOKEN_ENV] = token
        proc = await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,
            cwd=cwd,
        )
        joiner = Joiner(proc, command)
        self.started.append(joiner)
        return joiner

    async def close(self) -> None:
        """Stop every joiner started, concurrently."""
        await asyncio.gather(*(j.stop() for j in self.started))
