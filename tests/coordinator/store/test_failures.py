"""A store that fails to write (locked, full, read-only) or is shared with another coordinator: real files."""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import sys
import time
from pathlib import Path

import msgspec
import pytest

from coordinator.store.history import RunStore, StoreUnavailable
from tests.conftest import eventually, worker_pids
from tests.coordinator.store.test_history import small_run
from tests.support.serving import REPO, Serve, served, serving, unprivileged
from tests.support.store_files import WriteLock, stored

CHILD_TIMEOUT_S = 30


async def test_a_save_that_outwaits_another_writer_is_kept_and_written_in_order_when_the_lock_goes(
    tmp_path: Path,
) -> None:
    path = tmp_path / "runs.sqlite3"
    store = await RunStore.open(path, busy_timeout=2.0, retry_every=0.05)
    try:
        a, b = small_run(1, status="running"), small_run(2, status="running")
        await store.create(a)
        await store.create(b)
        lock = WriteLock(path)
        try:
            with pytest.raises(StoreUnavailable, match=f"{path}: cannot save run 1: database is locked"):
                await store.save(msgspec.structs.replace(a, status="ok"))
            assert store.problem.startswith(f"{path}: cannot save run 1: database is locked")

            started = time.monotonic()
            with pytest.raises(StoreUnavailable, match="database is locked"):
                await store.create(small_run(3))
            assert time.monotonic() - started < 0.5, "a failing store must refuse at once, not wait again"

            store.save_later(msgspec.structs.replace(a, status="failed", error="not saved in time"))
            store.save_later(msgspec.structs.replace(b, total_forward_ms=20.0))
            store.save_later(msgspec.structs.replace(b, status="ok", total_forward_ms=22.0))
            assert "run(s) 1, 2 not saved yet" in store.problem
            # Reads show what is waiting to be saved, not the stale rows, and while the retries go on
            # (one every 0.05 s) none waits out a retry's full busy timeout.
            worst, until = 0.0, time.monotonic() + 0.6
            while time.monotonic() < until:
                started = time.monotonic()
                assert (await store.get(1)).status == "failed"
                worst = max(worst, time.monotonic() - started)
            assert worst < 1.0, f"a read waited {worst:.2f} s behind a retry"
            assert [(r.id, r.status) for r in await store.list()] == [(2, "ok"), (1, "failed")]
            assert stored(path, 1)[0] == "running"
        finally:
            lock.release()

        await asyncio.wait_for(store.working(), 10)
        assert store.problem is None
        status, record = stored(path, 1)
        assert (status, record["error"]) == ("failed", "not saved in time")
        assert stored(path, 2)[0] == "ok" and stored(path, 2)[1]["total_forward_ms"] == 22.0
        assert await store.create(small_run(3)) == 3
    finally:
        await store.close()


async def test_a_second_store_on_a_file_in_use_shares_it_and_marks_none_of_the_first_ones_runs(
    tmp_path: Path,
) -> None:
    path = tmp_path / "runs.sqlite3"
    first = await RunStore.open(path)
    await first.create(small_run(1, status="running"))
    try:
        second = await RunStore.open(path)
        try:
            assert await second.interrupt_unfinished() == 0
            assert stored(path, 1)[0] == "running"
            assert await second.create(small_run(2, status="running")) == 2
            assert [r.id for r in await first.list()] == [r.id for r in await second.list()] == [2, 1]
        finally:
            await second.close()
        assert stored(path, 1)[0] == "running"
    finally:
        await first.close()
    third = await RunStore.open(path)
    assert await third.interrupt_unfinished() == 2
    await third.close()


