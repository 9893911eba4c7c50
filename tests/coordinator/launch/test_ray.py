"""Workers placed by a real local Ray: the same output and restarts, clear placement errors, no leftovers.

One Ray instance serves the whole module (it takes seconds to start): the one
the coordinator starts for itself when given no address (no dashboard; the
machine's CPUs, 2 on this project's machines), its files in a temporary
directory, bound to loopback. The `ray_instance` fixture starts it through a
RayLauncher, closes that launcher at the end, and checks that every process
it brought (Ray's own, the actors and their workers) is gone.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio

# Ray binds a single machine's instance to loopback only when told it is not a cluster; read at import.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
if importlib.util.find_spec("ray") is None:
    pytest.skip("ray is not installed (pip install -e '.[ray]' brings it)", allow_module_level=True)

from coordinator.cli.main import UsageError, cluster_config, parse_args
from coordinator.cluster import ClusterConfig, open_cluster
from coordinator.launch.base import THREAD_VARS, LaunchError
from coordinator.plan.split import split
from coordinator.runs.runner import RunRequest
from tests.blas_threads import BLAS_VAR
from tests.conftest import eventually
from tests.support.lazy import lazy_import
from workers.fake import reference
from workers.models import build
from workers.models.synthetic import make_input
from workers.protocol import auth
from workers.protocol.report import LayerRange

# Ray (most of a second of CPU) imported when a test first uses it: every pytest process of a run
# collects this file, one runs it.
ray = lazy_import("ray")
RAY_LAUNCH = lazy_import("coordinator.launch.ray")

SYNTHETIC = "synthetic:layers=4,hidden=64,seed=5"


def children() -> dict[int, int]:
    """Every live process's parent, by pid (zombies left out)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            except OSError:
                continue
            if state != "Z":
                parents[int(entry.name)] = int(ppid)
    return parents


def descendants(root: int) -> set[int]:
    """The live processes below `root`, at any depth."""
    parents, found, frontier = children(), set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def stage_hosts() -> set[int]:
    """Live actor processes of this launcher (Ray titles them after the actor's class)."""
    return {pid for pid in descendants(os.getpid()) if cmdline(pid).startswith(b"ray::StageHost")}


def alive(pids: set[int]) -> set[int]:
    return pids & set(children())


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def ray_instance():
    """The coordinator's own local Ray for this module, in a temporary directory; nothing of it left after."""
    # Ray's socket paths must stay under 108 bytes: a short directory of our own under /tmp.
    with (
        tempfile.TemporaryDirectory(prefix="rlx-ray-", dir="/tmp") as temp,
        pytest.MonkeyPatch.context() as m,
    ):
        m.setenv("RAY_TMPDIR", temp)
        # Each actor sizes its worker's pools from its bundle, unless its environment (Ray's, started from
        # ours) sets a count: the one tests/blas_threads.py may set for this test process stays out of it.
        m.delenv(BLAS_VAR, raising=False)
        owner = RAY_LAUNCH.RayLauncher(SYNTHETIC)
        await owner.connect()
        try:
            yield owner
        finally:
            brought = descendants(os.getpid())
            await owner.close()
            await eventually(lambda: not alive(brought), 20, "every process of the Ray instance to exit")
            assert not ray.is_initialized()


def placement_groups_left() -> list[dict]:
    return [group for group in ray.util.placement_group_table().values() if group["state"] != "REMOVED"]


