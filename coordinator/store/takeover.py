"""The unfinished runs of coordinators that are gone: taken over to be resumed, or marked interrupted.

Runs on the store's thread. A judge says of each such run (queued or running
when its coordinator died) whether this coordinator can go on with it (None)
or why not: a run taken over gets this store's owner, its status left as it
was, and is handed back to be queued again; any other is marked interrupted
with the judge's reason. Read and changed under the write lock, so two stores
sweeping the same gone owner never both take a run.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable
from pathlib import Path

from coordinator.stats import ClusterRun
from coordinator.store import owners, rows
from coordinator.store.file import StoreError, transaction

log = logging.getLogger(__name__)

# The runs not ended yet, as the partial index `runs_unfinished` says it: SQLite uses that index only for
# a WHERE that matches it literally (with bound parameters it reads the whole table, outputs and all).
UNFINISHED_SQL = "status IN ('queued', 'running')"

# Says of a run left unfinished by a coordinator that is gone: None to take it over, else why it is not.
Judge = Callable[[ClusterRun], str | None]


def take_gone(conn: sqlite3.Connection, name: str, owner: str, judge: Judge) -> tuple[list[ClusterRun], int]:
    """Take over or interrupt the unfinished runs of owners other than `owner` that are gone.

    Returns the runs taken over (oldest first) and how many were marked interrupted. The caller
    holds the busy timeout it wants for the write lock.
    """
    sql = f"SELECT DISTINCT owner FROM runs WHERE {UNFINISHED_SQL} AND owner != ?"
    others = [other for (other,) in conn.execute(sql, (owner,))]
    if not others:
        return [], 0
    try:
        with owners.gone(Path(name), others) as dead:
            return _judged(conn, name, owner, dead, judge) if dead else ([], 0)
    except OSError as exc:
        raise StoreError(f"{name}: cannot tell whether the owners of unfinished runs live: {exc}") from exc


def _judged(
    conn: sqlite3.Connection, name: str, owner: str, dead: list[str], judge: Judge
) -> tuple[list[ClusterRun], int]:
    marks = ", ".join("?" * len(dead))
    sql = f"SELECT id, run FROM runs WHERE {UNFINISHED_SQL} AND owner IN ({marks}) ORDER BY id"
    taken: list[ClusterRun] = []
    interrupted = 0
    with transaction(conn):
        # Read under the write lock: a store sweeping the same owners may have just taken them.
        for run_id, meta in conn.execute(sql, dead).fetchall():
            try:
                run = rows.decode(name, run_id, meta)
            except StoreError as exc:
                # Still mark it, so it is not taken for live; reading it reports the damage.
                log.warning("%s", exc)
                conn.execute("UPDATE runs SET status = 'interrupted' WHERE id = ?", (run_id,))
                interrupted += 1
                continue
            why = judge(run)
            if why is None:
                conn.execute("UPDATE runs SET owner = ? WHERE id = ?", (owner, run_id))
                taken.append(run)
                continue
            run.status, run.error = "interrupted", why
            update = "UPDATE runs SET status = ?, run = ? WHERE id = ?"
            conn.execute(update, (run.status, rows.encode(run)[0], run_id))
            interrupted += 1
    return taken, interrupted
