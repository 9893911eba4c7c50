"""A joiner's link timed by probe frames it echoes: figures that make sense on loopback."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.stages import link as link_module
from coordinator.stages.link import probe_link
from workers.join import Joiner, JoinOptions
from workers.protocol.messages import Assign
from workers.protocol.report import LayerRange
from workers.protocol.wire import ProtocolError, send


async def probed(joiner_side) -> tuple:
    """Probe the link to a peer running `joiner_side(reader, writer)` over loopback, then assign it."""
    got: asyncio.Future = asyncio.get_running_loop().create_future()

    async def coordinator(reader, writer):
        try:
            link = await probe_link(reader, writer, row_bytes=4 * 576)
            await send(writer, Assign(layers=LayerRange(0, 1)))
            got.set_result(link)
        except Exception as exc:  # the test's to see
            got.set_exception(exc)
        finally:
            writer.close()

    server = await asyncio.start_server(coordinator, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        answered = await asyncio.wait_for(joiner_side(reader, writer), 20)
        return await asyncio.wait_for(got, 20), answered
    finally:
        writer.close()
        server.close()


async def test_a_waiting_joiner_echoes_probes_and_the_links_figures_are_sane_on_loopback():
    joiner = Joiner(JoinOptions(("127.0.0.1", 1), "fake:layers=1", "f32", "t"))
    link, assign = await probed(joiner._assignment)
    assert assign == Assign(layers=LayerRange(0, 1))
    # Loopback's round trip is tens of microseconds; a loaded 2-core host may make it milliseconds.
    assert 0 < link.rtt_ms < 200
    # Loopback moves GB/s; anything above 20 MB/s is the probe telling a fast link from a slow one.
    assert link.bandwidth > 20e6
    assert set(link.view()) == {"rtt_ms", "bandwidth_mbps"}


async def test_a_peer_that_does_not_echo_is_a_protocol_error_naming_the_probe(monkeypatch):
    monkeypatch.setattr(link_module, "PROBE_TIMEOUT_S", 0.2)

    async def silent(reader, writer):
        await reader.read()  # takes what comes, answers nothing, until the coordinator closes

    with pytest.raises(ProtocolError, match=r"no echo of a 2304-byte probe within 0\.2s"):
        await probed(silent)
