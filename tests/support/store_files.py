"""A run store's file as another process sees it: its rows read directly, its write lock held."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import msgspec


class WriteLock:
    """Another connection holding the file's write lock (BEGIN IMMEDIATE) until released."""

    def __init__(self, path: Path) -> None:
        self.conn = sqlite3.connect(path, isolation_level=None)
        self.conn.execute("BEGIN IMMEDIATE")

    def release(self) -> None:
        if self.conn.in_transaction:
            self.conn.execute("ROLLBACK")
        self.conn.close()


def stored(path: Path, run_id: int) -> tuple[str, dict]:
    """A run's status column and record as another connection reads them from the file."""
    conn = sqlite3.connect(path)
    try:
        status, meta = conn.execute("SELECT status, run FROM runs WHERE id = ?", (run_id,)).fetchone()
    finally:
        conn.close()
    return status, msgspec.json.decode(meta)
