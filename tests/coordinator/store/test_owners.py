"""Coordinators sharing a run store: one history, ids that never collide, a dead owner's runs interrupted."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import signal
import sqlite3
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest

from coordinator.stats import ClusterRun
from coordinator.store.file import APPLICATION_ID, LOCK_SUFFIX
from coordinator.store.history import INTERRUPTED_ERROR, SWEEP_EVERY_S, RunStore, StoreError
from tests.conftest import eventually
from tests.coordinator.store.test_history import full_run, small_run
from tests.support.serving import REPO, Serve
from tests.support.store_files import stored

CHILD_TIMEOUT_S = 30
# A sweep runs every SWEEP_EVERY_S; this bounds the wait for one on a busy machine.
SWEPT_S = 5 * SWEEP_EVERY_S + 5


def statuses(path: Path) -> dict[int, str]:
    """Every run's status column, by id, as another connection reads the file."""
    conn = sqlite3.connect(path)
    try:
        return dict(conn.execute("SELECT id, status FROM runs"))
    finally:
        conn.close()


async def test_two_stores_writing_at_once_never_collide_on_an_id_and_each_lists_every_run(tmp_path) -> None:
    path = tmp_path / "runs.sqlite3"
    a, b = await RunStore.open(path), await RunStore.open(path)
    try:
        made = await asyncio.wait_for(
            asyncio.gather(*(store.create(small_run(i)) for i in range(50) for store in (a, b))), 60
        )
        assert sorted(made) == list(range(1, 101))
        for store in (a, b):
            assert [r.id for r in await store.list(limit=1000)] == list(range(100, 0, -1))
    finally:
        await a.close()
        await b.close()


HOLDER = """
import asyncio, sys
from coordinator.stats import ClusterRun
from coordinator.store.history import RunStore

async def main():
    store = await RunStore.open(sys.argv[1])
    for status in ("ok", "running", "queued"):
        await store.create(ClusterRun(timings=[], total_forward_ms=0.0, output=[], status=status))
    print("open", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_an_open_store_marks_the_runs_of_a_killed_owner_interrupted_by_itself_and_keeps_its_own(
    tmp_path: Path,
) -> None:
    path = tmp_path / "runs.sqlite3"
    store = await RunStore.open(path)
    mine = small_run(0, status="running")
    await store.create(mine)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HOLDER, str(path), cwd=REPO, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        try:
            assert await asyncio.wait_for(proc.stdout.readline(), CHILD_TIMEOUT_S) == b"open\n"
            assert await store.interrupt_unfinished() == 0  # as a sweep does: a live owner's runs go on
            assert statuses(path) == {1: "running", 2: "ok", 3: "running", 4: "queued"}
        finally:
            proc.send_signal(signal.SIGKILL)
            await asyncio.wait_for(proc.wait(), CHILD_TIMEOUT_S)

        async def swept() -> bool:
            return [r.status for r in await store.list()] == ["interrupted", "interrupted", "ok", "running"]

        await eventually(swept, SWEPT_S, "the killed owner's runs to be marked interrupted")
        assert (await store.get(3)).error == INTERRUPTED_ERROR
        assert await store.interrupt_unfinished() == 0  # nothing more: its own run goes on
        mine.status = "ok"
        await store.save(mine)
        assert statuses(path) == {1: "ok", 2: "ok", 3: "interrupted", 4: "interrupted"}
    finally:
        await store.close()


def write_schema_1(path: Path, runs: list[ClusterRun]) -> None:
    """A run store as a schema 1 coordinator left it: no owner column, `runs` stored as it stored them."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.executescript(
            "CREATE TABLE runs (id INTEGER PRIMARY KEY AUTOINCREMENT, status TEXT NOT NULL,"
            " created_at REAL NOT NULL, run BLOB NOT NULL, output BLOB NOT NULL);"
            "CREATE INDEX runs_unfinished ON runs(status) WHERE status IN ('queued', 'running');"
            f"PRAGMA application_id = {APPLICATION_ID}; PRAGMA user_version = 1;"
        )
        for run in runs:
            meta = msgspec.json.encode(msgspec.structs.replace(run, output=[]))
            output = np.asarray(run.output, np.float32).tobytes()
            conn.execute(
                "INSERT INTO runs (status, created_at, run, output) VALUES (?, ?, ?, ?)",
                (run.status, run.created_at, meta, output),
            )
        conn.execute("DELETE FROM runs WHERE id = ?", (len(runs),))  # its id is never given again
    finally:
        conn.close()


async def test_a_schema_1_file_is_migrated_keeping_its_runs_and_its_unfinished_ones_are_interrupted(
    tmp_path: Path,
) -> None:
    path = tmp_path / "runs.sqlite3"
    old = [full_run(), small_run(1, status="running"), small_run(2, status="queued"), small_run(3)]
    write_schema_1(path, old)
    store = await RunStore.open(path)
    try:
        conn = sqlite3.connect(path)
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 2
        assert [row[1] for row in conn.execute("PRAGMA table_info(runs)")][-1] == "owner"
        conn.close()
        assert await store.get(1, with_output=True) == msgspec.structs.replace(old[0], id=1)
        assert await store.interrupt_unfinished() == 2  # their coordinator, of schema 1, is gone
        assert [(r.id, r.status) for r in await store.list()] == [
            (3, "interrupted"),
            (2, "interrupted"),
            (1, "ok"),
        ]
        assert await store.create(small_run(4)) == 5
    finally:
        await store.close()
    again = await RunStore.open(path)
    try:
        assert [r.id for r in await again.list()] == [5, 3, 2, 1]
    finally:
        await again.close()


