"""What a joining worker and the coordinator share: the join handshake's roles, keep-alive, its messages."""

from __future__ import annotations

import asyncio
import socket

from workers.protocol.messages import Error, Message
from workers.protocol.wire import read_frame

JOINER, COORDINATOR = "joiner", "coordinator"  # handshake roles, unlike the client/worker ones


# A coordinator that vanishes without closing (a cut link, a frozen host) is noticed by TCP
# keepalive: after this many seconds of silence, a probe this often, gone after this many unanswered.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 5, 2, 3


def keep_alive(writer: asyncio.StreamWriter) -> None:
    """Have TCP notice a peer that vanished without closing, within about ten seconds of silence."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):  # Linux; elsewhere the system's defaults apply
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)


async def next_message(reader: asyncio.StreamReader) -> Message:
    """The next message the coordinator sent on a join connection (none carries a payload), for a joiner."""
    frame = await read_frame(reader, max_payload=0)
    if frame is None:
        raise ConnectionError("the coordinator closed the connection")
    return frame[0]


def described(msg: Message) -> str:
    """A message as a log line or an error names it."""
    return f"an error ({msg.message})" if isinstance(msg, Error) else type(msg).__name__.lower()
