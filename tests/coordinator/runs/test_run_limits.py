"""What one request may cost and how many may wait: limits that hold, over real HTTP and processes."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import sqlite3
from pathlib import Path

import numpy as np

from coordinator.runs.requests import MAX_ACTIVATION, MAX_SEQ
from coordinator.stages.supervisor import attach_pipeline
from coordinator.store.history import RunStore
from coordinator.store.rows import MAX_STORED_OUTPUT
from tests.conftest import eventually
from tests.coordinator.conftest import Api
from tests.support.serving import rss_bytes, served, serving
from workers.fake import reference
from workers.models.synthetic import make_input

MiB = 1 << 20
# The coordinator's growth allowed through the largest synthetic request: a few 16 MiB activations.
MAX_GROWTH = 128 * MiB


def row_sizes(db: Path, run_id: int) -> tuple[int, int]:
    """Bytes of a stored run's record and of its output, as the file holds them."""
    conn = sqlite3.connect(db)
    try:
        return conn.execute("SELECT length(run), length(output) FROM runs WHERE id = ?", (run_id,)).fetchone()
    finally:
        conn.close()


def digest(y: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(y, np.float32).tobytes()).hexdigest()


async def test_a_request_over_the_seq_or_activation_limit_is_a_400_naming_the_limit(api_factory):
    api = await api_factory("fake:layers=2,hidden=128", 1)
    largest = MAX_ACTIVATION // 128
    status, body, _ = await api.post("/runs", json={"seq": largest + 1})
    assert status == 400
    assert "MAX_ACTIVATION" in body["error"] and f"{MAX_ACTIVATION:,}" in body["error"]
    assert f"seq up to {largest:,}" in body["error"]
    status, body, _ = await api.post("/runs", json={"seq": MAX_SEQ + 1})
    assert status == 400 and f"<= {MAX_SEQ}" in body["error"]
    status, body, _ = await api.post("/runs", json={"seq": largest})
    assert status == 202 and (await api.finished(body["id"]))["status"] == "ok"


async def test_the_largest_allowed_output_is_stored_as_its_shape_and_digest_only(api_factory, tmp_path):
    db = tmp_path / "runs.sqlite3"
    api = await api_factory("fake:layers=2,hidden=64", 1, db=db)
    seq = MAX_ACTIVATION // 64
    assert seq == MAX_SEQ, "this request is the largest both limits allow"
    _, body, _ = await api.post("/runs", json={"seq": seq, "seed": 3})
    run = await api.finished(body["id"])
    assert run["status"] == "ok"
    expected = reference(make_input(seq, 64, 3), range(2))
    assert run["output_omitted"] and run["output_shape"] == [seq, 64]
    assert run["output_digest"] == digest(expected)
    record, output = row_sizes(db, body["id"])
    assert output == 0 and record < 4096
    status, with_output, _ = await api.get(f"/runs/{body['id']}?output=1")
    assert status == 200 and with_output["output"] == [] and with_output["output_omitted"]


async def test_an_output_up_to_the_stored_bound_is_kept_whole_and_one_row_more_is_not(api_factory, tmp_path):
    db = tmp_path / "runs.sqlite3"
    api = await api_factory("fake:layers=2", 1, db=db)
    fits = MAX_STORED_OUTPUT // 4
    for seq, kept in ((fits, True), (fits + 1, False)):
        _, body, _ = await api.post("/runs", json={"seq": seq, "seed": 1})
        assert (await api.finished(body["id"]))["status"] == "ok"
        _, run, _ = await api.get(f"/runs/{body['id']}?output=1")
        expected = reference(make_input(seq, 4, 1), range(2))
        assert run["output_shape"] == [seq, 4] and run["output_digest"] == digest(expected)
        assert run["output_omitted"] is not kept
        assert row_sizes(db, body["id"])[1] == (expected.nbytes if kept else 0)
        if kept:
            np.testing.assert_array_equal(np.asarray(run["output"], np.float32).reshape(seq, 4), expected)


async def test_the_coordinator_stays_small_through_the_largest_allowed_synthetic_request(tmp_path):
    seq = MAX_ACTIVATION // 256
    db = tmp_path / "runs.sqlite3"
    async with serving("--model", "synthetic:layers=2", "--stages", "1", "--db", str(db)) as c:
        await c.said("serving on")

        async def ended(run_id: int) -> dict | None:
            _, run, _ = await c.get(f"/runs/{run_id}")
            return run if run["status"] not in ("queued", "running") else None

        _, warm, _ = await c.post("/runs", {"seq": 16})
        await eventually(lambda: ended(warm["id"]), 30, "the warm-up run")
        before = rss_bytes(c.proc.pid)
        _, body, _ = await c.post("/runs", {"seq": seq})
        run = await eventually(lambda: ended(body["id"]), 60, "the largest run")
        peak, after = rss_bytes(c.proc.pid, "VmHWM"), rss_bytes(c.proc.pid)
        print(f"coordinator resident {before / MiB:.0f} MiB, peak {peak / MiB:.0f}, after {after / MiB:.0f}")
        assert run["status"] == "ok" and run["output_omitted"] and run["output_shape"] == [seq, 256]
        assert peak - before < MAX_GROWTH, f"peak {peak / MiB:.0f} MiB from {before / MiB:.0f} MiB"
        assert row_sizes(db, body["id"]) < (4096, 1)