async def test_a_synthetic_pipeline_placed_through_ray_gives_bitwise_the_local_output(ray_instance, cluster):
    request = RunRequest(seq=7, seed=11)
    by_local = await asyncio.wait_for((await cluster(SYNTHETIC, 2)).runner.run(request), 60)
    # Half a CPU a bundle: a fraction of a CPU computes on 1 thread.
    async with open_cluster(
        ClusterConfig(SYNTHETIC, 2, launcher="ray", ray_cpus=0.5, build_timeout=60)
    ) as placed:
        by_ray = await asyncio.wait_for(placed.runner.run(request), 60)
        token, actors = placed.supervisor.token, stage_hosts()
        assert [thread_vars(node.report.pid) for node in placed.pipeline.nodes] == [counts(1)] * 2
        # Each worker is a Ray actor's child, on loopback; the token is in both environments, not in argv.
        for node in placed.pipeline.nodes:
            worker = node.report.pid
            actor = children()[worker]
            assert actor in actors and node.report.addr.startswith("127.0.0.1:")
            for pid in (actor, worker):
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                assert f"{auth.WORKER_TOKEN_ENV}={token}".encode() in environ
                assert token.encode() not in cmdline(pid)
    await eventually(lambda: not alive(actors), 15, "the actors to exit")
    assert not placement_groups_left() and ray.is_initialized()  # the module's Ray: not the cluster's to end
    assert by_ray.status == by_local.status == "ok", (by_ray.error, by_local.error)
    whole = build(SYNTHETIC, LayerRange(0, 4), "f32").forward(
        make_input(7, 64, 11), session="s", start_pos=0, last_only=False
    )
    assert np.asarray(by_ray.output, np.float32).tobytes() == whole.tobytes()
    assert by_ray.output_digest == by_local.output_digest


def thread_vars(pid: int) -> dict[str, str]:
    """The thread counts in a process's environment, as the kernel holds it."""
    environ = dict(
        v.split(b"=", 1) for v in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in v
    )
    return {k: environ.get(k.encode(), b"").decode() for k in THREAD_VARS}


def counts(n: int) -> dict[str, str]:
    """thread_vars of a worker computing on n threads."""
    return dict.fromkeys(THREAD_VARS, str(n))


# Each of these clusters costs its actors' start (seconds of CPU on this project's 2-core machines):
# the suite checks each bundle's threads in the tests that place those bundles anyway (half a CPU in
# the first above, one in the bitwise comparison below, two in the killed actor's); all three here
# with the soak.
@pytest.mark.soak
@pytest.mark.parametrize(("stages", "cpus", "threads"), [(2, 1.0, 1), (2, 0.5, 1), (1, 2.0, 2)])
async def test_each_ray_worker_computes_with_as_many_threads_as_its_bundle_has_cpus(
    ray_instance, stages, cpus, threads
):
    config = ClusterConfig(SYNTHETIC, stages, launcher="ray", ray_cpus=cpus, build_timeout=60)
    async with open_cluster(config) as placed:
        pids = [node.report.pid for node in placed.pipeline.nodes]
        assert len(pids) == stages and all(children()[pid] in stage_hosts() for pid in pids)
        assert [thread_vars(pid) for pid in pids] == [counts(threads)] * stages  # a fraction of a CPU: 1


# Products big enough that OpenBLAS splits them between threads, and 1 and 2 threads round differently.
THREADED = "synthetic:layers=4,hidden=256,seed=5"


async def test_the_same_split_and_threads_give_bitwise_the_same_output_through_ray_or_local_workers(
    ray_instance, cluster, monkeypatch
):
    request = RunRequest(seq=64, seed=11)
    config = ClusterConfig(THREADED, 2, launcher="ray", ray_cpus=1.0, build_timeout=60)
    async with open_cluster(config) as placed:
        # Each bundle's one CPU: one thread.
        assert [thread_vars(node.report.pid) for node in placed.pipeline.nodes] == [counts(1)] * 2
        by_ray = await asyncio.wait_for(placed.runner.run(request), 60)
    # One thread per local worker, as on each 1-CPU bundle, however many cores this host has.
    with monkeypatch.context() as m:
        m.setenv("RLX_THREADS", "1")
        m.setenv("OPENBLAS_NUM_THREADS", "1")
        by_local = await asyncio.wait_for((await cluster(THREADED, 2)).runner.run(request), 60)
    assert by_ray.status == by_local.status == "ok", (by_ray.error, by_local.error)
    ray_out, local_out = (np.asarray(r.output, np.float32) for r in (by_ray, by_local))
    assert ray_out.size == local_out.size == 64 * 256
    differ = np.flatnonzero(ray_out != local_out)
    same = np.array_equal(
        np.frombuffer(ray_out.tobytes(), np.uint8), np.frombuffer(local_out.tobytes(), np.uint8)
    )
    assert same, f"{differ.size} of {ray_out.size} floats differ, the first at {differ[:1]}"


