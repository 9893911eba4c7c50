"""The cluster handle's methods as coroutines, for asyncio tests (pytest-asyncio or any loop)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import aiohttp

from coordinator.testing.sse import EVENTS_S, Frames, SseEvent, events_path


def _in_thread(name: str) -> Callable[..., Any]:
    """The blocking method `name` of the sync handle, awaited in a thread so the loop keeps running."""

    async def call(self: AsyncRlxCluster, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(getattr(self.sync, name), *args, **kwargs)

    call.__name__ = name
    call.__doc__ = f"Await RlxCluster.{name} (every call is bounded by its own timeout)."
    return call


class AsyncRlxCluster:
    """The same cluster as `sync`, with coroutine methods of the same names."""

    def __init__(self, sync: Any) -> None:  # an RlxCluster, which imports this module
        self.sync = sync

    ready = _in_thread("ready")
    said = _in_thread("said")
    request = _in_thread("request")
    get = _in_thread("get")
    post = _in_thread("post")
    delete = _in_thread("delete")
    nodes = _in_thread("nodes")
    stages = _in_thread("stages")
    post_run = _in_thread("post_run")
    run = _in_thread("run")
    wait = _in_thread("wait")
    stage_pid = _in_thread("stage_pid")
    kill_stage = _in_thread("kill_stage")
    pause_stage = _in_thread("pause_stage")
    resume_stage = _in_thread("resume_stage")
    exit_code = _in_thread("exit_code")
    stop = _in_thread("stop")

    async def events(
        self, *, run: int | None = None, kinds: Iterable[str] = (), since: str | int | None = None,
        timeout: float = EVENTS_S,
    ) -> AsyncIterator[SseEvent]:  # fmt: skip
        """Read /events as they come (after event id `since`, or 0: all); AssertionError past `timeout` s."""
        url = self.sync.base_url + events_path(run, kinds, since)
        deadline = time.monotonic() + timeout
        async with (
            aiohttp.ClientSession(headers=self.sync._headers()) as session,
            session.get(url, timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeout)) as stream,
        ):
            if stream.status != 200:
                raise AssertionError(f"GET /events answered {stream.status}: {await stream.text()}")
            frames = Frames()
            while True:
                try:
                    async with asyncio.timeout(deadline - time.monotonic()):
                        line = await stream.content.readline()
                except TimeoutError:
                    raise AssertionError(f"no more events within {timeout:g}s") from None
                if not line:
                    return
                if (event := frames.feed(line)) is not None:
                    yield event
