"""The run store: round trips, ids, paging, crash survival, interrupted runs, bad files."""

from __future__ import annotations

import asyncio
import random
import signal
import sqlite3
import sys
from pathlib import Path

import msgspec
import pytest

from coordinator.stats import ClusterRun, StageTiming
from coordinator.store.history import INTERRUPTED_ERROR, RunStore, StoreError, default_path
from workers.protocol.report import LayerRange

REPO = Path(__file__).resolve().parents[3]
CHILD_TIMEOUT_S = 30


def timing(stage: int, start: int, end: int) -> StageTiming:
    return StageTiming(
        addr=f"127.0.0.1:{40000 + stage}",
        layers=LayerRange(start, end),
        device="cpu",
        build_ms=1200 + stage,
        forward_ms=12.25 + stage,
        resident_bytes=123_456_789 * (stage + 1),
        compute_ms=10.5 + stage,
        stage=stage,
        precision="f32",
    )


def full_run() -> ClusterRun:
    decode = ClusterRun(
        timings=[timing(0, 0, 15), timing(1, 15, 30)],
        total_forward_ms=420.5,
        output=[0.5, -1.25],
        status="ok",
        seq=8,
        model="smollm2",
    )
    return ClusterRun(
        timings=[timing(0, 0, 15), timing(1, 15, 30)],
        total_forward_ms=55.5,
        # float32-exact values: outputs are stored as float32.
        output=[0.0, 1.5, -2.25, 2.0**-25, 65504.0],
        status="ok",
        seq=5,
        model="smollm2",
        created_at=1_700_000_000.25,
        finished_at=1_700_000_001.5,
        prompt="The capital of France is",
        text=" Paris.",
        tokens=[504, 3575, 282, 4649, 314],
        decode=decode,
        finish_reason="stop",
    )


def small_run(i: int, status: str = "ok") -> ClusterRun:
    return ClusterRun(timings=[timing(0, 0, 4)], total_forward_ms=float(i), output=[float(i)], status=status)


@pytest.fixture
async def store(tmp_path: Path):
    store = await RunStore.open(tmp_path / "runs.sqlite3")
    yield store
    await store.close()


async def test_a_full_run_round_trips_and_listing_leaves_its_output_out(store: RunStore) -> None:
    run = full_run()
    run_id = await store.create(run)
    assert run.id == run_id

    assert await store.get(run_id, with_output=True) == run
    assert await store.latest(with_output=True) == run
    without = msgspec.structs.replace(run, output=[])
    assert await store.get(run_id) == without
    assert await store.list() == [without]
    assert await store.get(run_id + 1) is None


async def test_save_replaces_the_stored_run_and_unknown_ids_are_refused(store: RunStore) -> None:
    run = small_run(1, status="running")
    await store.create(run)
    run.status, run.output, run.timings = "ok", [7.0, 8.0], [*run.timings, timing(1, 4, 8)]
    await store.save(run)
    assert await store.get(run.id, with_output=True) == run

    ghost = msgspec.structs.replace(run, id=run.id + 100)
    with pytest.raises(StoreError, match=f"cannot save run {ghost.id}: no such run"):
        await store.save(ghost)


async def test_ids_are_monotonic_and_never_reused_after_delete_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / "runs.sqlite3"
    store = await RunStore.open(path)
    assert [await store.create(small_run(i)) for i in range(3)] == [1, 2, 3]
    await store.close()

    with sqlite3.connect(path) as conn:
        conn.execute("DELETE FROM runs WHERE id = 3")
    conn.close()

    store = await RunStore.open(path)
    assert await store.create(small_run(4)) == 4
    assert [r.id for r in await store.list()] == [4, 2, 1]
    await store.close()


async def test_list_pages_over_10000_runs_are_contiguous_and_newest_first(store: RunStore) -> None:
    n = 10_000
    for i in range(n):
        await store.create(small_run(i))

    ids: list[int] = []
    before = None
    while page := await store.list(limit=50, before=before):
        assert all(r.output == [] for r in page)
        ids += [r.id for r in page]
        before = page[-1].id
    assert ids == list(range(n, 0, -1))

    rng = random.Random(0)
    for _ in range(50):
        before, limit = rng.randint(1, n + 10), rng.randint(1, 1000)
        page = await store.list(limit=limit, before=before)
        top = min(before - 1, n)
        assert [r.id for r in page] == list(range(top, max(top - limit, 0), -1))
        assert [r.total_forward_ms for r in page] == [float(r.id - 1) for r in page]

    for bad in (0, 1001):
        with pytest.raises(ValueError, match="limit must be between 1 and 1000"):
            await store.list(limit=bad)