def stored_status(db: Path, run_id: int) -> str | None:
    conn = sqlite3.connect(db)
    try:
        row = conn.execute("SELECT status FROM runs WHERE id = ?", (run_id,)).fetchone()
    finally:
        conn.close()
    return row and row[0]


async def occupied(api: Api, db: Path) -> int:
    """Start a run that never ends (its stage hangs), so the runs posted next stay queued; its id."""
    _, body, _ = await api.post("/runs", json={"seq": 1})
    await eventually(lambda: stored_status(db, body["id"]) == "running", 10, "the run to start")
    return body["id"]


async def post_many(api: Api, n: int) -> list[tuple[int, dict, dict]]:
    async def post(i: int):
        async with api.session.post(api.url("/runs"), json={"seq": 1, "seed": i}) as r:
            return r.status, await r.json(), dict(r.headers)

    return await asyncio.wait_for(asyncio.gather(*(post(i) for i in range(n))), 30)


def queued_rows(db: Path) -> int:
    conn = sqlite3.connect(db)
    try:
        return conn.execute("SELECT count(*) FROM runs WHERE status = 'queued'").fetchone()[0]
    finally:
        conn.close()


async def test_the_queue_limit_holds_exactly_under_concurrent_posts(launch, tmp_path):
    db, limit = tmp_path / "runs.sqlite3", 5
    store = await RunStore.open(db)
    pipeline = await launch("fake:layers=2,hang_on=1", 1)
    try:
        async with served(pipeline, store, queue_limit=limit, max_active=1) as api:
            await occupied(api, db)
            answers = await post_many(api, 60)
            statuses = [status for status, _, _ in answers]
            assert statuses.count(202) == limit and statuses.count(503) == 60 - limit
            refused = [(body, headers) for status, body, headers in answers if status == 503]
            assert all("queue limit" in body["error"] and int(h["Retry-After"]) > 0 for body, h in refused)
            assert api.cluster.runner.queued() == limit and queued_rows(db) == limit
    finally:
        await store.close()


async def test_places_taken_by_inserts_that_failed_are_given_back(launch, tmp_path):
    db, limit = tmp_path / "runs.sqlite3", 3
    store = await RunStore.open(db, busy_timeout=0.2, retry_every=0.05)
    pipeline = await launch("fake:layers=2,hang_on=1", 1)
    try:
        async with served(pipeline, store, queue_limit=limit, max_active=1) as api:
            await occupied(api, db)
            holder = sqlite3.connect(db, isolation_level=None)
            holder.execute("BEGIN IMMEDIATE")
            try:
                answers = await post_many(api, 2 * limit)
            finally:
                holder.execute("ROLLBACK")
                holder.close()
            assert [status for status, _, _ in answers] == [503] * (2 * limit)
            # Those still storing their run hold their places, so the rest are refused as over the limit.
            errors = [body["error"] for _, body, _ in answers]
            assert any("database is locked" in e for e in errors)
            assert all("database is locked" in e or "queue limit" in e for e in errors)
            await eventually(lambda: store.problem is None, 10, "the store to work again")
            statuses = [status for status, _, _ in await post_many(api, 4 * limit)]
            assert statuses.count(202) == limit
    finally:
        await store.close()


async def test_a_run_is_refused_with_503_naming_the_stage_that_is_down(launch, tmp_path):
    launched = await launch("fake:layers=2", 2)
    addrs = [node.report.addr for node in launched.nodes]
    attached = await attach_pipeline(launched.info, addrs, launched.supervisor.token)
    store = await RunStore.open(tmp_path / "runs.sqlite3")
    try:
        async with served(attached, store) as api:
            victim = launched.nodes[1]
            os.kill(victim.process.proc.pid, signal.SIGKILL)
            _, body, _ = await api.post("/runs", json={"seq": 1})
            assert (await api.finished(body["id"]))["status"] == "failed"
            status, refused, resp = await api.post("/runs", json={"seq": 1})
            assert status == 503 and int(resp.headers["Retry-After"]) > 0
            assert f"stage 1 ({addrs[1]}" in refused["error"] and "down" in refused["error"]
    finally:
        await attached.close()
        await store.close()
