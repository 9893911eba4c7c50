"""Time a joiner's link: round trip and bandwidth, from probe frames of a forward's sizes echoed back.

A decode step sends a stage one row of activations and gets one back; a
prompt sends many. The coordinator sends a joiner that echoes probes (its
Offer says so) a few frames of each size and keeps the quickest echo of
each: the small frame's is the round trip, and what the large frame adds
to it is its bytes there and back at the link's bandwidth. On a link faster
than the timing can tell (loopback), the bandwidth is the bytes over what
is left above the timer's resolution, a large figure rather than an
infinite one.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from workers.protocol.messages import Probe, Tensor
from workers.protocol.wire import ProtocolError, read_frame, send

# Each size is echoed this many times; the quickest counts (the others met a busy core or a queue).
TRIES = 3
# A large probe frame: a prompt's worth of rows, at least this many bytes so its transfer shows.
LARGE_BYTES = 1 << 20
PROBE_TIMEOUT_S = 10.0
# Below this the timer cannot tell a transfer apart from the round trip's noise.
RESOLUTION_S = 20e-6


@dataclass(frozen=True)
class Link:
    """A joiner's link to the coordinator as measured.

    rtt_ms: the quickest echo of a decode row's frame.
    bandwidth: bytes per second each way, from the large frame's echo beyond the round trip.
    """

    rtt_ms: float
    bandwidth: float

    def view(self) -> dict:
        """The link as /nodes shows it."""
        return {"rtt_ms": round(self.rtt_ms, 3), "bandwidth_mbps": round(self.bandwidth * 8 / 1e6, 1)}


async def probe_link(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, row_bytes: int) -> Link:
    """Time the link by echoes of a row's frame (`row_bytes`) and a prompt's; a ProtocolError if none."""
    small = max(4, row_bytes) // 4
    large = max(LARGE_BYTES, 256 * row_bytes) // 4
    quickest = {}
    for n in (small, large):
        quickest[n] = min([await _echo(reader, writer, i, n) for i in range(TRIES)])
    spent = max(quickest[large] - quickest[small], RESOLUTION_S)
    return Link(rtt_ms=quickest[small] * 1e3, bandwidth=2 * 4 * (large - small) / spent)


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, id_: int, floats: int) -> float:
    """Seconds for a probe of `floats` float32 values to come back."""
    payload = bytes(4 * floats)
    started = time.perf_counter()
    await send(writer, Probe(id=id_, tensor=Tensor(dtype="float32", shape=[floats])), payload)
    try:
        frame = await asyncio.wait_for(read_frame(reader, max_payload=len(payload)), PROBE_TIMEOUT_S)
    except TimeoutError:
        raise ProtocolError(f"no echo of a {len(payload)}-byte probe within {PROBE_TIMEOUT_S:g}s") from None
    spent = time.perf_counter() - started
    if (
        frame is None
        or not isinstance(frame[0], Probe)
        or frame[0].id != id_
        or len(frame[1]) != len(payload)
    ):
        raise ProtocolError("the joiner did not echo the probe it was sent")
    return spent
