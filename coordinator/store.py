"""Run history in SQLite, used from asyncio through one dedicated thread.

One row per run: id, status and created_at as columns, the ClusterRun without
its output as JSON, and the output as raw float32 bytes in a BLOB stored last,
so listing runs never reads or decodes outputs. Outputs come back as float32
values (they are float32 tensors on the wire anyway).

Durability: WAL with synchronous=NORMAL. A commit is in the WAL file (the OS
page cache) when it returns, so it survives the coordinator being SIGKILLed;
only a power loss or OS crash can drop the last commits before a checkpoint.

A file that is not ours (not SQLite, damaged, another program's schema, a
newer schema) is refused at open with a StoreError and left exactly as it was:
nothing is written before the file has been checked.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import numpy as np

from coordinator.stats import ClusterRun

log = logging.getLogger(__name__)

MEMORY = ":memory:"
SQLITE_MAGIC = b"SQLite format 3\x00"
# Marks the file as ours in the SQLite header ("rlxc"), next to user_version.
APPLICATION_ID = 0x726C7863
SCHEMA_VERSION = 1
MAX_PAGE = 1000
BUSY_TIMEOUT_S = 5.0
UNFINISHED = ("queued", "running")
INTERRUPTED_ERROR = "coordinator stopped before the run finished"

SCHEMA = """
CREATE TABLE runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    status TEXT NOT NULL,
    created_at REAL NOT NULL,
    run BLOB NOT NULL,
    output BLOB NOT NULL
);
CREATE INDEX runs_unfinished ON runs(status) WHERE status IN ('queued', 'running');
"""
COLUMNS = ["id", "status", "created_at", "run", "output"]

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(ClusterRun)

T = TypeVar("T")


class StoreError(Exception):
    """The run store's file is unusable, or a stored run cannot be read or written."""


def default_path() -> Path:
    """Return $XDG_STATE_HOME/rlx-cluster/runs.sqlite3, else under ~/.local/state."""
    state = os.environ.get("XDG_STATE_HOME", "")
    # The XDG spec says a relative path there is invalid and must be ignored.
    base = Path(state) if os.path.isabs(state) else Path.home() / ".local" / "state"
    return base / "rlx-cluster" / "runs.sqlite3"


