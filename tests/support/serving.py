"""Helpers for tests that need a cluster built by hand, or a real `rlx-cluster serve` process."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from coordinator.api import create_app
from coordinator.cluster import Cluster
from coordinator.runs.runner import Runner
from coordinator.stages.pipeline import Pipeline
from coordinator.store.history import RunStore
from coordinator.testing import RlxCluster
from tests.coordinator.conftest import Api

REPO = Path(__file__).resolve().parents[2]
EXIT_TIMEOUT_S = 30


@asynccontextmanager
async def served(pipeline: Pipeline, store: RunStore, **runner_options) -> AsyncIterator[Api]:
    """Serve `pipeline` and `store` over real HTTP through a runner made with `runner_options`."""
    runner = Runner(pipeline, store, **runner_options)
    await runner.start()
    cluster = Cluster(pipeline.info, store, pipeline, runner, runner.tokenizer)
    server = TestServer(create_app(cluster), host="127.0.0.1")
    await server.start_server()
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
    try:
        yield Api(server, session, cluster)
    finally:
        await session.close()
        await server.close()
        await runner.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Serve:
    """A real `rlx-cluster serve` process: the pytest plugin's handle, awaited from asyncio tests."""

    def __init__(self, cluster: RlxCluster) -> None:
        self.cluster = cluster
        self.proc = cluster.process.proc

    @classmethod
    async def start(cls, *args: str, prefix: tuple[str, ...] = ()) -> Serve:
        """Start `rlx-cluster serve ARGS` on a free loopback port, through the `prefix` command if any."""
        argv = ["serve", *args, "--http", "127.0.0.1:0"]
        return cls(await asyncio.to_thread(RlxCluster.launch, argv, cwd=REPO, prefix=prefix))

    @property
    def port(self) -> int:
        return int(self.cluster.base_url.rpartition(":")[2])

    @property
    def stderr(self) -> str:
        return self.cluster.stderr

    async def said(self, text: str, timeout: float = 30) -> None:
        await self.cluster.aio.said(text, timeout)

    async def get(self, path: str) -> tuple[int, dict, dict]:
        return await self.cluster.aio.get(path)

    async def post(self, path: str, body: dict) -> tuple[int, dict, dict]:
        return await self.cluster.aio.post(path, body)

    async def exit_code(self, timeout: float = EXIT_TIMEOUT_S) -> int:
        return await self.cluster.aio.exit_code(timeout)

    async def stop(self) -> None:
        """Stop the process if it still runs; fail if a worker outlives it."""
        leaked = await self.cluster.aio.stop()
        assert leaked == [], f"worker(s) {leaked} outlived the coordinator"


@asynccontextmanager
async def serving(*args: str) -> AsyncIterator[Serve]:
    """A `rlx-cluster serve ARGS` process for the block, stopped after it."""
    serve = await Serve.start(*args)
    try:
        yield serve
    finally:
        await serve.stop()


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """A process's resident set (or its peak, VmHWM) from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def unprivileged() -> tuple[str, ...]:
    """A command prefix that makes root obey file modes (drops its override capabilities); none otherwise."""
    if os.geteuid() != 0:
        return ()
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.fail("running as root, the read-only tests need setpriv (util-linux) to obey file modes")
    return (setpriv, "--bounding-set=-dac_override,-dac_read_search", "--")
