"""A run in flight on joined workers outlives one: a spare, or a worker joining later, takes its place."""

from __future__ import annotations

import numpy as np

from tests.conftest import eventually
from workers.fake import reference
from workers.models.synthetic import make_input

TOKEN = "coordinator-join-token"
JOIN_S = 30  # starting a few Python processes on a busy machine


async def test_a_run_whose_joined_worker_dies_mid_forward_goes_on_through_the_spare(api_factory, joiners):
    api = await api_factory("fake:layers=4,delay_ms=600", 2, join="127.0.0.1:0", worker_token=TOKEN)
    for _ in range(3):
        await joiners.start(api.cluster.joins.addr, "fake:layers=4,delay_ms=600", TOKEN)

    async def one_spare() -> dict | None:
        _, body, _ = await api.get("/nodes")
        spares = [m for m in body["joined"]["members"] if m["state"] == "spare"]
        return len(spares) == 1 and (await api.get("/healthz"))[0] == 200 and spares[0]

    spare = await eventually(one_spare, JOIN_S, "two stages up and one spare")
    victim = api.cluster.pipeline.nodes[1]
    old = victim.report.addr
    run_id = await api.submit({"seq": 2, "seed": 5})
    runner = api.cluster.runner
    await eventually(lambda: runner.latest.id == run_id and len(runner.latest.timings) == 1, 10, "stage 1")
    [holder] = [j for j in joiners.started if j.pid == victim.report.pid]
    holder.kill()  # mid-way through stage 1's 0.6 s forward
    run = await api.finished(run_id, JOIN_S)
    assert run["status"] == "ok", run["error"]
    [recovery] = run["recoveries"]
    assert (recovery["stage"], recovery["addr"], recovery["new_addr"]) == (1, old, spare["addr"])
    _, done, _ = await api.get(f"/runs/{run_id}?output=1")
    np.testing.assert_array_equal(
        np.array(done["output"], np.float32), reference(make_input(2, 4, 5), range(4)).ravel()
    )


async def test_a_run_whose_joined_worker_dies_with_no_spare_goes_on_through_a_worker_joining_later(
    api_factory, joiners
):
    api = await api_factory("fake:layers=4,delay_ms=600", 2, join="127.0.0.1:0", worker_token=TOKEN)
    for _ in range(2):
        await joiners.start(api.cluster.joins.addr, "fake:layers=4,delay_ms=600", TOKEN)
    await eventually(lambda: api.cluster.pipeline.unready() is None, JOIN_S, "both stages up, no spare")
    victim = api.cluster.pipeline.nodes[1]
    old = victim.report.addr
    run_id = await api.submit({"seq": 2, "seed": 5})
    runner = api.cluster.runner
    await eventually(lambda: runner.latest.id == run_id and len(runner.latest.timings) == 1, 10, "stage 1")
    [holder] = [j for j in joiners.started if j.pid == victim.report.pid]
    holder.kill()  # mid-way through stage 1's 0.6 s forward, with nobody waiting to take its place
    await eventually(lambda: victim.state != "up", 10, "stage 1 to be down")
    # The newcomer is started only once the stage is down: it arrives a second or so later (its start).
    newcomer = await joiners.start(api.cluster.joins.addr, "fake:layers=4,delay_ms=600", TOKEN)
    run = await api.finished(run_id, JOIN_S)
    assert run["status"] == "ok", run["error"]
    [recovery] = run["recoveries"]
    assert recovery["stage"] == 1 and recovery["addr"] == old
    assert victim.report.pid == newcomer.pid and recovery["new_addr"] == victim.report.addr != old
    assert recovery["waited_ms"] > 0
    _, done, _ = await api.get(f"/runs/{run_id}?output=1")
    np.testing.assert_array_equal(
        np.array(done["output"], np.float32), reference(make_input(2, 4, 5), range(4)).ravel()
    )