HOLDER = """
import asyncio, sys
from coordinator.stats import ClusterRun
from coordinator.store.history import RunStore

async def main():
    store = await RunStore.open(sys.argv[1])
    await store.create(ClusterRun(timings=[], total_forward_ms=0.0, output=[], status="running"))
    print("open", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_the_runs_of_a_killed_holder_are_marked_interrupted_at_once_and_a_live_ones_never(
    tmp_path: Path,
) -> None:
    path = tmp_path / "runs.sqlite3"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HOLDER, str(path), cwd=REPO, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    store = None
    try:
        assert await asyncio.wait_for(proc.stdout.readline(), CHILD_TIMEOUT_S) == b"open\n"
        store = await RunStore.open(path)
        assert await store.interrupt_unfinished() == 0
        assert stored(path, 1)[0] == "running"
    finally:
        if proc.returncode is None:
            proc.kill()
        await asyncio.wait_for(proc.wait(), CHILD_TIMEOUT_S)
    try:
        assert await store.interrupt_unfinished() == 1  # at once: the kernel let go of its lock as it died
        assert stored(path, 1)[0] == "interrupted"
        assert [p.name for p in (tmp_path / "runs.sqlite3.owners").iterdir()] == [store.owner]
    finally:
        await store.close()
    assert list((tmp_path / "runs.sqlite3.owners").iterdir()) == []


@pytest.mark.parametrize("read_only", ["file", "directory"])
async def test_a_store_that_cannot_be_written_is_refused_at_start_naming_it(tmp_path, read_only) -> None:
    db = tmp_path / "runs.sqlite3"
    await (await RunStore.open(db)).close()
    if read_only == "file":
        db.chmod(0o444)
        says = f"{db}: the run store's file is read-only"
    else:
        tmp_path.chmod(0o555)
        says = f"{db}: the run store's directory {tmp_path} is not writable"
    args = ("--model", "fake:layers=2", "--stages", "1", "--db", str(db))
    try:
        serve = await Serve.start(*args, prefix=unprivileged())
        try:
            assert await serve.exit_code() == 2
        finally:
            await serve.stop()
    finally:
        tmp_path.chmod(0o755)
    assert says in serve.stderr and "Traceback" not in serve.stderr


async def test_a_second_coordinator_on_the_same_db_serves_beside_the_first_whose_runs_go_on(tmp_path):
    db = tmp_path / "runs.sqlite3"
    async with serving("--model", "fake:layers=2,delay_ms=1500", "--stages", "1", "--db", str(db)) as first:
        await first.said("serving on")
        _, run, _ = await first.post("/runs", {"seq": 2})
        await eventually(lambda: stored(db, run["id"])[0] == "running", 10, "the run to start")
        async with serving("--model", "fake:layers=2", "--stages", "1", "--db", str(db)) as second:
            await second.said("serving on")
            # The second must not have marked the first one's run interrupted (it may have ended meanwhile).
            assert stored(db, run["id"])[0] in ("running", "ok")
            status, its, _ = await second.post("/runs", {"seq": 2})
            assert status == 202 and its["id"] != run["id"]
            assert (await second.cluster.aio.wait(its["id"], "ok", 10))["status"] == "ok"
            await eventually(lambda: stored(db, run["id"])[0] == "ok", 10, "the first one's run to end ok")
            for serve in (first, second):
                listed = [r["id"] for r in (await serve.get("/runs"))[1]["runs"]]
                assert listed == [its["id"], run["id"]], serve.stderr
        assert "Traceback" not in second.stderr
        assert worker_pids(second.proc.pid) == []


async def test_the_run_loop_outlives_a_locked_store_and_catches_up_when_it_is_released(launch, tmp_path):
    path = tmp_path / "runs.sqlite3"
    store = await RunStore.open(path, busy_timeout=0.3, retry_every=0.1)
    pipeline = await launch("fake:layers=2,delay_ms=500", 1)
    try:
        async with served(pipeline, store, max_active=1) as api:  # c waits, queued, behind a
            runner = api.cluster.runner
            _, a, _ = await api.post("/runs", json={"seq": 2})
            _, c, _ = await api.post("/runs", json={"seq": 3})
            await eventually(lambda: stored(path, a["id"])[0] == "running", 10, "the run to start")
            lock = WriteLock(path)
            try:
                ended = await api.finished(a["id"])
                assert ended["status"] == "failed"
                assert "could not save the run's end" in ended["error"]
                assert "database is locked" in ended["error"]
                assert ended["error"].endswith("the run itself ended ok")

                status, body, resp = await api.post("/runs", json={"seq": 1})
                assert status == 503 and int(resp.headers["Retry-After"]) > 0
                assert str(path) in body["error"] and "database is locked" in body["error"]
                assert "database is locked" in store.problem and runner.problem is None
                assert runner.latest.id == a["id"], "a run must wait while the store cannot write"
            finally:
                lock.release()

            assert (await api.finished(c["id"]))["status"] == "ok"
            assert store.problem is None
            assert stored(path, a["id"])[0] == "failed" and stored(path, c["id"])[0] == "ok"
            status, b, _ = await api.post("/runs", json={"seq": 1})
            assert status == 202 and (await api.finished(b["id"]))["status"] == "ok"
    finally:
        await store.close()


def fill_disk(pid: int, db: Path) -> None:
    """Let process `pid` write no byte more to any file than the WAL holds now: a full disk for it."""
    size = os.path.getsize(f"{db}-wal")
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (size, resource.RLIM_INFINITY))


def free_disk(pid: int) -> None:
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


async def test_a_coordinator_whose_disk_fills_refuses_runs_recovers_and_stops_cleanly(tmp_path):
    db = tmp_path / "runs.sqlite3"
    # One run at a time: the run accepted again has ended before the last one starts.
    args = ("--model", "fake:layers=2,delay_ms=1000", "--stages", "1", "--db", str(db), "--max-active", "1")
    async with serving(*args) as c:
        await c.said("serving on")
        pid = c.proc.pid

        async def status_is(run_id: int, status: str) -> bool:
            return (await c.get(f"/runs/{run_id}"))[1]["status"] == status

        async def start_run() -> int:
            _, run, _ = await c.post("/runs", {"seq": 2})
            await eventually(lambda: stored(db, run["id"])[0] == "running", 10, "the run to start")
            return run["id"]

        first = await start_run()
        fill_disk(pid, db)
        await eventually(lambda: status_is(first, "failed"), 10, "the run to end failed")
        error = (await c.get(f"/runs/{first}"))[1]["error"]
        assert "could not save the run's end" in error and str(db) in error
        status, body, headers = await c.post("/runs", {"seq": 2})
        assert status == 503 and str(db) in body["error"] and int(headers["Retry-After"]) > 0

        free_disk(pid)
        await eventually(lambda: stored(db, first)[0] == "failed", 10, "the failed run to be written")

        async def accepted() -> bool:
            return (await c.post("/runs", {"seq": 2}))[0] == 202

        await eventually(accepted, 10, "a run to be accepted again")
        last = await start_run()
        fill_disk(pid, db)
        await eventually(lambda: status_is(last, "failed"), 10, "the last run to end failed")
        c.proc.send_signal(signal.SIGTERM)
        assert await c.exit_code() == 128 + signal.SIGTERM
    assert "Traceback" not in c.stderr
    assert f"run(s) {last} could not be saved before closing" in c.stderr
    assert stored(db, last)[0] == "running"


async def test_writes_queued_behind_a_failing_one_fail_at_once_instead_of_each_waiting_out_the_lock(
    tmp_path: Path,
) -> None:
    path = tmp_path / "runs.sqlite3"
    store = await RunStore.open(path, busy_timeout=1.0, retry_every=60)
    lock = WriteLock(path)
    try:
        started = time.monotonic()
        results = await asyncio.wait_for(
            asyncio.gather(*(store.create(small_run(i)) for i in range(3)), return_exceptions=True), 10
        )
        elapsed = time.monotonic() - started
        assert all(isinstance(r, StoreUnavailable) for r in results), results
        assert elapsed < 1.8, f"three queued writes took {elapsed:.2f} s: each waited out the busy timeout"
    finally:
        lock.release()
        await store.close()
