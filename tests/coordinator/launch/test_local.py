"""Workers that misbehave before reporting get a clear error and leave nothing behind."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from coordinator.launch.base import WORKER_ENV, LaunchError, local_env, thread_env
from coordinator.launch.local import Launcher
from coordinator.plan.split import split
from tests.conftest import worker_pids
from workers.protocol.report import LayerRange


async def launch_all(model: str, stages: int, build_timeout: float = 30.0):
    launcher = Launcher(model, build_timeout=build_timeout)
    try:
        return launcher, await launcher.start_all(split(8, stages))
    finally:
        if not launcher.workers:
            assert worker_pids(os.getpid()) == []


async def test_workers_report_their_real_address_and_layers():
    launcher = Launcher("fake:layers=8")
    try:
        workers = await launcher.start_all(split(8, 3))
        assert [str(w.report.layers) for w in workers] == ["0..3", "3..6", "6..8"]
        for w in workers:
            host, port = w.report.addr.rsplit(":", 1)
            assert host == "127.0.0.1" and int(port) > 0 and w.report.pid == w.proc.pid
            assert w.report.resident_bytes > 10_000_000
    finally:
        await launcher.stop_all()
    assert worker_pids(os.getpid()) == []


async def test_token_goes_through_the_environment_not_the_command_line():
    launcher = Launcher("fake:layers=8")
    assert launcher.token not in " ".join(launcher.command(LayerRange(0, 8)))


async def test_worker_that_exits_before_reporting_is_named_with_its_stderr():
    with pytest.raises(LaunchError) as failed:
        await launch_all("fake:layers=8,exit_before_report=1,stage=4", 2)
    text = str(failed.value)
    assert "stage 1 (layers 4..8) exited with status 3 before reporting" in text
    assert "command: " in text and "--layers 4..8" in text
    assert "exiting before the report, as asked" in text
    assert worker_pids(os.getpid()) == []


async def test_garbage_before_the_report_is_skipped(caplog):
    launcher, workers = await launch_all("fake:layers=8,garbage=1", 2)
    try:
        assert all(w.report is not None for w in workers)
        assert "this line is not a report" in caplog.text
    finally:
        await launcher.stop_all()
    assert worker_pids(os.getpid()) == []


async def test_invalid_report_is_a_clear_error_without_waiting_for_the_timeout():
    started = time.monotonic()
    with pytest.raises(LaunchError, match=r"stage 0 \(layers 0..4\) printed an invalid report: .*addr"):
        await launch_all("fake:layers=8,bad_report=1,stage=0", 2, build_timeout=30)
    assert time.monotonic() - started < 15
    assert worker_pids(os.getpid()) == []


async def test_worker_that_never_reports_times_out_naming_it():
    started = time.monotonic()
    with pytest.raises(LaunchError, match=r"stage 1 \(layers 4..8\) did not report within 2s"):
        await launch_all("fake:layers=8,late_ms=60000,stage=4", 2, build_timeout=2)
    assert time.monotonic() - started < 8
    assert worker_pids(os.getpid()) == []


async def test_bad_model_spec_is_reported_by_the_worker():
    launcher = Launcher("fake:layers=8,nonsense=1")
    with pytest.raises(LaunchError, match="bad option 'nonsense=1'"):
        await launcher.start(0, LayerRange(0, 8))
    assert worker_pids(os.getpid()) == []


def test_local_workers_share_the_hosts_cores_unless_threads_are_set(monkeypatch):
    monkeypatch.delenv("RLX_THREADS", raising=False)
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("RLX_THREAD_RULE", raising=False)
    # The share is the most a worker's kernels use: it may measure fewer to be faster.
    measured = {"RLX_THREAD_RULE": "measured"}
    assert thread_env(1) == {"RLX_THREADS": str(cores), "OPENBLAS_NUM_THREADS": str(cores)} | measured
    assert thread_env(cores + 1) == {"RLX_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"} | measured
    monkeypatch.setenv("RLX_THREADS", "3")
    assert thread_env(2) == {"OPENBLAS_NUM_THREADS": str(max(1, cores // 2))}


async def test_a_local_worker_gets_its_share_of_the_cores_the_worker_defaults_and_what_it_is_given(
    monkeypatch,
):
    for name in WORKER_ENV:
        monkeypatch.delenv(name, raising=False)
    launcher = Launcher("fake:layers=8", extra_env={"RLX_GIVEN": "yes"})
    expected = local_env(2) | {"RLX_GIVEN": "yes"}
    assert WORKER_ENV.items() <= expected.items()
    try:
        for w in await launcher.start_all(split(8, 2)):
            lines = Path(f"/proc/{w.pid}/environ").read_text().split("\0")
            environ = dict(line.split("=", 1) for line in lines if "=" in line)
            assert {name: environ.get(name) for name in expected} == expected
    finally:
        await launcher.stop_all()
    assert worker_pids(os.getpid()) == []


def test_a_worker_default_our_environment_sets_is_left_as_we_set_it(monkeypatch):
    for name in WORKER_ENV:
        monkeypatch.setenv(name, "ours")
    assert not WORKER_ENV.keys() & local_env(1).keys()