# Every actor Ray starts costs seconds of CPU on this project's 2-core machines: the suite keeps the
# recovery from a killed actor (below); this one, a worker killed in a live actor and then the actor,
# runs with the soak.
@pytest.mark.soak
async def test_a_killed_worker_or_actor_fails_the_run_naming_its_stage_and_a_live_or_new_actor_brings_it_up(
    ray_instance, api_factory
):
    # Recovery off: the run fails as the stage dies (with it on, the run would wait for the new actor).
    api = await api_factory("fake:layers=4,delay_ms=1000,stage=2", 2, launcher="ray", recover_timeout=0)
    _, first, _ = await api.post("/runs", json={"seq": 2, "seed": 3})
    first = await api.finished(first["id"], 15)
    assert first["status"] == "ok"
    _, body, _ = await api.post("/runs", json={"seq": 2, "seed": 3})
    killed = (await api.get("/nodes"))[1]["nodes"][1]
    actor = children()[killed["pid"]]

    async def at_stage_1():
        run = (await api.get(f"/runs/{body['id']}"))[1]
        return run["status"] == "running" and len(run["timings"]) == 1

    await eventually(at_stage_1, 10, "the run to reach stage 1")
    os.kill(killed["pid"], signal.SIGKILL)
    run = await api.finished(body["id"], 5)
    assert run["status"] == "failed" and "stage 1" in run["error"] and killed["addr"] in run["error"]
    node = await back_up(api, 1, restarts=1, gone=killed["addr"])
    assert node["pid"] != killed["pid"] and children()[node["pid"]] == actor  # the live actor started it
    # An actor that dies takes its worker along (the kernel's parent-death signal); the stage comes back too.
    os.kill(actor, signal.SIGKILL)
    await eventually(lambda: not alive({node["pid"]}), 5, "the actor's worker to die with it")
    node = await back_up(api, 1, restarts=2, gone="the Ray actor of stage 1 (layers 2..4) is gone")
    assert children()[node["pid"]] != actor
    _, again, _ = await api.post("/runs", json={"seq": 2, "seed": 3})
    again = await api.finished(again["id"], 15)
    assert again["status"] == "ok" and again["output_digest"] == first["output_digest"]


async def test_a_run_whose_ray_actor_is_killed_mid_forward_waits_for_the_new_actor_and_finishes(
    ray_instance, api_factory
):
    # One stage (each actor Ray starts costs seconds of CPU); a generous recover timeout: Ray starts
    # the new actor's process, then the actor its worker, and on a busy machine that takes a while.
    api = await api_factory(
        "fake:layers=4,delay_ms=1000", 1, launcher="ray", ray_cpus=2.0, recover_timeout=60
    )
    [killed] = (await api.get("/nodes"))[1]["nodes"]
    actor = children()[killed["pid"]]
    assert thread_vars(killed["pid"]) == counts(2)  # a bundle of two CPUs: two threads
    run_id = await api.submit({"seq": 2, "seed": 3})
    runner = api.cluster.runner
    await eventually(lambda: runner.latest.id == run_id and runner.latest.status == "running", 10, "the run")
    os.kill(actor, signal.SIGKILL)  # mid-way through the stage's 1 s forward: the worker dies with it
    run = await api.finished(run_id, 70)
    assert run["status"] == "ok", run["error"]
    [recovery] = run["recoveries"]
    [node] = (await api.get("/nodes"))[1]["nodes"]
    assert (recovery["stage"], recovery["addr"], recovery["new_addr"]) == (0, killed["addr"], node["addr"])
    # A new actor started the new worker.
    assert node["pid"] != killed["pid"] and children()[node["pid"]] in stage_hosts() - {actor}
    assert thread_vars(node["pid"]) == counts(2)
    _, done, _ = await api.get(f"/runs/{run_id}?output=1")
    assert done["output"] == reference(make_input(2, 4, 3), range(4)).ravel().tolist()


async def back_up(api, stage: int, restarts: int, gone: str) -> dict:
    """Wait until `stage` is up after its restart number `restarts`, having seen it restarting and `gone`."""
    seen: list[tuple[str, str | None]] = []

    async def up():
        node = (await api.get("/nodes"))[1]["nodes"][stage]
        seen.append((node["state"], node["error"]))
        return node if node["state"] == "up" and node["restarts"] == restarts else None

    node = await eventually(up, 40, f"stage {stage} to come back through a new actor")
    assert "restarting" in {state for state, _ in seen}, seen
    assert any(error and gone in error for _, error in seen), seen
    assert node["error"] is None
    return node


