"""A cluster of workers that join: ready once every stage is held, refused strangers, vacancies refilled."""

from __future__ import annotations

import asyncio
import logging
import re
import time

import numpy as np
import pytest

from coordinator.cli.main import main
from coordinator.cluster import ClusterConfig, open_cluster
from coordinator.runs.requests import RunRequest
from tests.conftest import eventually
from tests.support.serving import serving
from tests.support.squatters import Squatters
from workers.fake import reference
from workers.models import build
from workers.models.footprint import fingerprint
from workers.models.synthetic import make_input
from workers.protocol import auth
from workers.protocol.gate import MAX_PER_PEER, MAX_UNAUTHENTICATED
from workers.protocol.joining import COORDINATOR, JOINER
from workers.protocol.messages import Admit, Assign, Hello, Offer
from workers.protocol.report import LayerRange
from workers.protocol.wire import read_frame, send

TOKEN = "coordinator-join-token"
MODEL = "synthetic:layers=6,hidden=16"
JOIN_S = 30  # starting a few Python processes on a busy machine


async def serve_joins(api_factory, model: str = MODEL, stages: int = 3, **options):
    """An API over a cluster whose workers join at an address of its own."""
    return await api_factory(model, stages, join="127.0.0.1:0", worker_token=TOKEN, **options)


async def healthy(api) -> bool:
    status, _, _ = await api.get("/healthz")
    return status == 200


async def node(api, index: int) -> dict:
    _, body, _ = await api.get("/nodes")
    return body["nodes"][index]


async def test_workers_that_join_make_the_cluster_ready_and_a_run_gives_the_output_of_one_process(
    api_factory, joiners
):
    # The even split: identical joiners' measured costs differ by their timing noise (5-40% under
    # load), which may move a layer; what the measured plan does is tested in test_join_measured.
    api = await serve_joins(api_factory, join_objective="even")
    for _ in range(3):
        await joiners.start(api.cluster.joins.addr, MODEL, TOKEN)
    await eventually(lambda: healthy(api), JOIN_S, "the cluster to be ready")
    _, health, _ = await api.get("/healthz")
    assert health["ok"] is True

    _, body, _ = await api.get("/nodes")
    assert [n["layers"] for n in body["nodes"]] == [{"start": 0, "end": 2}, {"start": 2, "end": 4},
                                                     {"start": 4, "end": 6}]  # fmt: skip
    assert {n["addr"] for n in body["nodes"]} == {m["addr"] for m in body["joined"]["members"]}
    assert all(n["state"] == "up" and n["addr"].startswith("127.0.0.1:") for n in body["nodes"])

    _, created, _ = await api.post("/runs", json={"seq": 5, "seed": 3})
    run = await api.finished(created["id"])
    assert run["status"] == "ok", run
    _, done, _ = await api.get(f"/runs/{created['id']}?output=1")
    alone = build(MODEL, LayerRange(0, 6), "f32").forward(
        make_input(5, 16, 3), session="s", start_pos=0, last_only=False
    )
    np.testing.assert_array_equal(np.array(done["output"], np.float32), alone.ravel())
    assert [t["stage"] for t in done["timings"]] == [0, 1, 2]


async def test_while_workers_are_missing_nodes_health_and_runs_say_how_many(api_factory, joiners):
    api = await serve_joins(api_factory)
    for _ in range(2):
        await joiners.start(api.cluster.joins.addr, MODEL, TOKEN)

    async def joined() -> list[dict]:
        _, body, _ = await api.get("/nodes")
        return len(body["joined"]["members"]) == 2 and body

    body = await eventually(joined, JOIN_S, "two workers to join")
    assert [n["state"] for n in body["nodes"]] == ["vacant"] * 3
    assert all(
        m["state"] == "waiting" and m["addr"].startswith("127.0.0.1:") for m in body["joined"]["members"]
    )
    assert all("2 of 3 have joined" in n["error"] for n in body["nodes"])

    status, health, _ = await api.get("/healthz")
    assert status == 503 and health["ok"] is False
    for i, layers in enumerate(["0..2", "2..4", "4..6"]):
        assert (
            f"stage {i} (layers {layers}) is vacant: waiting for workers to join: 2 of 3" in health["error"]
        )

    status, refused, response = await api.post("/runs", json={"seq": 2})
    assert status == 503 and "Retry-After" in response.headers
    assert refused["error"].count("is vacant: waiting for workers to join: 2 of 3 have joined") == 3

    await joiners.start(api.cluster.joins.addr, MODEL, TOKEN)
    await eventually(lambda: healthy(api), JOIN_S, "the cluster to be ready with the third worker")


