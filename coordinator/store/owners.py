"""Who owns a stored run, and whether that owner still lives: one lock per open store, held until it exits.

Several coordinators may share one run store's file. Each open store is an
owner, with an id of its own (its pid and host, to be read by a person, and a
random part, as a pid is reused), written in every run it creates. For as long
as it is open it holds an exclusive flock on `<file>.owners/<id>`. The kernel
releases a flock when the process holding it exits, however it exits (SIGKILL
too), and at once: a store that can take an owner's lock knows that owner is
gone and that its unfinished runs will never end. While the owner lives its
lock cannot be taken and its runs are left alone.

A liveness mark that the owner keeps fresh would need a timeout: it would
take a paused or busy owner (a store waiting on a locked file) for a dead one,
and see a dead one only once the timeout has passed. The lock needs neither,
nor a clock. It holds wherever SQLite's WAL holds: WAL needs every process on
one host (they share its `-shm` memory), whose kernel keeps the locks, and
containers sharing the file through a volume share that kernel.

An id read from the file names a lock file only when it has the shape this
module gives ids. Any other (the "" of runs stored before runs had owners,
or an id edited by hand) names no live owner and no path.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import secrets
import socket
import sqlite3
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from coordinator.store.file import MEMORY, OWNERS_SUFFIX, StoreError, connect

_SHAPE = re.compile(r"[0-9]{1,10}@[A-Za-z0-9.-]{1,64}-[0-9a-f]{8}")


def connect_as(
    name: str, owner: str, busy_timeout: float
) -> tuple[sqlite3.Connection, int | None, Claim | None]:
    """Open the store's file (`connect`) and claim `owner` on it; a memory store claims nothing."""
    conn, lock = connect(name, busy_timeout)
    if name == MEMORY:
        return conn, lock, None
    try:
        return conn, lock, Claim.take(Path(name), owner)
    except OSError as exc:
        conn.close()
        if lock is not None:
            os.close(lock)
        where = owners_dir(Path(name))
        raise StoreError(f"{name}: cannot claim the run store in {where}: {exc.strerror or exc}") from exc


def new_id() -> str:
    """A fresh owner id: `PID@HOST-RANDOM`."""
    host = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:64] or "host"
    return f"{os.getpid()}@{host}-{secrets.token_hex(4)}"


def owners_dir(db: Path) -> Path:
    """Where the owners of the store at `db` keep their locks."""
    return db.with_name(db.name + OWNERS_SUFFIX)


def _lock_path(db: Path, owner: str) -> Path | None:
    return owners_dir(db) / owner if _SHAPE.fullmatch(owner) else None


class Claim:
    """This process's hold on its owner id for one store file: the lock file, locked, until released."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd

    @classmethod
    def take(cls, db: Path, owner: str) -> Claim:
        """Create and lock the owner's file; OSError when the directory or file cannot be made."""
        path = _lock_path(db, owner)
        assert path is not None, f"not an owner id: {owner!r}"
        path.parent.mkdir(exist_ok=True)
        # CLOEXEC: a worker must not inherit the lock, or a dead coordinator would seem alive while it runs.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: no one else holds it
            me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
            os.write(fd, json.dumps(me).encode() + b"\n")
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        return cls(path, fd)

    def release(self) -> None:
        """Remove the lock file, then let go of the lock (its owner is gone from then on)."""
        if self._fd < 0:
            return
        self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = -1


@contextmanager
def gone(db: Path, owners: Iterable[str]) -> Iterator[list[str]]:
    """The `owners` that are gone, their locks held for the block; their files removed if it succeeds.

    Held, so that another store looking at the same time sees them as taken and leaves their runs to
    this one; removed after, once the block has marked their runs, as nothing will ever lock them again.
    """
    found: list[str] = []
    held: list[tuple[Path, int]] = []
    try:
        for owner in owners:
            path = _lock_path(db, owner)
            if path is None:
                found.append(owner)
                continue
            try:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:  # released by its owner, or swept by another store
                found.append(owner)
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno != errno.EWOULDBLOCK:
                    raise
                continue  # held: its owner lives (or another store is sweeping it now)
            found.append(owner)
            held.append((path, fd))
        yield found
        for path, _ in held:
            path.unlink(missing_ok=True)
    finally:
        for _, fd in held:
            os.close(fd)
