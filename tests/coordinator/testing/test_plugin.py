"""The `rlx_cluster` fixture as other projects use it: a real coordinator, fake workers, faults, teardown."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from contextlib import aclosing
from pathlib import Path

import pytest

from coordinator.testing import process
from coordinator.testing.cluster import RlxCluster, with_faults
from coordinator.testing.plugin import ClusterFactory
from coordinator.testing.process import worker_pids


def state(pid: int) -> str:
    """A process's state letter from /proc (R, S, T for stopped, ...)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_cluster_serves_its_stages_and_a_run_and_is_gone_after_stop(rlx_cluster):
    c = rlx_cluster("fake:layers=4", 2)
    stages = c.stages()
    assert [s.layers for s in stages] == [(0, 2), (2, 4)] and all(s.state == "up" for s in stages)
    assert sorted(s.pid for s in stages) == sorted(worker_pids(c.pid))
    assert [s.addr for s in stages] == [n["addr"] for n in c.nodes()]
    run = c.wait(c.post_run(seq=3))
    assert run["status"] == "ok" and [t["addr"] for t in run["timings"]] == [s.addr for s in stages]
    assert c.stop() == [] and worker_pids(c.pid) == [] and c.process.returncode is not None


def test_the_token_given_is_required_and_sent(rlx_cluster):
    c = rlx_cluster("fake:layers=2", 1, token="s3cret")
    assert c.get("/nodes").status == 200
    c.token = ""
    assert c.get("/nodes").status == 401


def test_faults_by_stage_index_reach_that_stage_alone(rlx_cluster):
    # Recovery off: each new worker of stage 1 would crash on its first forward too, the run's retry.
    faults = {1: {"crash_on": 1}, 2: {"delay_ms": 1}}
    c = rlx_cluster("fake:layers=6", 3, faults=faults, recover_timeout=0)
    first, middle, last = (s.pid for s in c.stages())
    run = c.wait(c.post_run(seq=2), "failed")
    assert "stage 1" in run["error"]
    assert c.stages()[1].state != "up" and sorted(worker_pids(c.pid)) == sorted([first, last])
    assert middle not in worker_pids(c.pid)


def test_faults_are_refused_on_a_model_that_is_not_fake_or_a_stage_that_is_not_there():
    with pytest.raises(ValueError, match="faults need a fake model"):
        with_faults("synthetic:layers=4", 2, {0: {"crash_on": 1}})
    with pytest.raises(ValueError, match=r"faults name stage 2, but there are 2 stages \(0..1\)"):
        with_faults("fake:layers=4", 2, {2: {"crash_on": 1}})
    assert with_faults("fake:layers=5", 2, {1: {"hang_on": 2}}) == "fake:layers=5,hang_on@3=2"


def test_a_killed_stage_fails_the_run_in_flight_with_recovery_off(rlx_cluster):
    c = rlx_cluster("fake:layers=4,delay_ms=3000", 2, recover_timeout=0)
    run_id = c.post_run(seq=2)
    c.wait(run_id, "running")
    pid = c.kill_stage(0)
    run = c.wait(run_id, "failed")
    assert str(run["error"]) and pid not in worker_pids(c.pid)


def test_a_killed_stage_is_recovered_and_the_run_in_flight_finishes(rlx_cluster):
    c = rlx_cluster("fake:layers=4,delay_ms=300", 2)
    run_id = c.post_run(seq=2)
    c.wait(run_id, "running")
    pid = c.kill_stage(0)
    run = c.wait(run_id, "ok")
    assert pid not in worker_pids(c.pid)
    assert [r["stage"] for r in run["recoveries"]] == [0], run["recoveries"]


def test_a_paused_stage_holds_the_run_until_it_is_resumed(rlx_cluster):
    c = rlx_cluster("fake:layers=4", 2)
    pid = c.pause_stage(1)
    run_id = c.post_run(seq=2)
    for event in c.events(run=run_id, kinds=["stage_forward"], since=0, timeout=30):
        if event.data["stage"] == 0:
            break
    assert state(pid) == "T" and c.run(run_id)["status"] == "running"
    c.resume_stage(1)
    assert c.wait(run_id)["status"] == "ok"


def test_events_of_a_run_come_in_order_from_queued_to_finished(rlx_cluster):
    c = rlx_cluster("fake:layers=4", 2)
    run_id = c.post_run(seq=2)
    kinds = []
    for event in c.events(run=run_id, since=0):
        kinds.append(event.kind)
        if event.kind == "run_finished":
            assert event.data["status"] == "ok"
            break
    assert kinds == ["run_queued", "run_started", "stage_forward", "stage_forward", "run_finished"]


def test_events_that_do_not_come_fail_within_the_timeout(rlx_cluster):
    c = rlx_cluster("fake:layers=2", 1)
    with pytest.raises(AssertionError, match=r"no more events within 0\.5s"):
        list(c.events(kinds=["token"], timeout=0.5))


def test_waiting_for_a_status_the_run_will_never_reach_fails_at_once_saying_what_it_became(rlx_cluster):
    c = rlx_cluster("fake:layers=2", 1, faults={0: {"fail_on": 1}})
    with pytest.raises(AssertionError, match=r"run \d+ ended failed \(.*fake failure.*\), not \{'ok'\}"):
        c.wait(c.post_run(seq=2), timeout=20)


