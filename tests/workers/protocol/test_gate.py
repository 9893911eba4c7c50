"""The handshake gate's bookkeeping, on connections it is handed directly (no sockets: only its counts)."""

from __future__ import annotations

import asyncio
import re

import pytest

from workers.protocol.gate import MAX_PER_PEER, HandshakeGate
from workers.protocol.wire import ProtocolError


class Conn:
    """As much of a StreamWriter as the gate uses: whom it is from, and close()."""

    def __init__(self, host: str, release: asyncio.Event) -> None:
        self.host, self.release = host, release
        self.closed, self.go = asyncio.Event(), asyncio.Event()

    def get_extra_info(self, name: str) -> tuple[str, int]:
        assert name == "peername"
        return (self.host, 40000)

    def close(self) -> None:
        self.closed.set()

    async def prove(self) -> str:
        """Proves the token when `release` is set; once closed by the gate, fails when told to go."""
        closed, released = asyncio.create_task(self.closed.wait()), asyncio.create_task(self.release.wait())
        await asyncio.wait({closed, released}, return_when=asyncio.FIRST_COMPLETED)
        closed.cancel()
        released.cancel()
        if self.closed.is_set():
            await self.go.wait()
            raise ConnectionResetError("closed by the gate")
        return "hello"


async def test_a_stranger_pushed_out_after_its_peers_others_have_left_is_told_why_and_nothing_is_counted():
    gate, release = HandshakeGate(), asyncio.Event()
    conns = [Conn("10.0.0.7", release) for _ in range(MAX_PER_PEER + 1)]
    tasks = []
    for conn in conns:  # the last one, past the peer's bound, pushes out the first
        tasks.append(asyncio.create_task(gate.admit(conn, conn.prove)))
        await asyncio.sleep(0)
    assert conns[0].closed.is_set() and gate.waiting == MAX_PER_PEER
    release.set()  # the others prove the token and leave: the peer has no one left in the handshake
    assert await asyncio.gather(*tasks[1:]) == ["hello"] * MAX_PER_PEER
    assert gate.waiting == 0
    conns[0].go.set()  # only now does the pushed-out one see its connection closed
    why = re.escape("pushed out of the handshake by newer connections from 10.0.0.7")
    with pytest.raises(ProtocolError, match=why):
        await tasks[0]
    assert gate.waiting == 0