class RunStore:
    """Run history in one SQLite file; every method runs on the store's own thread."""

    def __init__(self, name: str, conn: sqlite3.Connection, executor: ThreadPoolExecutor) -> None:
        self.name = name
        self._conn = conn
        self._executor = executor
        self._closed = False

    @classmethod
    async def open(cls, path: str | Path) -> RunStore:
        """Open or create the store at `path` (":memory:" for a throw-away one)."""
        name = str(path) if str(path) == MEMORY else str(Path(path).expanduser())
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="run-store")
        try:
            conn = await asyncio.get_running_loop().run_in_executor(executor, _connect, name)
        except BaseException:
            executor.shutdown(wait=True)
            raise
        return cls(name, conn, executor)

    async def close(self) -> None:
        """Close the connection and stop the store's thread; later calls raise."""
        if self._closed:
            return
        self._closed = True
        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, self._conn.close)
        finally:
            self._executor.shutdown(wait=True)

    async def create(self, run: ClusterRun) -> int:
        """Insert `run` as a new row, set `run.id` (and `created_at` if unset), return the id."""
        if not run.created_at:
            run.created_at = time.time()
        run.id = await self._call("store a new run", self._insert, run)
        return run.id

    async def save(self, run: ClusterRun) -> None:
        """Replace the stored row `run.id` with `run`'s current content, committed."""
        await self._call(f"save run {run.id}", self._update, run)

    async def get(self, run_id: int, with_output: bool = False) -> ClusterRun | None:
        """Return run `run_id`, or None when there is no such run."""
        cols = "id, run, output" if with_output else "id, run"
        sql = f"SELECT {cols} FROM runs WHERE id = ?"
        rows = await self._call(f"read run {run_id}", self._rows, sql, (run_id,))
        return rows[0] if rows else None

    async def latest(self, with_output: bool = False) -> ClusterRun | None:
        """Return the newest run, or None when there are none."""
        cols = "id, run, output" if with_output else "id, run"
        sql = f"SELECT {cols} FROM runs ORDER BY id DESC LIMIT 1"
        rows = await self._call("read the latest run", self._rows, sql, ())
        return rows[0] if rows else None

    async def list(self, limit: int = 50, before: int | None = None) -> list[ClusterRun]:
        """Return up to `limit` runs, newest first, with ids below `before`; outputs left empty."""
        if not 1 <= limit <= MAX_PAGE:
            raise ValueError(f"limit must be between 1 and {MAX_PAGE}, got {limit}")
        if before is None:
            sql, args = "SELECT id, run FROM runs ORDER BY id DESC LIMIT ?", (limit,)
        else:
            sql, args = "SELECT id, run FROM runs WHERE id < ? ORDER BY id DESC LIMIT ?", (before, limit)
        return await self._call("list runs", self._rows, sql, args)

    async def interrupt_unfinished(self) -> int:
        """Mark runs left queued or running by a previous coordinator as interrupted; return how many."""
        return await self._call("mark unfinished runs interrupted", self._interrupt)

    async def _call(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        if self._closed:
            raise StoreError(f"{self.name}: cannot {what}: the run store is closed")
        try:
            call = functools.partial(fn, *args)
            return await asyncio.get_running_loop().run_in_executor(self._executor, call)
        except sqlite3.Error as exc:
            raise StoreError(f"{self.name}: cannot {what}: {exc}") from exc

    # Everything below runs on the store's thread.

    def _insert(self, run: ClusterRun) -> int:
        meta, output = _encode(run)
        cur = self._conn.execute(
            "INSERT INTO runs (status, created_at, run, output) VALUES (?, ?, ?, ?)",
            (run.status, run.created_at, meta, output),
        )
        return cur.lastrowid

    def _update(self, run: ClusterRun) -> None:
        meta, output = _encode(run)
        cur = self._conn.execute(
            "UPDATE runs SET status = ?, created_at = ?, run = ?, output = ? WHERE id = ?",
            (run.status, run.created_at, meta, output, run.id),
        )
        if cur.rowcount != 1:
            raise StoreError(f"{self.name}: cannot save run {run.id}: no such run (create it first)")

    def _rows(self, sql: str, args: tuple) -> list[ClusterRun]:
        return [self._decode(*row) for row in self._conn.execute(sql, args)]

    def _decode(self, run_id: int, meta: Any, output: Any = None) -> ClusterRun:
        try:
            run = _decoder.decode(meta)
        except (msgspec.DecodeError, TypeError, ValueError) as exc:
            raise StoreError(f"{self.name}: run {run_id} is damaged and cannot be read: {exc}") from exc
        run.id = run_id
        if output is not None:
            if not isinstance(output, bytes) or len(output) % 4:
                raise StoreError(
                    f"{self.name}: run {run_id} is damaged: its output is not float32 bytes "
                    f"({type(output).__name__} of length {len(output) if isinstance(output, bytes) else '?'})"
                )
            run.output = np.frombuffer(output, np.float32).tolist()
        return run

    def _interrupt(self) -> int:
        with _transaction(self._conn):
            rows = self._conn.execute(
                "SELECT id, run FROM runs WHERE status IN (?, ?)", UNFINISHED
            ).fetchall()
            for run_id, meta in rows:
                try:
                    run = self._decode(run_id, meta)
                except StoreError as exc:
                    # Still mark it, so it is not taken for live; reading it reports the damage.
                    log.warning("%s", exc)
                    self._conn.execute("UPDATE runs SET status = 'interrupted' WHERE id = ?", (run_id,))
                    continue
                run.status = "interrupted"
                run.error = INTERRUPTED_ERROR
                self._conn.execute(
                    "UPDATE runs SET status = ?, run = ? WHERE id = ?", (run.status, _encode(run)[0], run_id)
                )
        return len(rows)


class _transaction:
    """BEGIN IMMEDIATE … COMMIT on an autocommit connection, ROLLBACK on error."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def __enter__(self) -> None:
        self.conn.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.conn.execute("COMMIT")
        elif self.conn.in_transaction:  # some errors have already rolled it back
            self.conn.execute("ROLLBACK")


def _encode(run: ClusterRun) -> tuple[bytes, bytes]:
    meta = _encoder.encode(msgspec.structs.replace(run, output=[]))
    return meta, np.asarray(run.output, np.float32).tobytes()


def _connect(name: str) -> sqlite3.Connection:
    """Open `name`, check it is a healthy store of ours (or empty), then set it up."""
    if name != MEMORY:
        _check_file(Path(name))
    try:
        # Autocommit: each statement outside an explicit BEGIN commits as it returns.
        conn = sqlite3.connect(name, timeout=BUSY_TIMEOUT_S, isolation_level=None)
    except sqlite3.Error as exc:
        raise StoreError(f"{name}: cannot open the run store: {exc}") from exc
    try:
        _check_db(name, conn)
        _set_up(name, conn)
    except BaseException:
        conn.close()
        raise
    return conn


def _check_file(path: Path) -> None:
    """Refuse a path that is a directory, unreadable, or a file that is not SQLite."""
    if path.is_dir():
        example = path / "runs.sqlite3"
        raise StoreError(f"{path}: is a directory; the run store needs a file path (e.g. {example})")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError(f"{path}: cannot create the run store's directory: {exc}") from exc
    if not path.exists():
        return
    if not path.is_file():
        raise StoreError(f"{path}: is not a regular file; the run store needs a SQLite file")
    try:
        with path.open("rb") as f:
            head = f.read(len(SQLITE_MAGIC))
    except OSError as exc:
        raise StoreError(f"{path}: cannot read the run store: {exc}") from exc
    # An empty file is a valid empty SQLite database.
    if head and head != SQLITE_MAGIC:
        raise StoreError(
            f"{path}: is not a SQLite database (it starts with {head[:16]!r}); refusing to use it"
        )


def _check_db(name: str, conn: sqlite3.Connection) -> None:
    """Raise StoreError unless the database is intact and ours or empty; write nothing."""
    try:
        problems = [row[0] for row in conn.execute("PRAGMA quick_check(5)")]
        if problems != ["ok"]:
            lines = [line for p in problems for line in p.splitlines() if not line.startswith("***")]
            raise StoreError(f"{name}: the run store is damaged: {'; '.join(lines)}")
        app_id = conn.execute("PRAGMA application_id").fetchone()[0]
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        objects = sorted(
            f"{kind} {name}"
            for kind, name in conn.execute("SELECT type, name FROM sqlite_master")
            if not name.startswith("sqlite_")
        )
        columns = [row[1] for row in conn.execute("PRAGMA table_info(runs)")]
    except sqlite3.DatabaseError as exc:
        raise StoreError(f"{name}: the run store is damaged or not a SQLite database: {exc}") from exc
    if app_id == 0 and not objects:
        return  # new or empty: ours to set up
    if app_id != APPLICATION_ID:
        raise StoreError(
            f"{name}: is a SQLite database of another program (application_id {app_id:#x}, "
            f"holding {', '.join(objects) or 'nothing'}), not an rlx-cluster run store; refusing to use it"
        )
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"{name}: the run store has schema version {version}, newer than this program's {SCHEMA_VERSION}"
        )
    if columns != COLUMNS:
        raise StoreError(f"{name}: the run store's runs table has columns {columns}, expected {COLUMNS}")


def _set_up(name: str, conn: sqlite3.Connection) -> None:
    """Switch to WAL and create the schema if the database is new."""
    try:
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if name != MEMORY and mode != "wal":
            log.warning("%s: journal mode is %s, not wal (WAL unsupported on this filesystem?)", name, mode)
        conn.execute("PRAGMA synchronous=NORMAL")
        with _transaction(conn):
            # Checked under the write lock: another process may have just set it up.
            if conn.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID:
                return
            # One by one: executescript() would COMMIT the transaction first.
            for statement in filter(str.strip, SCHEMA.split(";")):
                conn.execute(statement)
            conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    except sqlite3.Error as exc:
        raise StoreError(f"{name}: cannot set up the run store: {exc}") from exc
