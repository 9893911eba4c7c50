"""Helpers for tests that need a cluster built by hand or a real `rlx-cluster serve` process."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import sys
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from coordinator.api import create_app
from coordinator.cluster import Cluster
from coordinator.pipeline import Pipeline
from coordinator.runner import Runner
from coordinator.store import RunStore
from tests.conftest import eventually, worker_pids
from tests.coordinator.conftest import Api

REPO = Path(__file__).resolve().parents[2]
EXIT_TIMEOUT_S = 30


@asynccontextmanager
async def served(pipeline: Pipeline, store: RunStore, **runner_options) -> AsyncIterator[Api]:
    """Serve `pipeline` and `store` over real HTTP through a runner made with `runner_options`."""
    runner = Runner(pipeline, store, **runner_options)
    await runner.start()
    cluster = Cluster(pipeline.info, store, pipeline, runner, None)
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
    """A real `rlx-cluster serve` process; its stderr collected as it comes."""

    def __init__(self, proc: asyncio.subprocess.Process, port: int) -> None:
        self.proc, self.port = proc, port
        self.err: list[str] = []
        self._reader = asyncio.create_task(self._collect())

    @classmethod
    async def start(cls, *args: str, prefix: tuple[str, ...] = ()) -> Serve:
        """Start `rlx-cluster serve ARGS` on a free loopback port, through the `prefix` command if any."""
        port = free_port()
        proc = await asyncio.create_subprocess_exec(
            *prefix, sys.executable, "-m", "coordinator", "serve", *args, "--http", f"127.0.0.1:{port}",
            cwd=REPO, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        return cls(proc, port)

    async def _collect(self) -> None:
        while line := await self.proc.stderr.readline():
            self.err.append(line.decode(errors="replace"))

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    async def said(self, text: str, timeout: float = 30) -> None:
        await eventually(lambda: text in self.stderr, timeout, f"{text!r} on stderr; got:\n{self.stderr}")

    def _request(self, method: str, path: str, body: dict | None) -> tuple[int, dict, dict]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data, method=method)
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, json.loads(r.read()), dict(r.headers)
        except urllib.error.HTTPError as exc:
            with exc:
                return exc.code, json.loads(exc.read()), dict(exc.headers)

    async def get(self, path: str) -> tuple[int, dict, dict]:
        return await asyncio.to_thread(self._request, "GET", path, None)

    async def post(self, path: str, body: dict) -> tuple[int, dict, dict]:
        return await asyncio.to_thread(self._request, "POST", path, body)

    async def exit_code(self, timeout: float = EXIT_TIMEOUT_S) -> int:
        try:
            code = await asyncio.wait_for(self.proc.wait(), timeout)
        except TimeoutError:
            stderr = self.stderr
            raise AssertionError(f"coordinator still running after {timeout}s; stderr:\n{stderr}") from None
        await asyncio.wait_for(self._reader, timeout)
        return code

    async def stop(self) -> None:
        """Kill the process if it still runs and wait until its workers are gone too."""
        if self.proc.returncode is None:
            self.proc.kill()
        await self.exit_code()
        await eventually(lambda: worker_pids(self.proc.pid) == [], 10, "the coordinator's workers to exit")


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
