"""A real `rlx-cluster` process for tests: output collected as it comes, stopped in bounded steps.

Synchronous on purpose (a Popen and two reader threads): it belongs to no event
loop, so a fixture can stop it after pytest-asyncio has closed the test's loop.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

# Seconds the coordinator has to stop its workers after SIGTERM before it is killed.
TERM_GRACE_S = 20.0
# Seconds a worker has to exit once its coordinator is gone (it polls its parent twice a second).
WORKER_EXIT_S = 10.0
# Seconds to wait for a killed process to be reaped, and for its output to be read to the end.
REAP_S = 5.0
POLL_S = 0.05


def wait_until(check: Callable[[], object], timeout: float, what: str) -> object:
    """Poll `check` until it returns something truthy; an AssertionError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not (result := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(POLL_S)
    return result


def worker_pids(parent_pid: int) -> list[int]:
    """Live worker processes started by `parent_pid` (they carry `--parent-pid` on their command line)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # gone while we looked
            continue
        if state == "Z" or b"--parent-pid" not in argv:
            continue
        if argv[argv.index(b"--parent-pid") + 1] == str(parent_pid).encode():
            pids.append(int(entry.name))
    return pids


class CoordinatorProcess:
    """`python -m coordinator ARGS` with its stdout and stderr read by threads into lists of lines."""

    def __init__(
        self,
        args: Sequence[str],
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
        prefix: Sequence[str] = (),
    ) -> None:
        # It stops by itself once this process is gone, even if no teardown ever runs (pytest killed).
        parent = ["--exit-with-parent", str(os.getpid())]
        self.args = [*prefix, sys.executable, "-m", "coordinator", *parent, *args]
        self.proc = subprocess.Popen(
            self.args, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        self.pid = self.proc.pid
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [self._read(self.proc.stdout, self.out), self._read(self.proc.stderr, self.err)]

    @staticmethod
    def _read(stream, lines: list[str]) -> threading.Thread:
        def pump() -> None:
            with stream:
                for line in iter(stream.readline, b""):
                    lines.append(line.decode(errors="replace"))

        thread = threading.Thread(target=pump, daemon=True)
        thread.start()
        return thread

    @property
    def stdout(self) -> str:
        return "".join(self.out)

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def said(self, text: str, timeout: float = 30.0) -> None:
        """Wait until `text` is on stderr or stdout; fail early, with the output, if the process exits."""

        def check() -> bool:
            if text in self.stderr or text in self.stdout:
                return True
            if self.proc.poll() is not None:
                self._join_readers()
                if text in self.stderr or text in self.stdout:
                    return True
                raise AssertionError(
                    f"the coordinator exited with status {self.proc.returncode} before saying {text!r}; "
                    f"stderr:\n{self.stderr[-4000:]}"
                )
            return False

        wait_until(check, timeout, f"{text!r} from the coordinator; stderr so far:\n{self.stderr[-4000:]}")

    def send_signal(self, sig: int) -> None:
        """Send `sig` to the coordinator (nothing once it has exited)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def exit_code(self, timeout: float = 30.0) -> int:
        """Wait up to `timeout` s for the coordinator to exit; its status, its output read to the end."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the coordinator is still running after {timeout:g}s; stderr:\n{self.stderr[-4000:]}"
            ) from None
        self._join_readers()
        return code

    def _join_readers(self) -> None:
        for reader in self._readers:
            reader.join(REAP_S)

    def workers(self) -> list[int]:
        """The coordinator's live worker processes."""
        return worker_pids(self.pid)

    def stop(self, grace: float = TERM_GRACE_S) -> list[int]:
        """SIGTERM, `grace` s, SIGKILL; workers left WORKER_EXIT_S s after are killed and returned."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(REAP_S)
        self._join_readers()
        deadline = time.monotonic() + WORKER_EXIT_S
        while (leaked := self.workers()) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        for pid in leaked:
            _kill(pid)
        return leaked


def _kill(pid: int) -> None:
    """SIGKILL `pid` (continuing it first, in case it was paused), ignoring one already gone."""
    for sig in (signal.SIGKILL, signal.SIGCONT):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
