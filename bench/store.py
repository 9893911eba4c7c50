"""How fast the run store pages through a full history (`/runs?limit=&before=`)."""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from pathlib import Path

import numpy as np

from coordinator.stats import ClusterRun, StageTiming
from coordinator.store.history import RunStore
from workers.protocol.report import LayerRange

QUERIES = 1000
LIMIT = 50


def _run(i: int, output_len: int) -> ClusterRun:
    timings = [
        StageTiming(
            addr=f"127.0.0.1:{40000 + s}",
            layers=LayerRange(10 * s, 10 * s + 10),
            device="cpu",
            build_ms=1200,
            forward_ms=12.5,
            resident_bytes=300_000_000,
            compute_ms=11.0,
            stage=s,
        )
        for s in range(3)
    ]
    return ClusterRun(
        timings=timings,
        total_forward_ms=40.0,
        output=[float(i)] * output_len,
        seq=16,
        model="smollm2",
        prompt="The capital of France is",
        text=" Paris.",
        tokens=list(range(16)),
    )


async def _paging(n: int, output_len: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "runs.sqlite3"
        store = await RunStore.open(path)
        try:
            t0 = time.perf_counter()
            for i in range(n):
                await store.create(_run(i, output_len))
            fill_s = time.perf_counter() - t0
        finally:
            await store.close()

        t0 = time.perf_counter()
        store = await RunStore.open(path)  # a restart: includes the integrity check
        open_ms = (time.perf_counter() - t0) * 1000
        try:
            rng = random.Random(0)
            ms = []
            for _ in range(QUERIES):
                before = rng.randint(1, n + 1)
                t0 = time.perf_counter()
                await store.list(limit=LIMIT, before=before)
                ms.append((time.perf_counter() - t0) * 1000)
        finally:
            await store.close()
        return {
            "runs": n,
            "output_floats": output_len,
            "db_mb": round(path.stat().st_size / 1e6, 1),
            "fill_s": round(fill_s, 2),
            "open_ms": round(open_ms, 1),
            "limit": LIMIT,
            "queries": QUERIES,
            "list_p50_ms": round(float(np.percentile(ms, 50)), 3),
            "list_p99_ms": round(float(np.percentile(ms, 99)), 3),
        }


def paging(n: int = 10_000, output_len: int = 1024) -> dict:
    """Fill a temporary store with `n` runs, time `list(limit=50, before=…)` at random offsets."""
    return asyncio.run(_paging(n, output_len))


if __name__ == "__main__":
    import json

    print(json.dumps(paging()))