# The coordinator killed is the case it cannot clean up after (Ray's owner-death does); its SIGTERM,
# handled by the same close as every test's cluster end, runs with the soak.
@pytest.mark.parametrize("sig", [pytest.param(signal.SIGTERM, marks=pytest.mark.soak), signal.SIGKILL])
async def test_a_coordinator_on_a_ray_cluster_leaves_no_actor_or_worker_when_stopped_or_killed(
    ray_instance, sig
):
    before = stage_hosts()
    coordinator = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "coordinator", "serve", "--model", "fake:layers=4", "--stages", "1",
        "--launcher", "ray", "--ray-address", ray.get_runtime_context().gcs_address,
        "--db", ":memory:", "--http", "127.0.0.1:0", "--build-timeout", "60",
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    said: list[str] = []
    reader = asyncio.create_task(read_lines(coordinator.stderr, said))
    try:
        serving = lambda: any(line.startswith("serving on") for line in said)  # noqa: E731
        assert await eventually(lambda: serving() or coordinator.returncode, 150) is True, said
        actors = stage_hosts() - before
        workers = {pid for pid, parent in children().items() if parent in actors}
        assert len(actors) == len(workers) == 1, said
        coordinator.send_signal(sig)
        # A SIGTERM is the coordinator's to handle: no abort by Ray's crash handler (status 134) midway.
        assert await asyncio.wait_for(coordinator.wait(), 30) == (143 if sig == signal.SIGTERM else -sig)
        await eventually(lambda: not alive(actors | workers), 30, "its actors and workers to end")
    finally:
        if coordinator.returncode is None:
            coordinator.kill()
            await coordinator.wait()
        await asyncio.wait_for(reader, 10)
    assert not placement_groups_left()


async def read_lines(stream: asyncio.StreamReader, into: list[str]) -> None:
    while line := await stream.readline():
        into.append(line.decode(errors="replace").strip())


async def test_an_impossible_placement_is_a_clear_error_within_the_build_timeout(ray_instance):
    cpus = ray.cluster_resources()["CPU"]
    launcher = RAY_LAUNCH.RayLauncher("fake:layers=4", cpus=cpus, build_timeout=1)
    started, said = time.monotonic(), []
    with pytest.raises(LaunchError) as refused:
        await asyncio.wait_for(launcher.start_all(split(4, 2), said.append), 20)
    assert time.monotonic() - started < 5
    short = f"{2 * cpus:g} CPUs needed, the cluster has {cpus:g}"
    assert f"Ray cannot place them yet ({short}): waiting up to 1 s" in said  # said at once, not at the end
    error = str(refused.value)
    assert error.startswith(f"Ray could not place 2 stage(s) ({cpus:g} CPU and ") and "SPREAD" in error
    assert f"within 1 s on 1 node(s): {short}" in error
    assert launcher.group is None and not launcher.workers and not stage_hosts()
    assert not placement_groups_left()


async def test_a_strict_spread_over_more_stages_than_nodes_names_the_nodes_missing(ray_instance):
    launcher = RAY_LAUNCH.RayLauncher("fake:layers=4", strategy="STRICT_SPREAD", cpus=0.1, build_timeout=1)
    with pytest.raises(LaunchError, match=r"STRICT_SPREAD needs 2 nodes, the cluster has 1"):
        await asyncio.wait_for(launcher.start_all(split(4, 2)), 20)
    assert not placement_groups_left()


def test_an_unknown_strategy_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"'SPRAED' is unknown; use one of SPREAD, STRICT_SPREAD, PACK"):
        RAY_LAUNCH.RayLauncher("fake", strategy="SPRAED")


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--ray-address", "auto"], "--ray-address: only with --launcher ray"),
        (["--ray-strategy", "PACK", "--ray-cpus", "2"], "--ray-strategy, --ray-cpus: only with --launcher"),
        (["--launcher", "ray", "--attach", "127.0.0.1:7001"], "--launcher ray starts the workers: not with"),
    ],
)
def test_ray_options_without_the_ray_launcher_are_refused_naming_them(argv, says):
    with pytest.raises(UsageError, match=re.escape(says)):
        cluster_config(parse_args(["serve", "--model", "fake", *argv]))