async def test_a_wrong_or_missing_token_is_refused_on_both_sides_and_never_gets_layers(
    api_factory, joiners, caplog
):
    api = await serve_joins(api_factory, stages=1)
    wrong = await joiners.start(api.cluster.joins.addr, MODEL, "not-the-token")
    unset = await joiners.start(api.cluster.joins.addr, MODEL, None)
    assert await wrong.exited(JOIN_S) == 2, wrong.log()
    assert "rlx-worker: refused: wrong token" in wrong.log()
    assert await unset.exited(JOIN_S) == 2, unset.log()
    assert "refused: wrong token (RLX_WORKER_TOKEN is not set)" in unset.log()
    assert not any("building" in line for line in wrong.stderr + unset.stderr)
    assert api.cluster.joins.members == [] and (await node(api, 0))["state"] == "vacant"
    refusals = [
        r for r in caplog.records if r.name == "coordinator.stages.join" and "wrong token" in r.getMessage()
    ]
    assert len(refusals) == 2 and all(r.levelno == logging.WARNING for r in refusals)


async def test_a_worker_with_another_model_is_refused_on_both_sides(api_factory, joiners, caplog):
    api = await serve_joins(api_factory, stages=1)
    other = await joiners.start(api.cluster.joins.addr, "synthetic:layers=6,hidden=32", TOKEN)
    assert await other.exited(JOIN_S) == 2, other.log()
    said = (
        "model mismatch: the coordinator runs model 'synthetic:layers=6,hidden=16', "
        "the worker has model 'synthetic:layers=6,hidden=32'"
    )
    assert f"rlx-worker: refused: {said}" in other.log()
    assert any(said in r.getMessage() for r in caplog.records if r.name == "coordinator.stages.join")
    assert api.cluster.joins.members == []


async def test_a_worker_started_without_a_model_is_told_the_coordinators_and_serves_it(api_factory, joiners):
    api = await serve_joins(api_factory, stages=2)
    told = [await joiners.start(api.cluster.joins.addr, None, TOKEN) for _ in range(2)]

    async def settled() -> bool:
        return await healthy(api) or any(j.proc.returncode is not None for j in told)

    await eventually(settled, JOIN_S, "the workers told the model to be up")
    assert all(j.proc.returncode is None for j in told), "\n".join(j.log() for j in told)
    _, body, _ = await api.get("/nodes")
    assert [(m["model"], m["precision"]) for m in body["joined"]["members"]] == [(MODEL, "f32")] * 2

    _, created, _ = await api.post("/runs", json={"seq": 3, "seed": 4})
    run = await api.finished(created["id"])
    assert run["status"] == "ok", run
    _, done, _ = await api.get(f"/runs/{created['id']}?output=1")
    alone = build(MODEL, LayerRange(0, 6), "f32").forward(
        make_input(3, 16, 4), session="s", start_pos=0, last_only=False
    )
    np.testing.assert_array_equal(np.array(done["output"], np.float32), alone.ravel())


