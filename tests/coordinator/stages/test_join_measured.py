"""Joined workers placed by what they measured and what the coordinator measured of their link."""

from __future__ import annotations

import asyncio

from tests.conftest import eventually
from workers.models.footprint import fingerprint
from workers.protocol import auth
from workers.protocol.joining import COORDINATOR, JOINER
from workers.protocol.messages import Admit, Assign, Hello, Offer, Probe
from workers.protocol.wire import read_frame, send

TOKEN = "coordinator-join-token"
MODEL = "synthetic:layers=8,hidden=16"


class ByHand:
    """A worker joined over the wire by the test: it offers measured layer costs and echoes probes."""

    def __init__(self, addr: str, layer_ms: list[float], n: int, cpu_share: float = 0.0) -> None:
        self.addr, self.layer_ms, self.n, self.cpu_share = addr, layer_ms, n, cpu_share
        self.assigned: asyncio.Future = asyncio.get_running_loop().create_future()
        self.writer: asyncio.StreamWriter | None = None
        self.echoing: asyncio.Task | None = None

    async def join(self) -> None:
        host, port = self.addr.rsplit(":", 1)
        reader, self.writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 5)
        challenge, _ = await asyncio.wait_for(read_frame(reader), 5)
        nonce = auth.new_nonce()
        await send(self.writer, Hello(mac=auth.mac(TOKEN, JOINER, challenge.nonce), nonce=nonce))
        admit, _ = await asyncio.wait_for(read_frame(reader), 5)
        assert isinstance(admit, Admit) and auth.verify(TOKEN, COORDINATOR, nonce, admit.mac)
        print_ = fingerprint(MODEL)
        await send(self.writer, Offer(addr=f"127.0.0.1:{9 + self.n}", model=MODEL, fingerprint=print_,
                                      precision="f32", memory_bytes=10**9, cores=1, layer_ms=self.layer_ms,
                                      stage_ms=0.05 if self.layer_ms else 0.0, probes=bool(self.layer_ms),
                                      calibration="sampled" if self.layer_ms else "",
                                      cpu_share=self.cpu_share))  # fmt: skip
        self.echoing = asyncio.get_running_loop().create_task(self._echo(reader))

    async def _echo(self, reader: asyncio.StreamReader) -> None:
        while (frame := await read_frame(reader, max_payload=16 << 20)) is not None:
            msg, payload = frame
            if isinstance(msg, Probe):
                await send(self.writer, msg, payload)
            elif not self.assigned.done():
                self.assigned.set_result(msg)

    def close(self) -> None:
        if self.echoing is not None:
            self.echoing.cancel()
        if self.writer is not None:
            self.writer.close()


async def test_two_joiners_of_different_measured_speeds_get_layers_in_proportion_and_nodes_shows_why(
    api_factory,
):
    api = await api_factory(MODEL, 2, join="127.0.0.1:0", worker_token=TOKEN, join_objective="throughput")
    slow, fast = ByHand(api.cluster.joins.addr, [3.0] * 8, 0), ByHand(api.cluster.joins.addr, [1.0] * 8, 1)
    try:
        for joiner in (slow, fast):
            await joiner.join()
        assigned = [await asyncio.wait_for(j.assigned, 10) for j in (slow, fast)]
        assert all(isinstance(a, Assign) for a in assigned)
        # 3 ms a layer against 1 ms: the busiest stage is least at 2 | 6 (6 ms each), a 1:3 share.
        assert [len(a.layers) for a in assigned] == [2, 6]

        async def shown() -> dict | None:
            _, body, _ = await api.get("/nodes")
            return body["joined"] if len(body["joined"]["members"]) == 2 else None

        joined = await eventually(shown, 10, "both joiners in /nodes")
        assert joined["placement"].startswith("placed by measured speed, memory and link (throughput)")
        by_speed = sorted(joined["members"], key=lambda m: m["speed"]["decode_ms"])
        assert [m["speed"]["decode_ms"] for m in by_speed] == [8.05, 24.05]
        assert all(m["speed"]["calibration"] == "sampled" for m in by_speed)
        assert all(0 < m["link"]["rtt_ms"] < 200 and m["link"]["bandwidth_mbps"] > 100 for m in by_speed)
    finally:
        slow.close()
        fast.close()


async def test_a_joiner_that_measured_nothing_makes_the_first_plan_the_even_split_saying_who(api_factory):
    api = await api_factory(MODEL, 2, join="127.0.0.1:0", worker_token=TOKEN)
    measured, older = ByHand(api.cluster.joins.addr, [1.0] * 8, 0), ByHand(api.cluster.joins.addr, [], 1)
    try:
        for joiner in (measured, older):
            await joiner.join()
        assigned = [await asyncio.wait_for(j.assigned, 10) for j in (measured, older)]
        # The even split, in join order (the measured one joins after its probes: either may be first).
        assert sorted(a.layers.start for a in assigned) == [0, 4]
        assert all(len(a.layers) == 4 for a in assigned)
        _, body, _ = await api.get("/nodes")
        assert "worker 127.0.0.1:10 did not measure its layers or link" in body["joined"]["placement"]
        older_view = next(m for m in body["joined"]["members"] if m["addr"] == "127.0.0.1:10")
        assert older_view["speed"] is None and older_view["link"] is None
    finally:
        measured.close()
        older.close()


async def test_the_even_join_plan_splits_joiners_of_different_speeds_evenly_and_predicts_its_step(
    api_factory,
):
    api = await api_factory(MODEL, 2, join="127.0.0.1:0", worker_token=TOKEN, join_objective="even")
    slow, fast = ByHand(api.cluster.joins.addr, [3.0] * 8, 0), ByHand(api.cluster.joins.addr, [1.0] * 8, 1)
    try:
        for joiner in (slow, fast):
            await joiner.join()
        assigned = [await asyncio.wait_for(j.assigned, 10) for j in (slow, fast)]
        assert sorted(a.layers.start for a in assigned) == [0, 4]  # by measure it would be 2 | 6
        assert all(len(a.layers) == 4 for a in assigned)
        _, body, _ = await api.get("/nodes")
        how = body["joined"]["placement"]
        assert how.startswith("split evenly or by memory (asked for), in join order: predicted "), how
        # 4 layers at 3 ms and 4 at 1 ms, 0.05 ms a stage, and two loopback hops of well under 5 ms.
        assert 16.1 <= float(how.split("predicted ")[1].split(" ms")[0]) < 26.1, how
    finally:
        slow.close()
        fast.close()


async def test_a_joiner_held_to_a_quarter_of_a_core_is_given_fewer_layers_and_nodes_shows_its_share(
    api_factory,
):
    api = await api_factory(MODEL, 2, join="127.0.0.1:0", worker_token=TOKEN)
    held = ByHand(api.cluster.joins.addr, [1.0] * 8, 0, cpu_share=0.25)
    free = ByHand(api.cluster.joins.addr, [1.0] * 8, 1)
    try:
        for joiner in (held, free):
            await joiner.join()
        [mine, theirs] = [await asyncio.wait_for(j.assigned, 10) for j in (held, free)]
        # Half the layers (4 ms a step) at a quarter of a core would hold every step to 16 ms, twice what
        # it costs: the quota's host gets no more than its share of the step's compute (2 of 8 layers).
        assert len(mine.layers) <= 2 and len(mine.layers) + len(theirs.layers) == 8
        _, body, _ = await api.get("/nodes")
        shares = sorted(m["speed"]["cpu_share"] or 0 for m in body["joined"]["members"])
        assert shares == [0, 0.25]
    finally:
        held.close()
        free.close()
