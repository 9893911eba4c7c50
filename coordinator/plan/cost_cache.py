"""Measured layer costs kept in the run store's file, so the next start with the same inputs reuses them.

Measuring SmolLM2's layers costs seconds of CPU at every start. What it
measures depends on the model file, the precision, what each worker computes
with (its thread variables and the cores it may fall back to), the host, and
how `workers.calibrate` times a layer (its METHOD and defaults): those make the
key. The number of stages counts only through the threads it gives each
worker, so 2 and 3 stages on a 2-core host share one entry.

The model file is known by its resolved path, size and modification time in
nanoseconds: a rewritten, replaced or touched file changes them, and reading
them costs nothing, where a digest of a model file costs a good part of the
measuring it would save. An entry of the same path whose size or time differ
is stale: measured again and replaced. A model that names no file (synthetic,
fake) is measured every time: it costs milliseconds.

The `calibrations` table lives in the run store's SQLite file (--db), the one
place of this tool's state; `--db :memory:` keeps nothing, as for runs. The
file is opened as the store opens it (checked to be ours and intact, set up
if new, locked) only for the moment of a read or a write, beside any
coordinator serving from it. Whatever goes wrong there (a file an older
coordinator holds, a write lock held past the busy timeout, a damaged table
or entry) is logged and the layers are measured, never a failure of the plan.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import msgspec

from coordinator.store.file import MEMORY, StoreError, connect
from workers import calibrate
from workers.calibrate import Costs
from workers.models import gguf_path

log = logging.getLogger(__name__)

# Seconds a read or write of an entry waits for another connection's write lock.
BUSY_TIMEOUT_S = 2.0
# What sizes a worker's compute, beside what the launcher sets: read from its environment.
COMPUTE_VARS = (
    "RLX_THREADS",
    "OPENBLAS_NUM_THREADS",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "NUMBA_NUM_THREADS",
    "NUMBA_THREADING_LAYER",
)
SCHEMA = """
CREATE TABLE IF NOT EXISTS calibrations (
    model TEXT NOT NULL,
    precision TEXT NOT NULL,
    setting TEXT NOT NULL,
    file TEXT NOT NULL,
    costs BLOB NOT NULL,
    measured_at REAL NOT NULL,
    PRIMARY KEY (model, precision, setting)
)
"""


@dataclass(frozen=True)
class CostKey:
    """What a measurement depends on.

    model: the model file's resolved path.
    file: its size and modification time ("<bytes> <ns>"): a different one makes an entry stale.
    precision: the precision the layers are built in.
    setting: the host, its cores, the workers' compute variables and the calibration's method (JSON).
    """

    model: str
    file: str
    precision: str
    setting: str


@dataclass(frozen=True)
class Kept:
    """Costs found in the cache and when they were measured (seconds since the epoch)."""

    costs: Costs
    measured_at: float


def cost_key(model: str, precision: str, env: dict[str, str]) -> CostKey | None:
    """The key of `model`'s costs measured with `env` on top of ours; None for a model that names no file."""
    path = gguf_path(model)
    if path is None:
        return None
    path = path.resolve()
    stat = path.stat()
    seen = os.environ | env
    setting = {
        "host": socket.gethostname(),
        "cores": len(os.sched_getaffinity(0)),
        "env": {k: seen[k] for k in sorted({*COMPUTE_VARS, *env}) if k in seen},
        "method": calibrate.METHOD,
        "prompt": calibrate.PROMPT,
        "steps": calibrate.STEPS,
    }
    file = f"{stat.st_size} {stat.st_mtime_ns}"
    return CostKey(str(path), file, precision, json.dumps(setting, sort_keys=True))


class CostCache:
    """The `calibrations` table of one run store file; every method is blocking (call it off the loop)."""

    def __init__(self, db: str | Path) -> None:
        self.db = str(db) if str(db) == MEMORY else str(Path(db).expanduser())

    def get(self, key: CostKey, n_layers: int) -> Kept | None:
        """The costs kept for `key`, or None (logged why) when there are none fit to use."""
        try:
            with self._open() as conn:
                row = conn.execute(
                    "SELECT file, costs, measured_at FROM calibrations "
                    "WHERE model = ? AND precision = ? AND setting = ?",
                    (key.model, key.precision, key.setting),
                ).fetchone()
        except (StoreError, sqlite3.Error, OSError) as exc:
            log.warning("%s: cannot read kept layer costs, measuring them: %s", self.db, exc)
            return None
        if row is None:
            return None
        file, blob, measured_at = row
        where = f"{self.db}: the layer costs kept for {key.model} in {key.precision}"
        if file != key.file:
            log.info("%s are stale (size, time then %s, now %s): measuring again", where, file, key.file)
            return None
        try:
            costs = msgspec.json.decode(blob, type=Costs)
        except (msgspec.DecodeError, TypeError) as exc:
            log.warning("%s cannot be read (%s): measuring again", where, exc)
            return None
        if (why := _unfit(costs, key.precision, n_layers)) is not None:
            log.warning("%s do not fit: %s; measuring again", where, why)
            return None
        return Kept(costs, float(measured_at))

    def put(self, key: CostKey, costs: Costs) -> str | None:
        """Keep `costs` for `key`, replacing what was kept; why not (also logged) when it cannot."""
        try:
            with self._open() as conn:
                kept = (key.file, msgspec.json.encode(costs), time.time())
                conn.execute(
                    "INSERT OR REPLACE INTO calibrations VALUES (?, ?, ?, ?, ?, ?)",
                    (key.model, key.precision, key.setting, *kept),
                )
        except (StoreError, sqlite3.Error, OSError) as exc:
            log.warning("%s: cannot keep the measured layer costs: %s", self.db, exc)
            return str(exc)
        return None

    @contextmanager
    def _open(self) -> Iterator[sqlite3.Connection]:
        """The store's file, checked and locked as the store opens it, with the table; closed after."""
        conn, lock = connect(self.db, BUSY_TIMEOUT_S)
        try:
            conn.execute(SCHEMA)
            yield conn
        finally:
            conn.close()
            if lock is not None:
                os.close(lock)  # releases the flock


def _unfit(costs: Costs, precision: str, n_layers: int) -> str | None:
    """Why kept costs cannot stand for a measurement in `precision` of `n_layers` layers, or None."""
    if costs.precision != precision:
        return f"they were measured in {costs.precision}"
    if len(costs.layers) != n_layers:
        return f"they hold {len(costs.layers)} layers, the model has {n_layers}"
    if not all(math.isfinite(ms) and ms >= 0 for ms in costs.layers):
        return "a layer's cost is not a finite number of ms at least 0"
    if not (math.isfinite(costs.stage_ms) and costs.stage_ms >= 0):
        return "a stage's fixed cost is not a finite number of ms at least 0"
    return None
