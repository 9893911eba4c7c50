"""A bounded HTTP load on loopback: N requests, C at a time, latency percentiles."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import aiohttp
import numpy as np


async def load(
    base_url: str,
    paths: list[str],
    requests: int = 5000,
    concurrency: int = 64,
    headers: dict[str, str] | None = None,
    timeout_s: float = 120.0,
) -> dict:
    """GET `paths` round-robin `requests` times with `concurrency` in flight; never runs past timeout_s."""
    statuses: Counter[str] = Counter()
    latencies: list[float] = []
    next_index = iter(range(requests))
    deadline = time.monotonic() + timeout_s

    async def client(session: aiohttp.ClientSession) -> None:
        for i in next_index:
            if time.monotonic() > deadline:
                statuses["deadline"] += 1
                return
            started = time.perf_counter()
            try:
                async with session.get(base_url + paths[i % len(paths)]) as r:
                    await r.read()
                    statuses[str(r.status)] += 1
            except (aiohttp.ClientError, TimeoutError) as exc:
                statuses[type(exc).__name__] += 1
            latencies.append((time.perf_counter() - started) * 1000)

    connector = aiohttp.TCPConnector(limit=concurrency)
    started = time.perf_counter()
    async with aiohttp.ClientSession(
        connector=connector, headers=headers, timeout=aiohttp.ClientTimeout(total=30)
    ) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    wall = time.perf_counter() - started
    lat = np.asarray(latencies) if latencies else np.zeros(1)
    return {
        "requests": len(latencies),
        "concurrency": concurrency,
        "statuses": dict(statuses),
        "errors": sum(n for s, n in statuses.items() if not s.startswith("2")),
        "server_errors": sum(n for s, n in statuses.items() if s.startswith("5")),
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(latencies) / wall, 1),
        "p50_ms": round(float(np.percentile(lat, 50)), 2),
        "p99_ms": round(float(np.percentile(lat, 99)), 2),
        "max_ms": round(float(lat.max()), 2),
    }


PATHS = ["/run/latest", "/runs?limit=20", "/runs"]


async def load_while_running(base_url: str, requests: int = 5000, concurrency: int = 64, **kw) -> dict:
    """`load` on the run endpoints while another client keeps POSTing runs to execute."""
    stop = asyncio.Event()
    posted: Counter[int] = Counter()

    async def keep_posting() -> None:
        async with aiohttp.ClientSession(headers=kw.get("headers")) as session:
            while not stop.is_set():
                async with session.post(base_url + "/runs", json={"seq": 4}) as r:
                    await r.read()
                    posted[r.status] += 1
                await asyncio.sleep(0.05)

    poster = asyncio.create_task(keep_posting())
    try:
        result = await load(base_url, PATHS, requests=requests, concurrency=concurrency, **kw)
    finally:
        stop.set()
        await asyncio.wait_for(poster, 10)
    result["runs_posted"] = posted[202]
    result["post_errors"] = sum(n for status, n in posted.items() if status != 202)
    return result
