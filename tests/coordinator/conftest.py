"""Fixtures for coordinator tests: a live API over the cluster it owns."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestServer

from coordinator.api import CLUSTER, create_app
from coordinator.cluster import Cluster, ClusterConfig
from tests.conftest import eventually, worker_pids
from tests.support.tiny_chat import write_tiny_chat


class Api:
    """A live app, the cluster it serves, and a session pointed at it."""

    def __init__(self, server: TestServer, session: aiohttp.ClientSession, cluster: Cluster) -> None:
        self.server, self.session, self.cluster = server, session, cluster

    def url(self, path: str) -> str:
        return str(self.server.make_url(path))

    async def get(self, path: str, **kw):
        async with self.session.get(self.url(path), **kw) as r:
            return r.status, (await r.json() if r.content_type == "application/json" else await r.text()), r

    async def post(self, path: str, **kw):
        async with self.session.post(self.url(path), **kw) as r:
            return r.status, await r.json(), r

    async def submit(self, body: dict) -> int:
        """POST a run; its id (the run must be accepted)."""
        status, posted, _ = await self.post("/runs", json=body)
        assert status == 202, posted
        return posted["id"]

    async def finished(self, run_id: int, timeout: float = 20) -> dict:
        async def done():
            status, body, _ = await self.get(f"/runs/{run_id}")
            return body if status == 200 and body["status"] not in ("queued", "running") else None

        return await eventually(done, timeout, f"run {run_id} to finish")


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny chat llama with a context of 1024 (files wanting another context override this)."""
    path = tmp_path_factory.mktemp("tiny") / "tiny-chat.gguf"
    write_tiny_chat(path, context_length=1024)
    return path


@pytest.fixture
async def api_factory():
    """Serve apps that open their own cluster at startup (launched workers, a throw-away store)."""
    servers: list[TestServer] = []
    sessions: list[aiohttp.ClientSession] = []

    async def make(model: str = "fake:layers=4", stages: int = 2, token: str = "", **config) -> Api:
        config.setdefault("build_timeout", 60.0)
        server = TestServer(create_app(ClusterConfig(model, stages, **config), token), host="127.0.0.1")
        servers.append(server)
        await server.start_server()
        sessions.append(aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)))
        return Api(server, sessions[-1], server.app[CLUSTER])

    yield make
    for session in sessions:
        await session.close()
    for server in servers:
        await server.close()
    assert worker_pids(os.getpid()) == [], "a worker outlived its app"


@pytest.fixture
async def api(api_factory):
    return await api_factory()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pristine() -> AsyncIterator[Api]:
    """A cluster like `api`'s (fake:layers=4 on 2 stages, no token) for a file's tests that change nothing.

    No run is ever accepted on it, so each test sees it as new. Its tests run in the module's loop
    (`pytest.mark.asyncio(loop_scope="module")`) and come last in their file: the function-scoped
    fixtures check that no worker of this process is alive, which holds only before it starts.
    """
    config = ClusterConfig("fake:layers=4", 2, build_timeout=60.0)
    server = TestServer(create_app(config, ""), host="127.0.0.1")
    await server.start_server()
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
    try:
        yield Api(server, session, server.app[CLUSTER])
    finally:
        await session.close()
        await server.close()
    assert worker_pids(os.getpid()) == [], "a worker outlived the shared cluster"
