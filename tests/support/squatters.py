"""Squatters for tests: silent connections held on a port, each opened again once the server closes it."""

from __future__ import annotations

import asyncio
from contextlib import suppress

CONNECT_TIMEOUT_S = 5.0
REFUSED_PAUSE_S = 0.05  # when nothing listens, so that trying again is not a busy loop


class Squatters:
    """`per_source` raw connections from each source address to `addr`, never sending a byte.

    Linux routes all of 127.0.0.0/8 to loopback, so 127.0.0.2, 127.0.0.3, ...
    are distinct peers on one machine. `closed` counts the connections the
    server closed (each is opened again at once).
    """

    def __init__(self, addr: str, sources: list[str], per_source: int) -> None:
        host, port = addr.rsplit(":", 1)
        self.host, self.port = host, int(port)
        self.sources, self.per_source = sources, per_source
        self.closed = 0
        self.open = 0
        self._tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> Squatters:
        self._tasks = [asyncio.create_task(self._squat(source)) for source in self.sources
                       for _ in range(self.per_source)]  # fmt: skip
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.wait_for(asyncio.gather(*self._tasks, return_exceptions=True), CONNECT_TIMEOUT_S)

    async def _squat(self, source: str) -> None:
        while True:
            try:
                # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow the cancellation that ends us.
                async with asyncio.timeout(CONNECT_TIMEOUT_S):
                    reader, writer = await asyncio.open_connection(
                        self.host, self.port, local_addr=(source, 0)
                    )
            except (OSError, TimeoutError):
                await asyncio.sleep(REFUSED_PAUSE_S)
                continue
            self.open += 1
            try:
                await reader.read()  # whatever the server says, until it hangs up
            except OSError:
                pass
            finally:
                self.open -= 1
                writer.close()
                with suppress(OSError):
                    await writer.wait_closed()
            self.closed += 1
