"""A slow link to a worker: a TCP relay that passes on what is sent through it at a set rate."""

from __future__ import annotations

import asyncio
from contextlib import suppress

from workers.protocol.address import parse_host_port

CONNECT_S = 5.0  # to reach the worker behind the link
CLOSE_S = 5.0  # for the relay's connections to end once it is closed
READ_BYTES = 1 << 16


class SlowLink:
    """Relays each connection made to `addr` to `target`, what it is sent at `rate` bytes a second.

    Replies come back at once. A request waits in the relay in proportion to its bytes, so the stage
    behind the link answers a forward in time proportional to its positions (4 bytes per token id),
    as a stage across a slow network does: slow, while its worker itself is quick.
    """

    def __init__(self, target: str, rate: float) -> None:
        self.target, self.rate = target, rate
        self._server: asyncio.Server | None = None
        self._relays: set[asyncio.Task] = set()

    @classmethod
    async def open(cls, target: str, rate: float) -> SlowLink:
        """Listen on a free loopback port for connections to relay to `target`."""
        link = cls(target, rate)
        link._server = await asyncio.start_server(link._relay, "127.0.0.1", 0)
        return link

    @property
    def addr(self) -> str:
        """HOST:PORT to connect to instead of the worker's own address."""
        assert self._server is not None
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"{host}:{port}"

    async def close(self) -> None:
        """Stop listening and cut every connection relayed."""
        if self._server is not None:
            self._server.close()
        for task in self._relays:
            task.cancel()
        if self._relays:
            await asyncio.wait(self._relays, timeout=CLOSE_S)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._relays.add(task)
        host, port = parse_host_port(self.target)
        pumps: list[asyncio.Task] = []
        try:
            up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_S)
            pumps = [
                asyncio.create_task(_pump(reader, up_writer, self.rate)),
                asyncio.create_task(_pump(up_reader, writer, None)),
            ]
            # Either side closing ends the relay: the other is cut too.
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        except (OSError, TimeoutError):
            pass  # the worker is gone: the connection made to the link is closed below
        finally:
            for pump in pumps:
                pump.cancel()
            for pump in pumps:
                with suppress(asyncio.CancelledError, OSError):
                    await pump
            writer.close()
            if pumps:
                up_writer.close()
            self._relays.discard(task)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rate: float | None) -> None:
    """Copy what `reader` gets to `writer`, each piece held back len/rate seconds when `rate` is set."""
    while data := await reader.read(READ_BYTES):
        if rate is not None:
            await asyncio.sleep(len(data) / rate)
        writer.write(data)
        await writer.drain()