async def test_a_killed_worker_fails_the_run_in_flight_naming_it_and_a_new_joiner_takes_exactly_its_range(
    api_factory, joiners
):
    model = "fake:layers=6,delay_ms=300"
    # Recovery off: the run fails, as before runs waited for a vacancy to be filled (test_join_recovery).
    api = await serve_joins(api_factory, model, recover_timeout=0)
    for _ in range(3):
        await joiners.start(api.cluster.joins.addr, model, TOKEN)
    await eventually(lambda: healthy(api), JOIN_S, "the cluster to be ready")
    _, before, _ = await api.get("/nodes")
    victim = before["nodes"][1]
    [process] = [j for j in joiners.started if j.pid == victim["pid"]]

    _, created, _ = await api.post("/runs", json={"seq": 2})

    async def first_stage_done() -> bool:
        _, live, _ = await api.get(f"/runs/{created['id']}")
        return len(live["timings"]) >= 1

    await eventually(first_stage_done, 10, "the run to pass stage 0")
    process.kill()
    failed = await api.finished(created["id"])
    assert failed["status"] == "failed"
    assert f"stage 1 ({victim['addr']}, layers 2..4)" in failed["error"], failed["error"]
    down = await node(api, 1)
    # Its join connection or its stage connection, whichever the coordinator heard end first: closed,
    # or reset when the kernel still held a request the killed worker had not read.
    assert down["state"] == "down" and down["addr"] == victim["addr"]
    assert "closed the" in down["error"] or "Connection reset by peer" in down["error"], down["error"]

    killed_at = time.monotonic()
    await joiners.start(api.cluster.joins.addr, model, TOKEN)
    await eventually(lambda: healthy(api), JOIN_S, "a new joiner to take the vacant stage")
    _, after, _ = await api.get("/nodes")
    assert (
        after["nodes"][1]["layers"] == {"start": 2, "end": 4} and after["nodes"][1]["addr"] != victim["addr"]
    )
    assert [n["pid"] for i, n in enumerate(after["nodes"]) if i != 1] == [
        before["nodes"][0]["pid"],
        before["nodes"][2]["pid"],
    ]
    print(f"killed → up again through a new joiner: {time.monotonic() - killed_at:.1f}s")

    _, again, _ = await api.post("/runs", json={"seq": 2, "seed": 5})
    run = await api.finished(again["id"])
    assert run["status"] == "ok", run
    _, done, _ = await api.get(f"/runs/{again['id']}?output=1")
    x = make_input(2, 4, 5)
    np.testing.assert_array_equal(np.array(done["output"], np.float32), reference(x, range(6)).ravel())


async def test_a_spare_waits_and_fills_the_next_vacancy(api_factory, joiners):
    api = await serve_joins(api_factory, stages=2)
    for _ in range(3):
        await joiners.start(api.cluster.joins.addr, MODEL, TOKEN)

    async def one_spare() -> dict | None:
        _, body, _ = await api.get("/nodes")
        spares = [m for m in body["joined"]["members"] if m["state"] == "spare"]
        return len(spares) == 1 and await healthy(api) and spares[0]

    spare = await eventually(one_spare, JOIN_S, "two stages up and one spare")
    holder = await node(api, 0)
    [process] = [j for j in joiners.started if j.pid == holder["pid"]]
    process.kill()

    async def taken() -> bool:
        held = await node(api, 0)
        return held["state"] == "up" and held["addr"] == spare["addr"]

    await eventually(taken, JOIN_S, "the spare to take stage 0")
    assert (await node(api, 0))["layers"] == {"start": 0, "end": 3}
    assert len(joiners.started) == 3, "no worker was started to fill the vacancy"
    _, created, _ = await api.post("/runs", json={"seq": 2})
    assert (await api.finished(created["id"]))["status"] == "ok"


async def test_a_restarted_coordinator_gets_its_workers_back_by_themselves(joiners):
    config = ClusterConfig(MODEL, 2, join="127.0.0.1:0", worker_token=TOKEN)
    async with open_cluster(config) as first:
        for _ in range(2):
            await joiners.start(first.joins.addr, MODEL, TOKEN)
        await eventually(
            lambda: first.pipeline.unready() is None, JOIN_S, "the first coordinator to be ready"
        )
        addr = first.joins.addr
        pids = sorted(n.report.pid for n in first.pipeline.nodes)

    config = ClusterConfig(MODEL, 2, join=addr, worker_token=TOKEN)
    async with open_cluster(config) as second:
        await eventually(lambda: second.pipeline.unready() is None, JOIN_S, "the workers to rejoin")
        assert sorted(n.report.pid for n in second.pipeline.nodes) == pids
        run = await second.runner.run(RunRequest(seq=2))
        assert run.status == "ok", run.error
    assert all(j.proc.returncode is None for j in joiners.started)