def test_a_coordinator_that_cannot_start_fails_the_start_with_its_stderr(rlx_cluster):
    with pytest.raises(
        AssertionError, match=r"(?s)exited with status 2 before saying 'serving on'.*accepted:"
    ):
        rlx_cluster("nonsense", 1)


async def test_the_async_face_starts_runs_waits_and_reads_events_without_blocking_the_loop(rlx_cluster):
    c = await rlx_cluster.astart("fake:layers=4,delay_ms=5", 2)
    run_id = await c.aio.post_run(seq=2)
    async with aclosing(c.aio.events(run=run_id, kinds=["run_finished"], since=0)) as events:
        finished = await anext(events)
    assert finished.data["run"] == run_id and finished.data["status"] == "ok"
    assert (await c.aio.wait(run_id))["status"] == "ok"
    assert len(await c.aio.stages()) == 2


def test_a_worker_outliving_its_coordinator_is_killed_and_reported_as_a_leak(monkeypatch):
    monkeypatch.setattr(process, "WORKER_EXIT_S", 1.0)
    factory = ClusterFactory()
    c = factory("fake:layers=2", 1)
    # A process that says it belongs to the coordinator and ignores its going: what a leak looks like.
    stray = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "--parent-pid", str(c.pid)],
        start_new_session=True,
    )
    try:
        [leak] = factory.stop_all()
        assert f"worker pid(s) [{stray.pid}] outlived it" in leak
        assert stray.wait(5) == -signal.SIGKILL
    finally:
        if stray.poll() is None:
            os.kill(stray.pid, signal.SIGKILL)
            stray.wait(5)


def test_the_handle_works_without_pytest_as_a_context_of_its_own(tmp_path):
    c = RlxCluster.start("fake:layers=2", 1, db=str(tmp_path / "runs.db"), forward_timeout=5)
    try:
        assert c.wait(c.post_run(seq=1))["status"] == "ok"
    finally:
        assert c.stop() == []
    assert (tmp_path / "runs.db").exists()


def test_a_build_time_fault_on_one_stage_fails_the_start_naming_that_stage(rlx_cluster):
    says = r"(?s)exited with status 1 before saying 'serving on'.*layers 2\.\.4"
    with pytest.raises(AssertionError, match=says):
        rlx_cluster("fake:layers=4", 2, faults={1: {"exit_before_report": 1}})


# A test that starts a cluster, says which processes it has, and is held until it is killed.
HELD_TEST = """
import json, os, time
from coordinator.testing.process import worker_pids

def test_held_until_killed(rlx_cluster):
    c = rlx_cluster("fake:layers=4", 2)
    said = {"coordinator": c.pid, "workers": worker_pids(c.pid)}
    with open(os.environ["PIDS_TMP"], "w") as f:
        json.dump(said, f)
    os.rename(os.environ["PIDS_TMP"], os.environ["PIDS"])
    time.sleep(120)  # the outer test kills this pytest long before
"""
# Seconds the fixture's coordinator and workers have to be gone once their pytest is killed.
ORPHAN_EXIT_S = 15.0


def alive(pid: int) -> bool:
    try:
        return state(pid) != "Z"
    except FileNotFoundError:
        return False


def test_a_pytest_killed_before_its_teardown_leaves_no_coordinator_or_worker_behind(tmp_path):
    pids, ini, test, out = (tmp_path / name for name in ("pids.json", "pytest.ini", "test_held.py", "out"))
    ini.write_text("[pytest]\n")
    test.write_text(HELD_TEST)
    env = {**os.environ, "PIDS": str(pids), "PIDS_TMP": str(tmp_path / "pids.tmp")}
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # the fixture from this tree, by -p, and nothing else
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "coordinator.testing.plugin",
            "-p", "no:cacheprovider", "--rootdir", tmp_path, "-c", ini, test]  # fmt: skip
    with out.open("wb") as output:
        inner = subprocess.Popen(argv, env=env, stdout=output, stderr=output)
    left: list[int] = []
    try:
        process.wait_until(lambda: pids.exists() or inner.poll() is not None, 60, "the held test's cluster")
        assert pids.exists(), f"the inner pytest ended {inner.returncode}:\n{out.read_text()[-3000:]}"
        started = json.loads(pids.read_text())
        left = [started["coordinator"], *started["workers"]]
        assert len(left) == 3 and all(alive(pid) for pid in left)
        inner.kill()  # no teardown runs: nothing but the processes themselves can stop them
        inner.wait(5)
        process.wait_until(lambda: not any(alive(pid) for pid in left), ORPHAN_EXIT_S, "the orphans to go")
    finally:
        inner.kill()
        inner.wait(5)
        for pid in filter(alive, left):
            os.kill(pid, signal.SIGKILL)


def test_a_cluster_started_from_a_thread_that_has_ended_keeps_serving(rlx_cluster):
    # The kernel's parent-death signal comes when the thread that started a process ends: only a
    # parent that is really gone may stop the coordinator.
    started: list[RlxCluster] = []
    thread = threading.Thread(target=lambda: started.append(rlx_cluster("fake:layers=2", 1)))
    thread.start()
    thread.join(60)
    [c] = started
    assert c.wait(c.post_run(seq=1))["status"] == "ok"
    assert c.process.returncode is None and len(worker_pids(c.pid)) == 1
