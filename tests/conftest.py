"""Shared helpers: bounded waits, a look at the real process table, pipelines and clusters."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from coordinator.cluster import Cluster, ClusterConfig, open_cluster
from coordinator.launch.local import Launcher
from coordinator.plan.split import split
from coordinator.stages.pipeline import Pipeline
from coordinator.stages.supervisor import launch_pipeline
from coordinator.testing.process import worker_pids as worker_pids  # one copy, shared with the plugin
from tests.support.joiners import Joiners
from workers.models import ModelSpecError, build, describe, smollm2_path
from workers.protocol.report import LayerRange
from workers.stage import Stage

# The files that take longest, first. xdist hands files to its processes in collection order, so these
# start at once rather than last, when the other processes would be done and the cores wait on them.
# Ordered by wall seconds under make test's contention (4 processes on 2 cores), longest first; keeping
# this order needs xdist's --no-loadscope-reorder, which otherwise sorts the files by their test count.
SLOWEST_FIRST = (
    "tests/coordinator/launch/test_ray.py",
    "tests/test_installed_plugin.py",
    "tests/coordinator/stages/test_supervisor.py",
    "tests/coordinator/cli/test_main.py",
    "tests/coordinator/testing/test_plugin.py",
    "tests/workers/models/test_llama.py",
    "tests/coordinator/stages/test_gemma3_file.py",
    "tests/coordinator/api/test_streams.py",
    "tests/workers/models/test_block.py",
    "tests/coordinator/cli/test_remote.py",
    "tests/workers/models/test_packed.py",
    "tests/coordinator/api/test_openapi.py",
    "tests/coordinator/stages/test_llama_pipeline.py",
    "tests/coordinator/store/test_owners.py",
    "tests/workers/models/test_gguf_file.py",
    "tests/workers/protocol/test_wire.py",
    "tests/coordinator/store/test_failures.py",
    "tests/workers/models/test_llamacpp_fixtures.py",
    "tests/coordinator/cli/test_chat_template_option.py",
    "tests/coordinator/api/test_origins.py",
    "tests/coordinator/stages/test_join.py",
    "tests/hosts/test_compose_hosts.py",
    "tests/coordinator/api/test_api.py",
    "tests/coordinator/plan/test_split.py",
)


def pytest_configure(config: pytest.Config) -> None:
    """Write bytecode, for the test modules and for every process the tests start, whatever the shell says.

    Under PYTHONDONTWRITEBYTECODE nothing is ever cached: each pytest process rewrites the asserts of every
    test module it collects (about 8 s of CPU), and each worker and coordinator started compiles the
    project's sources again (about 0.1 s each, hundreds of times a run). The caches go to `__pycache__`
    (ignored by git), beside the compiled kernels'.
    """
    sys.dont_write_bytecode = False
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put the slowest files first, each file's tests in their order."""
    rank = {path: i for i, path in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


# What an independent runtime outputs for one prompt on the same model file (a copy of the
# project's shared fixture, so that a clone alone can check the forward against it).
REFERENCE = Path(__file__).parent / "fixtures" / "smollm2_reference.json"


async def eventually(check: Callable[[], object], timeout: float = 10.0, what: str = "condition") -> object:
    """Poll `check` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if isinstance(result, Awaitable):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)


@pytest.fixture
async def launch():
    """Launch local pipelines for a test and stop them all afterwards."""
    started: list[Pipeline] = []

    async def _launch(model: str, stages: int, **kwargs) -> Pipeline:
        info = describe(model)
        launcher = Launcher(model, build_timeout=kwargs.pop("build_timeout", 60.0))
        pipeline = await launch_pipeline(launcher, info, split(info.n_layers, stages), **kwargs)
        started.append(pipeline)
        return pipeline

    yield _launch
    for pipeline in started:
        await pipeline.close()
    assert worker_pids(os.getpid()) == [], "a worker outlived its pipeline"


@pytest.fixture
async def cluster():
    """Open clusters (launched workers, a throw-away store) for a test and close them all afterwards."""
    async with AsyncExitStack() as stack:

        async def _open(model: str, stages: int, **config) -> Cluster:
            config.setdefault("build_timeout", 60.0)
            return await stack.enter_async_context(open_cluster(ClusterConfig(model, stages, **config)))

        yield _open
    assert worker_pids(os.getpid()) == [], "a worker outlived its cluster"


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The SmolLM2 GGUF file; the test is skipped, saying why, when its package is not installed."""
    try:
        return smollm2_path()
    except ModelSpecError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def smollm2_f32(smollm2: Path) -> Stage:
    """SmolLM2 whole as one f32 stage in this process, built once for the tests that only run it.

    A test gives it a session name of its own and never resets or rebuilds it.
    """
    return build("smollm2", LayerRange(0, 30), "f32")


@pytest.fixture
async def joiners():
    """Joining workers a test starts; each gone at its end, none outliving it."""
    started = Joiners()
    yield started
    await started.close()
    assert worker_pids(os.getpid()) == [], "a joiner outlived its test"