async def test_a_file_an_older_coordinator_holds_is_refused_naming_it_and_left_untouched(tmp_path) -> None:
    path = tmp_path / "runs.sqlite3"
    write_schema_1(path, [small_run(0, status="running"), small_run(1)])
    # A schema 1 coordinator locks `<file>.lock` exclusively and writes its pid and host there.
    fd = os.open(str(path) + LOCK_SUFFIX, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, json.dumps({"pid": 4242, "host": "old-host", "since": 0.0}).encode())
        data = path.read_bytes()
        with pytest.raises(StoreError, match="pid 4242 on host old-host") as refused:
            await RunStore.open(path)
        assert f"{path}: the run store is in use by a coordinator of an older version" in str(refused.value)
        assert path.read_bytes() == data and statuses(path) == {1: "running"}
    finally:
        os.close(fd)


async def test_an_owner_id_edited_in_the_file_names_no_live_owner_and_no_path(tmp_path: Path) -> None:
    path, bait = tmp_path / "runs.sqlite3", tmp_path / "bait"
    bait.write_text("not a lock")
    await (await RunStore.open(path)).close()
    conn = sqlite3.connect(path, isolation_level=None)
    insert = "INSERT INTO runs (status, created_at, run, output, owner) VALUES ('running', 0, ?, x'', ?)"
    for owner in ("../bait", "1@host-zzzzzzzz", ""):
        conn.execute(insert, (msgspec.json.encode(small_run(0, status="running")), owner))
    conn.close()
    store = await RunStore.open(path)
    try:
        assert await store.interrupt_unfinished() == 3
    finally:
        await store.close()
    assert bait.read_text() == "not a lock"


@pytest.mark.parametrize("killed", ["first", "second"])
async def test_a_sigkilled_coordinator_leaves_the_others_runs_intact_and_its_unfinished_ones_interrupted(
    tmp_path: Path, killed: str
) -> None:
    db = tmp_path / "runs.sqlite3"
    common = ("--stages", "1", "--db", str(db), "--max-active", "1")
    # The one killed answers its first forward and never its second; the survivor takes 2 s for each.
    models = {"victim": "fake:layers=2,hang_on=2", "survivor": "fake:layers=2,delay_ms=2000"}
    order = ["victim", "survivor"] if killed == "first" else ["survivor", "victim"]
    started: dict[str, Serve] = {}
    try:
        for role in order:  # one after the other: the second opens the file the first already serves from
            started[role] = await Serve.start("--model", models[role], *common)
            await started[role].said("serving on", 60)
        victim, survivor = started["victim"], started["survivor"]
        done = {role: await serve.cluster.aio.post_run(seq=2) for role, serve in started.items()}
        for role, serve in started.items():
            await serve.cluster.aio.wait(done[role], "ok", 20)
        hung, queued = await victim.cluster.aio.post_run(seq=2), await victim.cluster.aio.post_run(seq=2)
        going = await survivor.cluster.aio.post_run(seq=2)
        await eventually(
            lambda: stored(db, hung)[0] == stored(db, going)[0] == "running", 10, "runs to start"
        )
        assert stored(db, queued)[0] == "queued"

        victim.proc.send_signal(signal.SIGKILL)
        assert await victim.exit_code() == -signal.SIGKILL
        assert (await survivor.cluster.aio.wait(going, "ok", 20))["status"] == "ok"
        interrupted = lambda: {stored(db, i)[0] for i in (hung, queued)} == {"interrupted"}  # noqa: E731
        await eventually(interrupted, SWEPT_S, "the survivor to mark the killed one's runs interrupted")
        # The survivor runs another model: it takes them over only to say why they are not resumed.
        victim_model, survivor_model = models["victim"], models["survivor"]
        why = f"; not resumed: it ran model {victim_model}, and this coordinator runs {survivor_model}"
        assert stored(db, hung)[1]["error"] == INTERRUPTED_ERROR + why
        everything = {done["victim"]: "ok", done["survivor"]: "ok", hung: "interrupted",
                      queued: "interrupted", going: "ok"}  # fmt: skip
        listed = (await survivor.get("/runs"))[1]["runs"]
        assert {r["id"]: r["status"] for r in listed} == everything == statuses(db)

        # The survivor killed in turn with a run in flight: the next start marks that one.
        last = await survivor.cluster.aio.post_run(seq=2)
        await eventually(lambda: stored(db, last)[0] == "running", 10, "the run to start")
        survivor.proc.send_signal(signal.SIGKILL)
        assert await survivor.exit_code() == -signal.SIGKILL
        started["next"] = after = await Serve.start("--model", "fake:layers=2", *common)
        await after.said("serving on", 60)
        listed = (await after.get("/runs"))[1]["runs"]
        assert {r["id"]: r["status"] for r in listed} == everything | {last: "interrupted"} == statuses(db)
        assert await after.cluster.aio.post_run(seq=2) == last + 1
    finally:
        for serve in started.values():
            await serve.stop()
    assert "Traceback" not in "".join(serve.stderr for serve in started.values())