async def test_serve_with_join_listens_says_where_and_is_ready_once_the_workers_join(joiners, monkeypatch):
    monkeypatch.setenv(auth.WORKER_TOKEN_ENV, TOKEN)
    args = ("--model", "fake:layers=4", "--stages", "2", "--join", "127.0.0.1:0", "--db", ":memory:")
    async with serving(*args) as serve:
        await serve.said("serving on")
        [addr] = re.findall(r"waiting for 2 worker\(s\) to join at (\S+) ", serve.stderr)
        status, health, _ = await serve.get("/healthz")
        assert status == 503 and "is vacant" in health["error"]
        for _ in range(2):
            await joiners.start(addr, "fake:layers=4", TOKEN)

        async def ready() -> bool:
            return (await serve.get("/healthz"))[0] == 200

        await eventually(ready, JOIN_S, f"the served cluster to be ready; stderr:\n{serve.stderr}")
        status, _, _ = await serve.post("/runs", {"seq": 2})
        assert status == 202
        await serve.said("is up, built in")
        assert "ready: all 2 stages are up" in serve.stderr


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["run", "--join", "127.0.0.1:0"], "--join goes with serve"),
        (
            ["serve", "--join", "127.0.0.1:0", "--attach", "127.0.0.1:9"],
            "--join and --attach exclude each other",
        ),
        (
            ["serve", "--join", "0.0.0.0:0"],
            f"--join 0.0.0.0:0: listening off loopback needs ${auth.WORKER_TOKEN_ENV}",
        ),
        (["serve", "--join", "127.0.0.1:x"], "argument --join: expected HOST:PORT"),
    ],
)
def test_join_options_that_cannot_work_are_refused_saying_why(capsys, monkeypatch, argv, says):
    monkeypatch.delenv(auth.WORKER_TOKEN_ENV, raising=False)
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--model", "fake:layers=2", "--db", ":memory:"])
    assert exited.value.code == 2
    assert says in capsys.readouterr().err


