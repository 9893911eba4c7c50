"""The pre-authentication gate both servers use: a short handshake, a few per peer, only a Hello before it."""

from __future__ import annotations

import asyncio
import ipaddress
import time
from collections import deque
from collections.abc import Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import TypeVar, get_args

from workers.protocol.messages import Hello, Mac, Nonce
from workers.protocol.wire import PREFIX, ProtocolError, decode_header, encode_frame

# Seconds a stranger has to prove the token: one round trip and an HMAC take milliseconds,
# and the window is all a squatter holds a place for.
HANDSHAKE_TIMEOUT = 3.0


# Connections in the handshake at once from one peer, and from everyone; past either bound
# a newcomer pushes out the longest-waiting stranger rather than being turned away, so
# strangers hold at most this many sockets and buffers and never keep out a client that
# knows the token.
MAX_PER_PEER = 8
MAX_UNAUTHENTICATED = 64


T = TypeVar("T")


def _largest_hello_header() -> int:
    """The encoded size of the largest Hello the wire types allow."""
    mac, nonce = (get_args(kind)[1].max_length for kind in (Mac, Nonce))
    return len(encode_frame(Hello(mac=bytes(mac), nonce=bytes(nonce)))[1])


# Before the handshake only a Hello may arrive: no payload and a header of its
# size. Twice the size leaves room for another msgpack encoder's choices.
PREAUTH_MAX_HEADER = 2 * _largest_hello_header()


@dataclass(eq=False)
class _Stranger:
    """A connection in the handshake: who it is from, and whether it was pushed out."""

    peer: str
    writer: asyncio.StreamWriter
    since: float = field(default_factory=time.monotonic)
    pushed_out: str | None = None


class HandshakeGate:
    """Bounds what strangers get: MAX_PER_PEER, MAX_UNAUTHENTICATED in all, HANDSHAKE_TIMEOUT each.

    A newcomer is never refused. Past its peer's bound it pushes out that
    peer's longest-waiting connection; past the bound on everyone, the
    longest-waiting connection of the peer holding the most. So a flood costs
    the address it comes from, and a client that knows the token, whose
    handshake takes milliseconds, gets through whoever squats.
    """

    def __init__(self) -> None:
        self._waiting: dict[str, deque[_Stranger]] = {}  # by peer, longest-waiting first

    @property
    def waiting(self) -> int:
        """Connections in the handshake now."""
        return sum(len(q) for q in self._waiting.values())

    async def admit(self, writer: asyncio.StreamWriter, prove: Callable[[], Awaitable[T]]) -> T:
        """Run `prove()` (up to the peer's proof of the token) within the bounds; its result."""
        stranger = _Stranger(peer_of(writer), writer)
        self._make_room(stranger.peer)
        self._waiting.setdefault(stranger.peer, deque()).append(stranger)
        try:
            return await asyncio.wait_for(prove(), HANDSHAKE_TIMEOUT)
        except (ProtocolError, OSError) as exc:
            if stranger.pushed_out is not None:
                raise ProtocolError(stranger.pushed_out) from exc
            raise
        finally:
            # A stranger pushed out is no longer in its peer's queue, and the queue itself is gone once
            # the peer's others have left too.
            queue = self._waiting.get(stranger.peer)
            if queue is not None:
                with suppress(ValueError):
                    queue.remove(stranger)
                if not queue:
                    del self._waiting[stranger.peer]

    def _make_room(self, peer: str) -> None:
        """Push out whom a newcomer from `peer` would take the place of."""
        if len(self._waiting.get(peer, ())) >= MAX_PER_PEER:
            why = f"pushed out of the handshake by newer connections from {peer} (at most {MAX_PER_PEER})"
            self._push_out(peer, why)
        elif self.waiting >= MAX_UNAUTHENTICATED:
            # The peer holding the most; of equals, the one that has waited longest.
            most = max(self._waiting, key=lambda p: (len(self._waiting[p]), -self._waiting[p][0].since))
            self._push_out(most, f"pushed out of the handshake: {MAX_UNAUTHENTICATED} connections were in it")

    def _push_out(self, peer: str, why: str) -> None:
        queue = self._waiting[peer]
        oldest = queue.popleft()
        if not queue:
            del self._waiting[peer]
        oldest.pushed_out = why
        oldest.writer.close()  # its pending read ends at once; admit() says why


def peer_of(writer: asyncio.StreamWriter) -> str:
    """Whom a connection is from, as the gate counts peers: its address (for IPv6, its /64)."""
    name = writer.get_extra_info("peername")
    host = str(name[0] if isinstance(name, tuple) else name)
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        # One host commonly holds a whole /64: counting its addresses apart would not bound it.
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


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
