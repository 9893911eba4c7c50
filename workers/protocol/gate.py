"""The pre-authentication gate both servers use: a bounded handshake, only a Hello-sized frame before it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar, get_args

from workers.protocol.wire import (
    PREFIX,
    Error,
    Hello,
    Mac,
    Nonce,
    ProtocolError,
    decode_header,
    encode_frame,
    send,
)

HANDSHAKE_TIMEOUT = 10.0


# Connections still in the handshake at once; past this a newcomer is told so
# and closed, so strangers cannot hold more than this many sockets and buffers.
MAX_UNAUTHENTICATED = 16


T = TypeVar("T")


def _largest_hello_header() -> int:
    """The encoded size of the largest Hello the wire types allow."""
    mac, nonce = (get_args(kind)[1].max_length for kind in (Mac, Nonce))
    return len(encode_frame(Hello(mac=bytes(mac), nonce=bytes(nonce)))[1])


# Before the handshake only a Hello may arrive: no payload and a header of its
# size. Twice the size leaves room for another msgpack encoder's choices.
PREAUTH_MAX_HEADER = 2 * _largest_hello_header()


class HandshakeGate:
    """Bounds what strangers get: MAX_UNAUTHENTICATED in the handshake at once, HANDSHAKE_TIMEOUT each."""

    def __init__(self) -> None:
        self.waiting = 0

    async def admit(self, writer: asyncio.StreamWriter, handshake: Callable[[], Awaitable[T]]) -> T:
        """Run `handshake()` within the bounds; a newcomer past the cap is told so and refused."""
        if self.waiting >= MAX_UNAUTHENTICATED:
            busy = f"busy: {MAX_UNAUTHENTICATED} connections are already in the handshake; try again"
            await send(writer, Error(id=0, message=busy))
            raise ProtocolError(busy)
        self.waiting += 1
        try:
            return await asyncio.wait_for(handshake(), HANDSHAKE_TIMEOUT)
        finally:
            self.waiting -= 1


async def read_hello(reader: asyncio.StreamReader) -> Hello:
    """Read the client's Hello, refusing a frame too big to be one before reading any of it."""
    try:
        header_len, payload_len = PREFIX.unpack(await reader.readexactly(PREFIX.size))
        if payload_len or not 0 < header_len <= PREAUTH_MAX_HEADER:
            raise ProtocolError(
                f"a frame of {header_len} header and {payload_len} payload bytes before the handshake; "
                f"only a hello is accepted (header up to {PREAUTH_MAX_HEADER} bytes, no payload)"
            )
        hello = decode_header(await reader.readexactly(header_len))
    except asyncio.IncompleteReadError as exc:
        raise ProtocolError("closed before the handshake") from exc
    if not isinstance(hello, Hello):
        raise ProtocolError(f"expected hello, got {type(hello).__name__} before the handshake")
    return hello