async def offer(
    addr: str, memory_bytes: int, model: str = MODEL
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Join by hand over the wire, offering `memory_bytes`; the connection, once admitted."""
    host, port = addr.rsplit(":", 1)
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 5)
    challenge, _ = await asyncio.wait_for(read_frame(reader), 5)
    nonce = auth.new_nonce()
    await send(writer, Hello(mac=auth.mac(TOKEN, JOINER, challenge.nonce), nonce=nonce))
    admit, _ = await asyncio.wait_for(read_frame(reader), 5)
    assert isinstance(admit, Admit) and auth.verify(TOKEN, COORDINATOR, nonce, admit.mac)
    by_hand = Offer(addr="127.0.0.1:9", model=model, fingerprint=fingerprint(model), precision="f32",
                    memory_bytes=memory_bytes, cores=1)  # fmt: skip
    await send(writer, by_hand)
    return reader, writer


async def test_workers_short_of_an_even_share_get_a_split_by_memory(api_factory):
    api = await serve_joins(api_factory, "synthetic:layers=4,hidden=64", stages=2)  # 65.8 kB a layer
    small = await offer(api.cluster.joins.addr, 70_000, "synthetic:layers=4,hidden=64")
    large = await offer(api.cluster.joins.addr, 1_000_000, "synthetic:layers=4,hidden=64")
    try:
        assigned = [(await asyncio.wait_for(read_frame(reader), 5))[0] for reader, _ in (small, large)]
        assert all(isinstance(a, Assign) for a in assigned)
        assert [a.layers for a in assigned] == [LayerRange(0, 1), LayerRange(1, 4)]
        assert len({a.ticket for a in assigned}) == 2 and all(len(a.ticket) == 32 for a in assigned)
        _, body, _ = await api.get("/nodes")
        assert [n["state"] for n in body["nodes"]] == ["building", "building"]
    finally:
        for _, writer in (small, large):
            writer.close()


async def test_workers_that_cannot_hold_the_model_are_told_apart_in_nodes_and_health(api_factory):
    api = await serve_joins(api_factory, "synthetic:layers=4,hidden=64", stages=2)
    joined = [await offer(api.cluster.joins.addr, 70_000, "synthetic:layers=4,hidden=64") for _ in range(2)]
    try:
        _, body, _ = await api.get("/nodes")
        short = "worker 127.0.0.1:9 has 70.0 kB free, its even share (layers 0..2) needs 132 kB"
        assert short in body["joined"]["plan_error"]
        assert [m["state"] for m in body["joined"]["members"]] == ["waiting", "waiting"]
        status, health, _ = await api.get("/healthz")
        assert status == 503 and "cannot hold the model's 4 layers in any split" in health["error"]
    finally:
        for _, writer in joined:
            writer.close()


async def test_a_first_joiner_with_no_memory_does_not_block_the_plan_and_waits_as_a_spare(api_factory):
    model = "synthetic:layers=4,hidden=64"
    api = await serve_joins(api_factory, model, stages=2)
    empty = await offer(api.cluster.joins.addr, 0, model)
    capable = [await offer(api.cluster.joins.addr, 1_000_000, model) for _ in range(2)]
    try:
        assigned = [(await asyncio.wait_for(read_frame(reader), 5))[0] for reader, _ in capable]
        assert all(isinstance(a, Assign) for a in assigned)
        assert [a.layers for a in assigned] == [LayerRange(0, 2), LayerRange(2, 4)]
        _, body, _ = await api.get("/nodes")
        assert [m["state"] for m in body["joined"]["members"]] == ["spare", "building", "building"]
        assert body["joined"]["plan_error"] is None
    finally:
        for _, writer in (empty, *capable):
            writer.close()


async def test_squatters_on_the_join_port_from_the_workers_host_and_others_never_keep_the_workers_out(
    api_factory, joiners
):
    api = await serve_joins(api_factory, stages=2)
    addr = api.cluster.joins.addr
    # The workers' own address among them: a bound per peer alone would not let the workers in.
    sources = ["127.0.0.1"] + [f"127.0.0.{i}" for i in range(2, 2 + MAX_UNAUTHENTICATED // MAX_PER_PEER)]
    async with Squatters(addr, sources, 2 * MAX_PER_PEER) as squatters:
        await eventually(lambda: squatters.closed >= len(sources), 10, "the squatters past the bounds to go")
        started = time.monotonic()
        for _ in range(2):
            await joiners.start(addr, MODEL, TOKEN)
        await eventually(lambda: healthy(api), JOIN_S, "the workers to be admitted past the squatters")
        print(f"{len(sources) * 2 * MAX_PER_PEER} squatters, ready in {time.monotonic() - started:.1f}s")
    _, created, _ = await api.post("/runs", json={"seq": 2})
    assert (await api.finished(created["id"]))["status"] == "ok"


async def test_a_spare_advertising_another_workers_address_is_refused_and_its_vacancy_waits_for_the_next(
    api_factory, joiners, caplog
):
    api = await serve_joins(api_factory, stages=2)
    addr = api.cluster.joins.addr
    for _ in range(2):
        await joiners.start(addr, MODEL, TOKEN)
    await eventually(lambda: healthy(api), JOIN_S, "the cluster to be ready")
    first, second = await node(api, 0), await node(api, 1)
    impostor = await joiners.start(addr, MODEL, TOKEN, "--advertise", first["addr"])

    async def spare() -> bool:
        _, body, _ = await api.get("/nodes")
        return any(m["state"] == "spare" for m in body["joined"]["members"])

    await eventually(spare, JOIN_S, "the third worker to wait as a spare")
    [victim] = [j for j in joiners.started if j.pid == second["pid"]]
    victim.kill()
    killed_at = time.monotonic()

    # It builds stage 1's layers, but the worker at the address it offered is stage 0's.
    assert await impostor.exited(JOIN_S) == 2, impostor.log()
    print(f"killed → the spare with another's address refused: {time.monotonic() - killed_at:.2f}s")
    said = f"the worker at {first['addr']} cannot prove it is the one that joined"
    assert f"rlx-worker: refused: {said}" in impostor.log()
    assert "(it serves layers 0..3 of 'synthetic:layers=6,hidden=16'" in impostor.log()
    warned = [r for r in caplog.records if r.name == "coordinator.stages.join" and said in r.getMessage()]
    assert warned and all(r.levelno == logging.WARNING for r in warned)
    refused = await node(api, 1)
    assert refused["state"] == "down" and said in refused["error"], refused
    assert (await node(api, 0))["addr"] == first["addr"]
    status, _, _ = await api.get("/healthz")
    assert status == 503

    await joiners.start(addr, MODEL, TOKEN)
    await eventually(lambda: healthy(api), JOIN_S, "the next worker to take the vacancy")
    taken = await node(api, 1)
    assert taken["layers"] == {"start": 3, "end": 6} and taken["addr"] not in (first["addr"], second["addr"])
    _, created, _ = await api.post("/runs", json={"seq": 4, "seed": 7})
    assert (await api.finished(created["id"]))["status"] == "ok"
    _, done, _ = await api.get(f"/runs/{created['id']}?output=1")
    alone = build(MODEL, LayerRange(0, 6), "f32").forward(
        make_input(4, 16, 7), session="s", start_pos=0, last_only=False
    )
    np.testing.assert_array_equal(np.array(done["output"], np.float32), alone.ravel())
