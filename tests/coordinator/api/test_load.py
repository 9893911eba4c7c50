"""A bounded load on the API while runs execute: no errors, no 5xx."""

from __future__ import annotations

import json

import pytest

from bench.load import load_while_running


async def run_load(api_factory, requests: int, timeout_s: float = 120.0) -> dict:
    api = await api_factory("fake:layers=4,delay_ms=20", 2)
    base = api.url("")
    _, first, _ = await api.post("/runs", json={"seq": 4})
    await api.finished(first["id"])
    result = await load_while_running(base, requests=requests, concurrency=64, timeout_s=timeout_s)
    print(json.dumps(result))
    return result


async def test_two_thousand_requests_while_runs_execute_give_no_errors(api_factory):
    # The full load is make soak's (below) and make bench's (5,000 requests); this keeps make test short.
    result = await run_load(api_factory, 2000)
    assert result["requests"] == 2000
    assert result["errors"] == 0 and result["server_errors"] == 0, result["statuses"]
    assert result["runs_posted"] > 0 and result["post_errors"] == 0


@pytest.mark.soak
@pytest.mark.timeout(900)
async def test_fifty_thousand_requests_while_runs_execute_give_no_errors(api_factory):
    # ~300 requests a second on 2 cores while runs execute: more than the default 120 s.
    result = await run_load(api_factory, 50_000, timeout_s=800)
    assert result["requests"] == 50_000 and result["errors"] == 0, result["statuses"]