CHILD = """
import asyncio, sys
from coordinator.stats import ClusterRun
from coordinator.store.history import RunStore

async def main():
    store = await RunStore.open(sys.argv[1])
    for i in range(int(sys.argv[2])):
        run = ClusterRun(timings=[], total_forward_ms=float(i), output=[float(i)] * 100, status="running")
        await store.create(run)
        run.status = "ok"
        await store.save(run)
    await store.create(ClusterRun(timings=[], total_forward_ms=0.0, output=[], status="running"))
    print("saved", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_runs_saved_by_a_process_survive_it_being_sigkilled(tmp_path: Path) -> None:
    path, n = tmp_path / "runs.sqlite3", 25
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CHILD,
        str(path),
        str(n),
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), CHILD_TIMEOUT_S)
        if line != b"saved\n":
            await asyncio.wait_for(proc.wait(), CHILD_TIMEOUT_S)
            err = await asyncio.wait_for(proc.stderr.read(), CHILD_TIMEOUT_S)
            pytest.fail(f"child said {line!r}, exit {proc.returncode}: {err.decode()}")
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGKILL)
        await asyncio.wait_for(proc.wait(), CHILD_TIMEOUT_S)
        await asyncio.wait_for(proc.stderr.read(), CHILD_TIMEOUT_S)
    assert proc.returncode == -signal.SIGKILL
    # The child never closed its connection: the commits live in the WAL.
    assert (tmp_path / "runs.sqlite3-wal").exists()

    store = await RunStore.open(path)
    try:
        assert [r.id for r in await store.list()] == list(range(n + 1, 0, -1))
        for i in range(n):
            run = await store.get(i + 1, with_output=True)
            assert (run.status, run.total_forward_ms, run.output) == ("ok", float(i), [float(i)] * 100)
        assert (await store.latest()).status == "running"
        assert await store.interrupt_unfinished() == 1
        assert (await store.latest()).status == "interrupted"
    finally:
        await store.close()


async def test_interrupt_unfinished_marks_only_queued_and_running_runs(store: RunStore) -> None:
    statuses = ["ok", "queued", "running", "failed", "running", "interrupted"]
    for i, status in enumerate(statuses):
        await store.create(small_run(i, status=status))

    assert await store.interrupt_unfinished() == 3
    runs = {r.id: r for r in await store.list()}
    for i, status in enumerate(statuses, start=1):
        if status in ("queued", "running"):
            assert (runs[i].status, runs[i].error) == ("interrupted", INTERRUPTED_ERROR)
        else:
            assert (runs[i].status, runs[i].error) == (status, None)
    assert await store.interrupt_unfinished() == 0


async def test_a_damaged_row_is_a_store_error_naming_the_run(tmp_path: Path) -> None:
    path = tmp_path / "runs.sqlite3"
    store = await RunStore.open(path)
    for i in range(3):
        await store.create(small_run(i))
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE runs SET run = ? WHERE id = 2", (b'{"timings": 5',))
        conn.execute("UPDATE runs SET output = ? WHERE id = 3", (b"\x00\x01\x02",))
    conn.close()
    try:
        with pytest.raises(StoreError, match="run 2 is damaged"):
            await store.get(2)
        with pytest.raises(StoreError, match="run 2 is damaged"):
            await store.list()
        with pytest.raises(StoreError, match="run 3 is damaged: its output"):
            await store.get(3, with_output=True)
        assert (await store.get(1, with_output=True)).output == [0.0]
    finally:
        await store.close()


async def test_a_run_stored_before_runs_had_a_finish_reason_reads_back_without_one(tmp_path: Path) -> None:
    path = tmp_path / "runs.sqlite3"
    store = await RunStore.open(path)
    try:
        run_id = await store.create(full_run())
        with sqlite3.connect(path) as conn:
            (meta,) = conn.execute("SELECT run FROM runs WHERE id = ?", (run_id,)).fetchone()
            older = msgspec.json.decode(meta)
            del older["finish_reason"]
            conn.execute("UPDATE runs SET run = ? WHERE id = ?", (msgspec.json.encode(older), run_id))
        conn.close()
        assert b"finish_reason" in meta  # stored as it is, and left out of the older row
        read = await store.get(run_id, with_output=True)
        assert read == msgspec.structs.replace(full_run(), id=run_id, finish_reason=None)
    finally:
        await store.close()


def random_bytes(path: Path) -> None:
    path.write_bytes(random.Random(0).randbytes(8192))


def filled_store(path: Path) -> None:
    async def fill() -> None:
        store = await RunStore.open(path)
        for i in range(200):
            run = small_run(i)
            run.output = [float(i)] * 1000
            await store.create(run)
        await store.close()

    asyncio.run(fill())


def truncated_store(path: Path) -> None:
    filled_store(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def scribbled_store(path: Path) -> None:
    """Overwrite four pages mid-file: the header and schema still read fine."""
    filled_store(path)
    data, page = bytearray(path.read_bytes()), 4096
    first = len(data) // page // 4
    data[first * page : (first + 4) * page] = random.Random(0).randbytes(4 * page)
    path.write_bytes(data)


def foreign_db(path: Path) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE users (name TEXT, email TEXT)")
    conn.close()


BAD_FILES = {
    "random bytes": (random_bytes, "is not a SQLite database"),
    "a truncated store": (truncated_store, "damaged"),
    "a store with scribbled pages": (scribbled_store, "the run store is damaged: .*Page"),
    "another program's database": (foreign_db, "another program .*holding table users"),
}


@pytest.mark.parametrize("make, message", BAD_FILES.values(), ids=BAD_FILES.keys())
def test_a_bad_file_is_refused_at_open_and_left_untouched(tmp_path: Path, make, message: str) -> None:
    path = tmp_path / "runs.sqlite3"
    make(path)
    data = path.read_bytes()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files in (["runs.sqlite3"], ["runs.sqlite3", "runs.sqlite3.lock"])

    with pytest.raises(StoreError, match=message) as info:
        asyncio.run(RunStore.open(path))
    assert str(path) in str(info.value)
    assert path.read_bytes() == data
    assert sorted(p.name for p in tmp_path.iterdir()) == files


def test_a_directory_given_as_the_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="is a directory") as info:
        asyncio.run(RunStore.open(tmp_path))
    assert str(tmp_path) in str(info.value)
    assert list(tmp_path.iterdir()) == []


async def test_a_store_from_a_newer_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "runs.sqlite3"
    await (await RunStore.open(path)).close()
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA user_version = 99")
    conn.close()
    with pytest.raises(StoreError, match="schema version 99, newer"):
        await RunStore.open(path)


async def test_memory_stores_are_separate_and_throw_away() -> None:
    a, b = await RunStore.open(":memory:"), await RunStore.open(":memory:")
    try:
        assert await a.create(full_run()) == 1
        assert [r.id for r in await a.list()] == [1] and await b.list() == []
    finally:
        await a.close()
        await b.close()
    c = await RunStore.open(":memory:")
    assert await c.latest() is None
    await c.close()


async def test_a_closed_store_refuses_calls(tmp_path: Path) -> None:
    store = await RunStore.open(tmp_path / "runs.sqlite3")
    await store.close()
    await store.close()
    with pytest.raises(StoreError, match="cannot list runs: the run store is closed"):
        await store.list()


async def test_open_creates_missing_parent_directories(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "runs.sqlite3"
    store = await RunStore.open(path)
    await store.create(small_run(0))
    await store.close()
    assert path.is_file()


def test_default_path_follows_xdg_state_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert default_path() == tmp_path / "rlx-cluster" / "runs.sqlite3"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for unset in ("", "relative/state"):
        monkeypatch.setenv("XDG_STATE_HOME", unset)
        assert default_path() == tmp_path / "home" / ".local" / "state" / "rlx-cluster" / "runs.sqlite3"
