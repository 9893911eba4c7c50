"""Opening the run store's SQLite file: refuse what is not ours, lock it, set it up, prove it writable.

Nothing is written before the file has been checked, so a file that is not
ours (not SQLite, damaged, another program's schema, a newer schema) is left
exactly as it was. The lock is an exclusive flock on `<file>.lock`, which
names its holder; the kernel releases it when the holder exits however it
exits, so a crashed coordinator leaves no stale lock behind.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import sqlite3
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MEMORY = ":memory:"
SQLITE_MAGIC = b"SQLite format 3\x00"
# Marks the file as ours in the SQLite header ("rlxc"), next to user_version.
APPLICATION_ID = 0x726C7863
SCHEMA_VERSION = 1
LOCK_SUFFIX = ".lock"

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


class StoreError(Exception):
    """The run store's file is unusable, or a stored run cannot be read or written."""


class StoreUnavailable(StoreError):
    """The store cannot write now (locked, full, read-only, I/O error); it retries on its own."""


def touch(conn: sqlite3.Connection) -> None:
    """Rewrite the header's user_version unchanged: a real write that proves the file takes writes."""
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    conn.execute(f"PRAGMA user_version = {int(version)}")


def connect(name: str, busy_timeout: float) -> tuple[sqlite3.Connection, int | None]:
    """Open `name`: check it is a healthy store of ours (or empty), lock it, set it up, try a write."""
    if name != MEMORY:
        _check_file(Path(name))
    try:
        # Autocommit: each statement outside an explicit BEGIN commits as it returns.
        conn = sqlite3.connect(name, timeout=busy_timeout, isolation_level=None)
    except sqlite3.Error as exc:
        raise StoreError(f"{name}: cannot open the run store: {exc}") from exc
    lock = None
    try:
        _check_db(name, conn)
        lock = None if name == MEMORY else _lock(Path(name))
        _set_up(name, conn)
        with transaction(conn):
            touch(conn)
    except sqlite3.Error as exc:
        _release(conn, lock)
        raise StoreError(f"{name}: cannot write to the run store: {exc}") from exc
    except BaseException:
        _release(conn, lock)
        raise
    return conn, lock


def _release(conn: sqlite3.Connection, lock: int | None) -> None:
    conn.close()
    if lock is not None:
        os.close(lock)


def _lock(path: Path) -> int:
    """Take the exclusive lock on `<path>.lock` for this process, or name who holds it.

    The kernel releases a flock when its holder exits however it exits, so a
    crashed coordinator leaves no stale lock behind; the file only says who.
    """
    lock_path = path.with_name(path.name + LOCK_SUFFIX)
    try:
        # CLOEXEC: a worker process must not inherit the lock and outlive its coordinator with it.
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise StoreError(
            f"{path}: cannot create the run store's lock file {lock_path}: {exc.strerror}"
        ) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = _holder(fd)
        os.close(fd)
        raise StoreError(
            f"{path}: the run store is in use by another coordinator ({holder}, see {lock_path}); "
            "stop it or use another file"
        ) from None
    me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me).encode() + b"\n", 0)
    return fd


def _holder(fd: int) -> str:
    """Who holds the lock, as its lock file says."""
    try:
        said = json.loads(os.pread(fd, 4096, 0))
        return f"pid {int(said['pid'])} on host {said['host']}"
    except (OSError, ValueError, TypeError, KeyError):
        return "a process that has not said who it is yet"


def _check_file(path: Path) -> None:
    """Refuse a path that is a directory, unreadable, read-only, not SQLite, or in a read-only directory."""
    if path.is_dir():
        example = path / "runs.sqlite3"
        raise StoreError(f"{path}: is a directory; the run store needs a file path (e.g. {example})")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError(f"{path}: cannot create the run store's directory: {exc}") from exc
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise StoreError(
            f"{path}: the run store's directory {path.parent} is not writable, and the store keeps "
            f"{path.name}-wal, {path.name}-shm and {path.name}{LOCK_SUFFIX} beside the file"
        )
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
    if not os.access(path, os.W_OK):
        raise StoreError(f"{path}: the run store's file is read-only; make it writable or use another file")


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
        with transaction(conn):
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


class transaction:
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
