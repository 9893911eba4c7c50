"""Fixtures for coordinator tests: a live API over a live pipeline."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from coordinator.api import create_app
from coordinator.runner import Runner
from tests.conftest import eventually
from workers.models import gguf_path
from workers.models.tokenizer import load_tokenizer


class Api:
    """A live app and a session pointed at it."""

    def __init__(self, server: TestServer, session: aiohttp.ClientSession, runner: Runner) -> None:
        self.server, self.session, self.runner = server, session, runner

    def url(self, path: str) -> str:
        return str(self.server.make_url(path))

    async def get(self, path: str, **kw):
        async with self.session.get(self.url(path), **kw) as r:
            return r.status, (await r.json() if r.content_type == "application/json" else await r.text()), r

    async def post(self, path: str, **kw):
        async with self.session.post(self.url(path), **kw) as r:
            return r.status, await r.json(), r

    async def finished(self, run_id: int, timeout: float = 20) -> dict:
        async def done():
            status, body, _ = await self.get(f"/runs/{run_id}")
            return body if status == 200 and body["status"] not in ("queued", "running") else None

        return await eventually(done, timeout, f"run {run_id} to finish")


@pytest.fixture
async def api_factory(launch, memory_store):
    made = []

    async def make(model: str = "fake:layers=4", stages: int = 2, token: str = "", **kw) -> Api:
        pipeline = await launch(model, stages, **kw)
        tokenizer = load_tokenizer(gguf_path(model)) if pipeline.info.input == "tokens" else None
        runner = Runner(pipeline, memory_store, tokenizer)
        await runner.start()
        server = TestServer(create_app(runner, memory_store, pipeline, token), host="127.0.0.1")
        await server.start_server()
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        made.append((runner, server, session))
        return Api(server, session, runner)

    yield make
    for runner, server, session in made:
        await session.close()
        await server.close()
        await runner.close()


@pytest.fixture
async def api(api_factory):
    return await api_factory()


