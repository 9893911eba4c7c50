"""GET /metrics scraped after real runs on real workers, parsed as Prometheus reads it."""

from __future__ import annotations

import math
import os
import signal

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import eventually
from tests.coordinator.conftest import Api
from tests.coordinator.runs.test_prompts import tiny_model  # noqa: F401  (a fixture)

Samples = dict[tuple[str, frozenset], float]


def parse(text: str) -> Samples:
    """Every sample of an exposition, by name and labels."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """The one sample `name` whose labels include `labels`; fails when there is none or several."""
    found = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert len(found) == 1, f"{len(found)} samples {name}{labels}"
    return found[0]


async def scrape(api: Api, **kw) -> Samples:
    status, text, response = await api.get("/metrics", **kw)
    assert status == 200 and response.content_type == "text/plain", (status, text)
    return parse(text)


async def scrape_when(api: Api, name: str, wanted: float, **labels: str) -> Samples:
    """Scrape until `name` reaches `wanted`: the bus is read by a task of its own, a moment behind."""

    async def reached() -> Samples | None:
        samples = await scrape(api)
        return samples if value(samples, name, **labels) == wanted else None

    return await eventually(reached, 10, f"{name}{labels} to reach {wanted}")


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


async def test_stage_histograms_add_up_to_the_stored_timings_of_every_run(api_factory):
    api = await api_factory("fake:layers=4,delay_ms=2", 2)
    other = await api_factory("fake:layers=2", 1)
    ids = [(await api.post("/runs", json={"seq": n}))[1]["id"] for n in (1, 2, 3)]
    runs = [await api.finished(i) for i in ids]
    assert [r["status"] for r in runs] == ["ok"] * 3
    samples = await scrape_when(api, "rlx_runs_total", 3, status="ok")

    for status in ("failed", "interrupted", "cancelled"):
        assert value(samples, "rlx_runs_total", status=status) == 0
    assert value(samples, "rlx_run_duration_seconds_count") == 3
    assert value(samples, "rlx_queue_depth") == 0
    for node in api.cluster.pipeline.nodes:
        labels = {"stage": str(node.index), "addr": node.report.addr}
        stored = [t for r in runs for t in r["timings"] if t["stage"] == node.index]
        forward = sum(t["forward_ms"] for t in stored) / 1000
        compute = sum(t["compute_ms"] for t in stored) / 1000
        assert value(samples, "rlx_stage_forward_seconds_count", **labels) == 3
        assert close(value(samples, "rlx_stage_forward_seconds_sum", **labels), forward)
        assert close(value(samples, "rlx_stage_compute_seconds_sum", **labels), compute)
        assert close(value(samples, "rlx_stage_hop_seconds_sum", **labels), forward - compute)
        assert compute >= 3 * 0.002  # the fake stage's delay is its compute, not the hop's
        assert value(samples, "rlx_stage_up", **labels) == 1
        assert value(samples, "rlx_stage_resident_bytes", **labels) == node.report.resident_bytes
    # Another app in the same process keeps counts of its own.
    assert value(await scrape(other), "rlx_runs_total", status="ok") == 0


async def test_a_generation_run_gives_first_token_and_inter_token_latencies_and_token_counts(
    api_factory,
    tiny_model,  # noqa: F811
):
    api = await api_factory(str(tiny_model), 2)
    accepted = (await api.post("/runs", json={"prompt": "abc", "max_new_tokens": 6}))[1]
    run = await api.finished(accepted["id"])
    assert run["status"] == "ok" and run["tokens"]
    samples = await scrape_when(api, "rlx_runs_total", 1, status="ok")

    generated = len(run["tokens"])
    assert value(samples, "rlx_generated_tokens_total") == generated
    assert value(samples, "rlx_prompt_tokens_total") == run["seq"]
    assert value(samples, "rlx_time_to_first_token_seconds_count") == 1
    assert value(samples, "rlx_inter_token_latency_seconds_count") == generated - 1
    first_token = value(samples, "rlx_time_to_first_token_seconds_sum")
    end_to_end = value(samples, "rlx_run_duration_seconds_sum")
    # The first token comes after the prefill forward and before the run's end.
    assert run["total_forward_ms"] / 1000 <= first_token <= end_to_end
    assert value(samples, "rlx_inter_token_latency_seconds_sum") <= end_to_end - first_token
    decode = run["decode"]
    for prefill, steps in zip(run["timings"], decode["timings"], strict=True):
        stage = str(prefill["stage"])
        assert value(samples, "rlx_stage_forward_seconds_count", stage=stage) == 1 + decode["seq"]
        forward = (prefill["forward_ms"] + steps["forward_ms"]) / 1000
        assert close(value(samples, "rlx_stage_forward_seconds_sum", stage=stage), forward)


async def test_a_stage_that_dies_shows_down_until_it_is_back_and_its_run_counts_failed(api_factory):
    # Recovery off: each new worker would crash on its first forward too, the run's retry.
    api = await api_factory("fake:layers=4,crash_on=1,stage=2", 2, recover_timeout=0)
    accepted = (await api.post("/runs", json={"seq": 2}))[1]
    assert (await api.finished(accepted["id"]))["status"] == "failed"
    await scrape_when(api, "rlx_stage_up", 0, stage="1")
    samples = await scrape_when(api, "rlx_stage_up", 1, stage="1")
    assert value(samples, "rlx_runs_total", status="failed") == 1
    assert value(samples, "rlx_runs_total", status="ok") == 0


async def test_a_stage_replaced_at_a_new_address_leaves_no_series_behind_under_its_old_one(api_factory):
    api = await api_factory("fake:layers=2", 2)
    node = api.cluster.pipeline.nodes[1]
    for _ in range(3):
        assert (await api.finished(await api.submit({"seq": 2})))["status"] == "ok"
        old = node.report.addr
        os.kill(node.report.pid, signal.SIGKILL)
        await eventually(lambda: node.state == "up" and node.report.addr != old, 20, "stage 1 back elsewhere")  # noqa: B023
    assert (await api.finished(await api.submit({"seq": 2})))["status"] == "ok"
    samples = await scrape_when(api, "rlx_runs_total", 4, status="ok")
    shown = {(ls["stage"], ls["addr"]) for ls in (dict(labels) for _, labels in samples) if "addr" in ls}
    assert shown == {(str(n.index), n.report.addr) for n in api.cluster.pipeline.nodes}
    # Stage 0 never moved: its series hold all four runs; stage 1's only the run since its last restart.
    assert value(samples, "rlx_stage_forward_seconds_count", stage="0") == 4
    assert value(samples, "rlx_stage_forward_seconds_count", stage="1") == 1


@pytest.mark.parametrize("header", [None, "Bearer wrong"])
async def test_metrics_need_the_token_when_one_is_set(api_factory, header):
    api = await api_factory(token="s3cret")
    headers = {"Authorization": header} if header else {}
    status, body, _ = await api.get("/metrics", headers=headers)
    assert status == 401 and body == {"error": "missing or wrong bearer token"}
    samples = await scrape(api, headers={"Authorization": "Bearer s3cret"})
    assert value(samples, "rlx_queue_depth") == 0
