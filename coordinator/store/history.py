"""Run history in SQLite, used from asyncio through one dedicated thread.

One row per run: id, status and created_at as columns, then the run's record
and its output as coordinator.store.rows writes them.

Durability: WAL with synchronous=NORMAL. A commit is in the WAL file (the OS
page cache) when it returns, so it survives the coordinator being SIGKILLed;
only a power loss or OS crash can drop the last commits before a checkpoint.

A file that is not ours or that this process cannot write is refused at open
with a StoreError (see coordinator.store.file). Several coordinators may
share one file: each open store is an owner (coordinator.store.owners), every
run records its owner, ids come from the one table, and every store lists
every run. The unfinished runs of an owner that is gone are taken over by a
store that can go on with them, or marked interrupted (coordinator.store.takeover):
at start (`take_over_unfinished`, `interrupt_unfinished`), and by any store open
on the file within SWEEP_EVERY_S of the owner's end; a live owner's never. A
running run's progress is written by `save_progress`, never over its end.

A store that fails to write (the write lock held past the busy timeout, a full
disk, an I/O error) keeps working in memory: it reports the failure as
`problem`, refuses new runs fast instead of waiting on the disk each time,
keeps the runs it could not save and writes them, in order, as soon as a retry
succeeds.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from coordinator.stats import ClusterRun
from coordinator.store import owners, rows
from coordinator.store.file import MEMORY, StoreError, StoreUnavailable, touch, transaction
from coordinator.store.takeover import Judge, take_gone

log = logging.getLogger(__name__)

MAX_PAGE = 1000
# Seconds a write waits for another connection's write lock before it fails.
BUSY_TIMEOUT_S = 5.0
# Seconds between tries of a store whose last write failed.
RETRY_EVERY_S = 1.0
# Seconds a retry waits for another connection's lock: short, as reads wait behind it on the store's thread.
RETRY_BUSY_S = 0.25
# Seconds between looks for the unfinished runs of other owners that are gone (a killed coordinator's).
SWEEP_EVERY_S = 2.0
INTERRUPTED_ERROR = "coordinator stopped before the run finished"
UPDATE = "UPDATE runs SET status = ?, created_at = ?, run = ?, output = ? WHERE id = ?"
# A running run's progress: written only while its row still says it runs (its end is never overwritten).
PROGRESS = "UPDATE runs SET run = ?, output = ? WHERE id = ? AND status = 'running'"

T = TypeVar("T")


def default_path() -> Path:
    """Return $XDG_STATE_HOME/rlx-cluster/runs.sqlite3, else under ~/.local/state."""
    state = os.environ.get("XDG_STATE_HOME", "")
    # The XDG spec says a relative path there is invalid and must be ignored.
    base = Path(state) if os.path.isabs(state) else Path.home() / ".local" / "state"
    return base / "rlx-cluster" / "runs.sqlite3"


def _name(path: str | Path) -> str:
    return str(path) if str(path) == MEMORY else str(Path(path).expanduser())


class RunStore:
    """Run history in one SQLite file; every method runs on the store's own thread."""

    def __init__(
        self, name: str, conn: sqlite3.Connection, executor: ThreadPoolExecutor, lock: int | None,
        retry_every: float, busy_timeout: float, owner: str, claim: owners.Claim | None,
    ) -> None:  # fmt: skip
        self.name = name
        self.owner = owner  # the id every run this store creates is stored with
        self._claim = claim
        self._busy_timeout = busy_timeout
        self._conn = conn
        self._executor = executor
        self._lock = lock
        self._retry_every = retry_every
        self._closed = False
        self._problem: str | None = None
        # Runs whose save failed, oldest first, written by the retry task as soon as the store works.
        self._pending: dict[int, ClusterRun] = {}
        self._retry: asyncio.Task | None = None
        self._working = asyncio.Event()
        self._working.set()
        self._takeover: tuple[Judge, Callable[[list[ClusterRun]], None]] | None = None
        self._judged = asyncio.Event()  # the sweep may judge runs: how was said, or they are interrupted
        self._sweep = asyncio.create_task(self._sweep_gone_owners()) if claim is not None else None

    @classmethod
    async def open(
        cls, path: str | Path, busy_timeout: float = BUSY_TIMEOUT_S, retry_every: float = RETRY_EVERY_S,
        takes_over: bool = False,
    ) -> RunStore:  # fmt: skip
        """Open or create the store at `path` (":memory:" for a throw-away one).

        busy_timeout: seconds a write waits for another connection's lock.
        retry_every: seconds between tries of a store whose last write failed.
        takes_over: the store's owner will take over the runs of coordinators that go (take_over_with):
            until it says how, the sweep leaves them as they are rather than mark them interrupted.
        """
        for option, value in (("busy_timeout", busy_timeout), ("retry_every", retry_every)):
            if not value > 0:
                raise ValueError(f"{option} must be a positive number of seconds, got {value}")
        name, owner = _name(path), owners.new_id()
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="run-store")
        try:
            conn, lock, claim = await asyncio.get_running_loop().run_in_executor(
                executor, owners.connect_as, name, owner, busy_timeout
            )
        except BaseException:
            executor.shutdown(wait=True)
            raise
        store = cls(name, conn, executor, lock, retry_every, busy_timeout, owner, claim)
        if not takes_over:
            store._judged.set()
        return store

    @property
    def problem(self) -> str | None:
        """Why the store cannot write now (naming the file and the cause), or None when it works."""
        if self._problem is None:
            return None
        unsaved = f"; run(s) {', '.join(map(str, self._pending))} not saved yet" if self._pending else ""
        return f"{self._problem} (retrying every {self._retry_every:g} s){unsaved}"

    async def working(self) -> None:
        """Wait until the store can write (at once when it can)."""
        await self._working.wait()

    async def close(self) -> None:
        """Try once more to save what is pending, close the file and release its lock; later calls raise."""
        if self._closed:
            return
        self._closed = True
        loop = asyncio.get_running_loop()
        try:
            for task in (self._retry, self._sweep):
                if task is not None:
                    task.cancel()
                    with suppress(asyncio.CancelledError):
                        await task
            if self._pending:
                try:
                    runs = list(self._pending.values())
                    await loop.run_in_executor(self._executor, self._flush, runs, self._busy_timeout)
                    self._pending.clear()
                except sqlite3.Error as exc:
                    ids = ", ".join(map(str, self._pending))
                    log.error("%s: run(s) %s could not be saved before closing: %s", self.name, ids, exc)
            await loop.run_in_executor(self._executor, self._conn.close)
        finally:
            self._executor.shutdown(wait=True)
            if self._claim is not None:
                self._claim.release()  # last: its runs are all written by now
            if self._lock is not None:
                os.close(self._lock)  # closing the descriptor releases the flock

    async def create(self, run: ClusterRun) -> int:
        """Insert `run` as a new row, set `run.id` (and `created_at` if unset), return the id."""
        if not run.created_at:
            run.created_at = time.time()
        run.id = await self._write("store a new run", self._insert, run)
        return run.id

    async def save(self, run: ClusterRun) -> None:
        """Replace the stored row `run.id` with `run`'s current content, committed.

        Raises StoreUnavailable when the store cannot write: see save_later.
        """
        await self._write(f"save run {run.id}", self._update, run)

    def save_later(self, run: ClusterRun) -> None:
        """Keep `run` (replacing an earlier kept version) and write it when the store works again."""
        self._pending.pop(run.id, None)
        self._pending[run.id] = run
        if self._problem is None:
            self._problem = f"{self.name}: run {run.id} is waiting to be saved"
            self._start_retrying()

    async def get(self, run_id: int, with_output: bool = False) -> ClusterRun | None:
        """Return run `run_id`, or None when there is no such run."""
        cols = "id, run, output" if with_output else "id, run"
        sql = f"SELECT {cols} FROM runs WHERE id = ?"
        rows = await self._call(f"read run {run_id}", self._rows, sql, (run_id,))
        return self._newest(rows, with_output)[0] if rows else None

    async def latest(self, with_output: bool = False) -> ClusterRun | None:
        """Return the newest run, or None when there are none."""
        cols = "id, run, output" if with_output else "id, run"
        sql = f"SELECT {cols} FROM runs ORDER BY id DESC LIMIT 1"
        rows = await self._call("read the latest run", self._rows, sql, ())
        return self._newest(rows, with_output)[0] if rows else None

    async def list(self, limit: int = 50, before: int | None = None) -> list[ClusterRun]:
        """Return up to `limit` runs, newest first, with ids below `before`; outputs left empty."""
        if not 1 <= limit <= MAX_PAGE:
            raise ValueError(f"limit must be between 1 and {MAX_PAGE}, got {limit}")
        if before is None:
            sql, args = "SELECT id, run FROM runs ORDER BY id DESC LIMIT ?", (limit,)
        else:
            sql, args = "SELECT id, run FROM runs WHERE id < ? ORDER BY id DESC LIMIT ?", (before, limit)
        return self._newest(await self._call("list runs", self._rows, sql, args), False)

    async def interrupt_unfinished(self) -> int:
        """Mark runs left queued or running by coordinators that are gone as interrupted; return how many.

        Another live coordinator's runs, and this store's own, go on: they are left alone.
        """
        _, n = await self._write(
            "mark unfinished runs interrupted", self._take_gone, _interrupted, self._busy_timeout
        )
        return n

    async def take_over_unfinished(self, judge: Judge) -> tuple[list[ClusterRun], int]:
        """Take over the runs left queued or running by coordinators that are gone, as `judge` allows.

        Returns the runs taken over (now this store's, oldest first, status as left) and how many the
        judge turned down, marked interrupted with its reason. A live coordinator's are left alone.
        """
        return await self._write("take over unfinished runs", self._take_gone, judge, self._busy_timeout)

    def take_over_with(self, judge: Judge, take: Callable[[list[ClusterRun]], None]) -> None:
        """Sweep from now on by `judge` the runs of coordinators that go, handing `take` those taken over."""
        self._takeover = (judge, take)
        self._judged.set()

    async def save_progress(self, runs: list[ClusterRun]) -> None:
        """Write running runs' records (tokens so far) in one transaction, unless the store is failing.

        Waits RETRY_BUSY_S at most for another connection's lock: a write that fails is the caller's to
        try again later, and it does not stop the store taking runs (the final save says that).
        """
        if self._problem is not None:
            raise StoreUnavailable(self._problem)
        await self._call(f"save the progress of {len(runs)} run(s)", self._flush_progress, runs)

    def _newest(self, runs: list[ClusterRun], with_output: bool) -> list[ClusterRun]:
        """`runs` as read, with the versions waiting to be saved in place of their stored rows."""
        if not self._pending:
            return runs
        newer = [self._pending.get(r.id, r) for r in runs]
        return newer if with_output else [msgspec.structs.replace(r, output=[]) for r in newer]

    async def _write(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        """Call `fn` on the store's thread unless the store is failing; a failure starts the retries."""
        if self._problem is not None and not self._closed:
            raise StoreUnavailable(self._problem)
        try:
            return await self._call(what, self._unless_failing, fn, *args)
        except StoreUnavailable as exc:
            if not self._closed:
                self._problem = str(exc)
                self._start_retrying()
            raise

    async def _call(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        if self._closed:
            raise StoreError(f"{self.name}: cannot {what}: the run store is closed")
        try:
            call = functools.partial(fn, *args)
            return await asyncio.get_running_loop().run_in_executor(self._executor, call)
        except sqlite3.Error as exc:
            raise StoreUnavailable(f"{self.name}: cannot {what}: {exc}") from exc

    async def _sweep_gone_owners(self) -> None:
        """Every SWEEP_EVERY_S, mark interrupted the unfinished runs of other owners that have gone since."""
        await self._judged.wait()
        while True:
            await asyncio.sleep(SWEEP_EVERY_S)
            if self._problem is not None:
                continue  # the retries are at work: no write of ours would succeed before theirs
            try:
                # Not a _write: a sweep that fails is tried again, it does not stop the store taking runs.
                judge, take = self._takeover or (_interrupted, None)
                what = "take over the runs of gone coordinators"
                taken, n = await self._call(what, self._take_gone, judge, RETRY_BUSY_S)
            except StoreError as exc:
                log.info("%s (tried again in %g s)", exc, SWEEP_EVERY_S)
                continue
            if taken and take is not None:
                log.warning("%s: %d run(s) of a coordinator that is gone taken over", self.name, len(taken))
                take(taken)
            if n:
                log.warning("%s: %d run(s) of a coordinator that is gone marked interrupted", self.name, n)

    def _start_retrying(self) -> None:
        self._working.clear()
        if self._retry is None or self._retry.done():
            self._retry = asyncio.create_task(self._retry_until_written())

    async def _retry_until_written(self) -> None:
        """Every retry_every seconds write what is pending (a probe when nothing is) until it succeeds."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self._retry_every)
            runs = list(self._pending.values())
            try:
                await loop.run_in_executor(self._executor, self._flush, runs, RETRY_BUSY_S)
            except sqlite3.Error as exc:
                self._problem = f"{self.name}: cannot write: {exc}"
                continue
            for run in runs:
                if self._pending.get(run.id) is run:  # not replaced meanwhile by a newer version
                    del self._pending[run.id]
            if not self._pending:
                saved = f"; saved run(s) {', '.join(str(r.id) for r in runs)}" if runs else ""
                log.warning("%s: the run store works again%s", self.name, saved)
                self._problem = None
                self._working.set()
                return

    # Everything below runs on the store's thread.

    def _unless_failing(self, fn: Callable[..., T], *args: Any) -> T:
        """Call `fn` unless a write queued before it has failed meanwhile (it would wait out the timeout)."""
        if self._problem is not None:
            raise StoreUnavailable(self._problem)
        try:
            return fn(*args)
        except sqlite3.Error as exc:
            # Recorded here, on the store's thread, so a write already queued behind this one
            # fails at once instead of waiting out the busy timeout again.
            self._problem = f"{self.name}: cannot write: {exc}"
            raise

    def _insert(self, run: ClusterRun) -> int:
        meta, output = rows.encode(run)
        cur = self._conn.execute(
            "INSERT INTO runs (status, created_at, run, output, owner) VALUES (?, ?, ?, ?, ?)",
            (run.status, run.created_at, meta, output, self.owner),
        )
        return cur.lastrowid

    def _update(self, run: ClusterRun) -> None:
        meta, output = rows.encode(run)
        cur = self._conn.execute(UPDATE, (run.status, run.created_at, meta, output, run.id))
        if cur.rowcount != 1:
            raise StoreError(f"{self.name}: cannot save run {run.id}: no such run (create it first)")

    def _flush(self, runs: list[ClusterRun], busy_timeout: float) -> None:
        """Write `runs` in one transaction, with a real write even when there are none."""
        with self._waiting(busy_timeout), transaction(self._conn):
            for run in runs:
                meta, output = rows.encode(run)
                cur = self._conn.execute(UPDATE, (run.status, run.created_at, meta, output, run.id))
                if cur.rowcount != 1:  # its row was deleted by hand meanwhile: nothing to update
                    log.warning("%s: run %d was removed before it could be saved", self.name, run.id)
            touch(self._conn)

    @contextmanager
    def _waiting(self, busy_timeout: float) -> Iterator[None]:
        """Wait at most `busy_timeout` (never more than the store's) for another connection's lock."""
        wait_ms = int(min(busy_timeout, self._busy_timeout) * 1000)
        self._conn.execute(f"PRAGMA busy_timeout = {wait_ms}")
        try:
            yield
        finally:
            self._conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout * 1000)}")

    def _rows(self, sql: str, args: tuple) -> list[ClusterRun]:
        return [rows.decode(self.name, *row) for row in self._conn.execute(sql, args)]

    def _take_gone(self, judge: Judge, busy_timeout: float) -> tuple[list[ClusterRun], int]:
        """Take over or interrupt the unfinished runs of other owners that are gone (see store.takeover)."""
        with self._waiting(busy_timeout):
            return take_gone(self._conn, self.name, self.owner, judge)

    def _flush_progress(self, runs: list[ClusterRun]) -> None:
        """Write running runs' records in one transaction; one whose row says it ended is left as it is."""
        with self._waiting(RETRY_BUSY_S), transaction(self._conn):
            for run in runs:
                meta, output = rows.encode(run)
                self._conn.execute(PROGRESS, (meta, output, run.id))


def _interrupted(run: ClusterRun) -> str:
    """The judge that takes over no run: each is marked interrupted, as the coordinator stopped."""
    return INTERRUPTED_ERROR
