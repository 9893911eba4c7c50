"""A bounded load on the API while runs execute: no errors, no 5xx."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from bench.load import load


async def post_runs_until(stop: asyncio.Event, base: str, posted: list[int]) -> None:
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            async with session.post(base + "/runs", json={"seq": 4}) as r:
                assert r.status == 202
                posted.append((await r.json())["id"])
            await asyncio.sleep(0.05)


async def run_load(api_factory, requests: int) -> dict:
    api = await api_factory("fake:layers=4,delay_ms=20", 2)
    base = api.url("")
    _, first, _ = await api.post("/runs", json={"seq": 4})
    await api.finished(first["id"])
    stop, posted = asyncio.Event(), []
    poster = asyncio.create_task(post_runs_until(stop, base, posted))
    try:
        result = await load(base, ["/run/latest", "/runs?limit=20", "/runs"], requests=requests, concurrency=64)
    finally:
        stop.set()
        await asyncio.wait_for(poster, 10)
    result["runs_posted"] = len(posted)
    print(json.dumps(result))
    return result


async def test_five_thousand_requests_while_runs_execute_give_no_errors(api_factory):
    result = await run_load(api_factory, 5000)
    assert result["requests"] == 5000
    assert result["errors"] == 0 and result["server_errors"] == 0, result["statuses"]
    assert result["runs_posted"] > 0


@pytest.mark.soak
async def test_fifty_thousand_requests_while_runs_execute_give_no_errors(api_factory):
    result = await run_load(api_factory, 50_000)
    assert result["requests"] == 50_000 and result["errors"] == 0, result["statuses"]
