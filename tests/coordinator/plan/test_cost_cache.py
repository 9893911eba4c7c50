"""A measured plan keeps its layer costs in the run store's file, reused while its inputs stay the same."""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
from pathlib import Path

import msgspec
import pytest

from coordinator.cli.main import main
from coordinator.cluster import ClusterConfig, open_cluster
from coordinator.launch.base import local_env
from coordinator.plan import calibration
from coordinator.plan.calibration import make_plan
from coordinator.store.history import RunStore
from tests.support.store_files import WriteLock
from tests.support.tiny_gguf import TinyLlama, write_tiny_llama
from workers.calibrate import Costs

TINY = TinyLlama(n_layers=4)


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    """A tiny llama GGUF that builds in f32 and packed."""
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, TINY, mixed_types=True)
    return path


@pytest.fixture(scope="module")
def measured() -> dict[tuple, bytes]:
    """What calibrate printed for each distinct input, measured once for the module's tests."""
    return {}


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch, measured: dict[tuple, bytes]) -> list[list[str]]:
    """The arguments of each calibrate process the planner starts.

    Each input (the file's bytes, the arguments, the environment) is measured for real by the first test that
    asks for it, in its own calibrate process; a later ask for the same input, here or in another test, is
    counted the same but answered with those costs, as the cache's tests look only at when the planner
    measures and what it keeps, never at the numbers (a process costs ~2 s of CPU, the packed kernels'
    cache loaded again each time).
    """
    started: list[list[str]] = []
    real = calibration._calibrate

    async def counted(model, args, type_, env, timeout):
        started.append(args)
        environ = {name: value for name, value in (os.environ | env).items() if name != "PYTEST_CURRENT_TEST"}
        key = (Path(model).read_bytes(), tuple(args), type_, tuple(sorted(environ.items())))
        if key not in measured:
            measured[key] = msgspec.json.encode(await real(model, args, type_, env, timeout))
        return msgspec.json.decode(measured[key], type=type_)

    monkeypatch.setattr(calibration, "_calibrate", counted)
    return started


def plan(capsys: pytest.CaptureFixture[str], model: Path, db: Path | str, *more: str) -> list[str]:
    """Run `rlx-cluster plan` (measured, 2 stages) here; the lines it printed."""
    with pytest.raises(SystemExit) as exited:
        main(["plan", "--model", str(model), "--stages", "2", "--plan", "measured", "--db", str(db), *more])
    out, err = capsys.readouterr()
    assert exited.value.code == 0, err
    return out.splitlines()


def test_a_second_plan_with_the_same_inputs_reuses_the_kept_costs_without_starting_calibrate(
    capsys, tiny, tmp_path, launches
):
    db = tmp_path / "runs.sqlite3"
    first = plan(capsys, tiny, db)
    assert len(launches) == 1
    assert first[-1] == f"layer costs: measured now, kept in {db}"
    second = plan(capsys, tiny, db)
    assert len(launches) == 1, "the second plan measured again"
    assert second[:-1] == first[:-1], "the reused costs give another split or other times"
    assert second[-1].startswith("layer costs: reused, measured ")
    assert second[-1].endswith(f"(kept in {db}; --recalibrate measures again)")
    plan(capsys, tiny, db, "--recalibrate")
    assert len(launches) == 2


def test_a_changed_file_precision_or_thread_count_is_measured_again(
    capsys, tiny, tmp_path, launches, monkeypatch, caplog
):
    db = tmp_path / "runs.sqlite3"
    plan(capsys, tiny, db)  # a GGUF file: packed unless asked otherwise
    plan(capsys, tiny, db, "--precision", "f32")
    assert [args[1] for args in launches] == ["packed", "f32"]
    plan(capsys, tiny, db, "--precision", "packed")
    assert len(launches) == 2, "each precision's costs are kept apart"
    stat = tiny.stat()
    os.utime(tiny, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with caplog.at_level(logging.INFO, "coordinator.plan.cost_cache"):
        assert plan(capsys, tiny, db, "--precision", "packed")[-1].startswith("layer costs: measured now")
    assert len(launches) == 3
    assert "are stale" in caplog.text
    monkeypatch.setenv("RLX_THREADS", "3")
    plan(capsys, tiny, db, "--precision", "packed")
    assert len(launches) == 4, "costs measured on other threads were reused"


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (b"{not json", "cannot be read"),
        (msgspec.json.encode(Costs(layers=[1.0], precision="packed")), "they hold 1 layers, the model has 4"),
        (msgspec.json.encode(Costs(layers=[1.0] * 4, precision="f32")), "they were measured in f32"),
        (
            msgspec.json.encode(Costs(layers=[1.0] * 4, precision="packed", stage_ms=-1.0)),
            "a stage's fixed cost is not a finite number",
        ),
    ],
)
def test_a_damaged_entry_is_logged_measured_again_and_replaced(
    capsys, tiny, tmp_path, launches, caplog, damage, says
):
    db = tmp_path / "runs.sqlite3"
    plan(capsys, tiny, db)
    with sqlite3.connect(db) as conn:
        assert conn.execute("UPDATE calibrations SET costs = ?", (damage,)).rowcount == 1
    conn.close()
    with caplog.at_level(logging.WARNING, "coordinator.plan.cost_cache"):
        assert plan(capsys, tiny, db)[-1] == f"layer costs: measured now, kept in {db}"
    assert len(launches) == 2 and says in caplog.text
    assert plan(capsys, tiny, db)[-1].startswith("layer costs: reused")
    assert len(launches) == 2, "the damaged entry was not replaced"


async def test_costs_are_kept_beside_a_coordinator_on_the_file_and_a_held_write_lock_is_not_waited_out(
    tiny, tmp_path, launches
):
    db = tmp_path / "runs.sqlite3"
    env = local_env(2)
    store = await RunStore.open(db)  # a coordinator serving from the file meanwhile
    try:
        lock = WriteLock(db)
        try:
            async with asyncio.timeout(60):
                held = await make_plan("measured", str(tiny), TINY.n_layers, 2, "f32", env, db=db)
        finally:
            lock.release()
        assert not held.reused and held.source.startswith("measured now, not kept: ")
        assert "database is locked" in held.source
        async with asyncio.timeout(60):
            kept = await make_plan("measured", str(tiny), TINY.n_layers, 2, "f32", env, db=db)
            again = await make_plan("measured", str(tiny), TINY.n_layers, 2, "f32", env, db=db)
    finally:
        await store.close()
    assert (kept.reused, again.reused, len(launches)) == (False, True, 2)
    assert again.costs == kept.costs


async def test_a_memory_store_keeps_no_costs(tiny, launches):
    env = local_env(2)
    async with asyncio.timeout(60):
        for _ in range(2):
            done = await make_plan("measured", str(tiny), TINY.n_layers, 2, "f32", env, db=":memory:")
            assert done.source == "measured now, not kept (--db :memory: keeps nothing)"
    assert len(launches) == 2


async def test_a_cluster_started_again_on_the_same_store_reuses_the_costs_it_measured(
    tiny_chat, tmp_path, launches
):
    said: list[str] = []
    db = tmp_path / "runs.sqlite3"
    config = ClusterConfig(str(tiny_chat), 2, plan="measured", db=db, progress=said.append)
    for _ in range(2):
        async with asyncio.timeout(120), open_cluster(config) as cluster:
            assert len(cluster.pipeline.nodes) == 2
    assert len(launches) == 1
    assert sum(line.startswith("reusing each layer's decode time as measured ") for line in said) == 1, said
