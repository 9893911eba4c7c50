"""Opening the run store's SQLite file: refuse what is not ours, lock it, set it up, prove it writable.

Nothing is written before the file has been checked, so a file that is not
ours (not SQLite, damaged, another program's schema, a newer schema) is left
exactly as it was. A file of an older schema is migrated in place, its runs
kept.

Several coordinators share one file: SQLite serializes their writes, and
each run names the coordinator that owns it (coordinator.store.owners). Each
holds a shared flock on `<file>.lock` while it has the file open. Coordinators
of schema 1 took that lock exclusively, as they could not share the file: one
of them holding it keeps this version out (it would take its live runs for
orphans), and this version holding it keeps them out. The kernel releases a
flock when its holder exits however it exits, so a crashed coordinator leaves
no stale lock behind.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import sqlite3
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MEMORY = ":memory:"
SQLITE_MAGIC = b"SQLite format 3\x00"
# Marks the file as ours in the SQLite header ("rlxc"), next to user_version.
APPLICATION_ID = 0x726C7863
SCHEMA_VERSION = 2
LOCK_SUFFIX = ".lock"
OWNERS_SUFFIX = ".owners"  # the directory of the owners' locks (coordinator.store.owners)

SCHEMA = """
CREATE TABLE runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    status TEXT NOT NULL,
    created_at REAL NOT NULL,
    run BLOB NOT NULL,
    output BLOB NOT NULL,
    owner TEXT NOT NULL DEFAULT ''
);
CREATE INDEX runs_unfinished ON runs(status) WHERE status IN ('queued', 'running');
"""
COLUMNS = ["id", "status", "created_at", "run", "output", "owner"]
# The runs table's columns at each schema version this program reads.
COLUMNS_AT = {1: COLUMNS[:5], 2: COLUMNS}
# What takes a file from version v to v + 1. Schema 1 had one coordinator per file: its runs' owner is
# "" (no live owner), so their unfinished ones are marked interrupted, as schema 1 itself did.
MIGRATIONS = {1: ["ALTER TABLE runs ADD COLUMN owner TEXT NOT NULL DEFAULT ''"]}


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
    """Take a shared lock on `<path>.lock`, or name the older coordinator that holds it exclusively.

    The kernel releases a flock when its holder exits however it exits, so a
    crashed coordinator leaves no stale lock behind; the file only says who
    (an older coordinator wrote its pid and host there).
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
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        holder = _holder(fd)
        os.close(fd)
        raise StoreError(
            f"{path}: the run store is in use by a coordinator of an older version, which cannot share "
            f"it ({holder}, see {lock_path}); stop it or use another file"
        ) from None
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
            f"{path.name}-wal, -shm, {LOCK_SUFFIX} and {OWNERS_SUFFIX}/ beside the file"
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
    if version not in COLUMNS_AT:
        raise StoreError(
            f"{name}: the run store has schema version {version}, which this program never wrote"
        )
    if columns != COLUMNS_AT[version]:
        expected = COLUMNS_AT[version]
        raise StoreError(f"{name}: the run store's runs table has columns {columns}, expected {expected}")


def _set_up(name: str, conn: sqlite3.Connection) -> None:
    """Switch to WAL; create the schema if the database is new, migrate it if it is older."""
    try:
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if name != MEMORY and mode != "wal":
            log.warning("%s: journal mode is %s, not wal (WAL unsupported on this filesystem?)", name, mode)
        conn.execute("PRAGMA synchronous=NORMAL")
        with transaction(conn):
            # Read under the write lock: another process may have just set it up or migrated it.
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if conn.execute("PRAGMA application_id").fetchone()[0] != APPLICATION_ID:
                # One by one: executescript() would COMMIT the transaction first.
                statements = list(filter(str.strip, SCHEMA.split(";")))
                statements.append(f"PRAGMA application_id = {APPLICATION_ID}")
            elif version < SCHEMA_VERSION:
                statements = [sql for v in range(version, SCHEMA_VERSION) for sql in MIGRATIONS[v]]
                log.info("%s: migrating the run store from schema %d to %d", name, version, SCHEMA_VERSION)
            else:
                return
            for statement in statements:
                conn.execute(statement)
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
