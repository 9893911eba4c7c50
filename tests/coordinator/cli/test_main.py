"""The coordinator as a person runs it: a real process, real signals, a real DB file."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sqlite3
from urllib.parse import urlsplit

import pytest

from coordinator.cli.main import cluster_config, parse_args
from coordinator.testing import RlxCluster
from tests.conftest import eventually, worker_pids
from workers.__main__ import parse_args as worker_args


@pytest.fixture
def coordinator(rlx_cluster):
    """Start `rlx-cluster ARGS` through the plugin, on a free loopback port unless `serve` is False."""

    async def start(*args: str, serve: bool = True) -> RlxCluster:
        argv = [*args, "--http", "127.0.0.1:0"] if serve else list(args)
        return await asyncio.to_thread(rlx_cluster.launch, argv)

    return start


async def test_run_prints_the_table_and_leaves_no_worker(coordinator, tmp_path):
    c = await coordinator(
        "run", "--model", "synthetic:layers=6", "--stages", "3", "--db", str(tmp_path / "r.db"), serve=False
    )
    assert await c.aio.exit_code() == 0
    text = c.stdout
    assert text.startswith("node ") and "across 3 stages" in text and text.count("127.0.0.1:") == 3
    assert worker_pids(c.pid) == []


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--model", "nonsense", "--stages", "2"], "accepted: synthetic"),
        (["--model", "synthetic:layers=3", "--stages", "5"], "cannot split 3 layers into 5 stages"),
        (["--model", "synthetic", "--stages", "2", "--http", "0.0.0.0:8470", "--serve"], "needs a token"),
        (["--model", "synthetic", "--stages", "2", "--seq", "0"], "bad run options"),
    ],
)
async def test_bad_command_lines_are_clear_errors(coordinator, args, says):
    c = await coordinator("run", *args, "--db", ":memory:", serve=False)
    assert await c.aio.exit_code() == 2
    assert says in c.stderr


@pytest.mark.parametrize("command", [["serve"], ["run", "--serve"]])
async def test_an_api_address_in_use_is_refused_before_any_worker_starts(coordinator, command):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        argv = [*command, "--model", "fake:layers=2", "--db", ":memory:", "--http", f"127.0.0.1:{port}"]
        c = await coordinator(*argv, serve=False)
        assert await c.aio.exit_code() == 2
    assert f"rlx-cluster: cannot serve on 127.0.0.1:{port}: " in c.stderr and "in use" in c.stderr
    assert "launching" not in c.stderr and c.stdout == ""


async def test_corrupt_db_is_a_clear_error_and_is_left_untouched(coordinator, tmp_path):
    db = tmp_path / "runs.db"
    db.write_bytes(b"this is not a database" * 100)
    c = await coordinator("run", "--model", "synthetic", "--stages", "1", "--db", str(db), serve=False)
    assert await c.aio.exit_code() == 2
    assert str(db) in c.stderr
    assert db.read_bytes() == b"this is not a database" * 100


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
async def test_signal_mid_run_stores_it_interrupted_and_stops_every_worker(coordinator, tmp_path, sig):
    db = tmp_path / "runs.db"
    c = await coordinator(
        "serve", "--model", "fake:layers=4,delay_ms=5000,stage=2", "--stages", "2", "--db", str(db)
    )
    await c.aio.said("serving on")
    workers = worker_pids(c.pid)
    assert len(workers) == 2
    run_id = await c.aio.post_run(seq=2)
    await c.aio.wait(run_id, "running", 10)
    c.signal(sig)
    assert await c.aio.exit_code() == 128 + sig
    assert not any(os.path.exists(f"/proc/{pid}") for pid in workers)
    row = sqlite3.connect(db).execute("select status from runs where id = ?", (run_id,)).fetchone()
    assert row == ("interrupted",)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
async def test_signal_while_workers_build_stops_them(coordinator, sig):
    c = await coordinator(
        "serve", "--model", "fake:layers=4,late_ms=60000", "--stages", "2", "--db", ":memory:"
    )
    await eventually(lambda: len(worker_pids(c.pid)) == 2, 20, "two building workers")
    workers = worker_pids(c.pid)
    c.signal(sig)
    assert await c.aio.exit_code() == 128 + sig
    assert not any(os.path.exists(f"/proc/{pid}") for pid in workers)


async def test_killed_coordinator_leaves_no_worker_and_its_finished_runs_survive(coordinator, tmp_path):
    db = tmp_path / "runs.db"
    c = await coordinator("run", "--model", "fake:layers=4", "--stages", "2", "--db", str(db), "--serve")
    await c.aio.said("serving on")
    first = await c.aio.run("latest")
    second = await c.aio.post_run(seq=3)
    await c.aio.wait(second, "ok", 10)
    workers = worker_pids(c.pid)
    c.signal(signal.SIGKILL)
    await c.aio.exit_code()
    await eventually(
        lambda: not any(os.path.exists(f"/proc/{p}") for p in workers), 5, "orphaned workers to exit"
    )

    again = await coordinator("serve", "--model", "fake:layers=4", "--stages", "2", "--db", str(db))
    await again.aio.said("serving on")
    runs = (await again.aio.get("/runs")).body
    assert [r["id"] for r in runs["runs"]] == [second, first["id"]]
    assert all(r["status"] == "ok" for r in runs["runs"])
    assert (await again.aio.run("latest"))["id"] == second


async def test_plan_prints_the_split_without_starting_anything(coordinator):
    c = await coordinator("plan", "--model", "synthetic:layers=10", "--stages", "3", serve=False)
    assert await c.aio.exit_code() == 0
    assert c.stdout.splitlines() == [
        "stage 0: layers 0..4 (4 of 10)",
        "stage 1: layers 4..7 (3 of 10)",
        "stage 2: layers 7..10 (3 of 10)",
    ]
    assert worker_pids(c.pid) == []


async def test_a_coordinator_told_to_exit_with_a_parent_it_does_not_have_does_not_start(coordinator):
    # The fixture gives its own pid first; the last one given is the one that counts.
    c = await coordinator("--exit-with-parent", "999999999", "plan", "--model", "fake:layers=2", serve=False)
    assert await c.aio.exit_code() == 1
    assert "rlx-cluster: parent 999999999 is gone" in c.stderr and c.stdout == ""


async def test_serve_attaches_to_workers_started_by_hand(coordinator, launch, monkeypatch):
    pipeline = await launch("fake:layers=4", 2)
    monkeypatch.setenv("RLX_WORKER_TOKEN", pipeline.supervisor.token)
    addrs = ",".join(n.report.addr for n in pipeline.nodes)
    c = await coordinator("serve", "--model", "fake:layers=4", "--attach", addrs, "--db", ":memory:")
    await c.aio.said("serving on")
    await c.aio.wait(await c.aio.post_run(seq=2), "ok", 10)
    nodes = await c.aio.nodes()
    assert [n["addr"] for n in nodes] == addrs.split(",") and all(n["state"] == "up" for n in nodes)


async def test_attach_with_a_wrong_token_is_a_clear_error(coordinator, launch, monkeypatch):
    pipeline = await launch("fake:layers=4", 1)
    monkeypatch.setenv("RLX_WORKER_TOKEN", "wrong")
    c = await coordinator(
        "serve", "--model", "fake:layers=4", "--attach", pipeline.nodes[0].report.addr, "--db", ":memory:"
    )
    assert await c.aio.exit_code() == 1
    assert "wrong token" in c.stderr


def test_precision_defaults_to_the_files_blocks_for_a_gguf_model_and_is_f32_for_the_test_models(smollm2):
    def precision(*argv: str) -> str:
        return cluster_config(parse_args(["serve", "--db", ":memory:", *argv]), progress=print).precision

    assert precision("--model", "smollm2") == precision("--model", str(smollm2)) == "packed"
    assert precision("--model", "smollm2", "--precision", "f32") == "f32"
    assert precision("--model", "fake:layers=2") == precision("--model", "synthetic") == "f32"
    # A worker started by hand takes the same default, so that it matches the coordinator's.
    assert worker_args(["--model", "smollm2", "--layers", "0..2"]).precision == "packed"
    assert worker_args(["--model", "fake:layers=2", "--layers", "0..2"]).precision == "f32"


def _exchange(port: int, request: bytes) -> bytes:
    """Send one raw request and read until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(request)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


async def test_the_served_coordinator_answers_a_malformed_request_in_json_and_serves_livez(coordinator):
    c = await coordinator("serve", "--model", "fake:layers=2", "--stages", "1", "--db", ":memory:")
    await c.aio.said("serving on")
    bad_length = b"POST /runs HTTP/1.1\r\nHost: x\r\nContent-Length: x\r\n\r\n"
    out = await asyncio.to_thread(_exchange, urlsplit(c.base_url).port, bad_length)
    head, _, body = out.partition(b"\r\n\r\n")
    assert b" 400 " in head.split(b"\r\n")[0] and b"Content-Type: application/json" in head
    assert "Content-Length" in json.loads(body)["error"]
    assert (await c.aio.get("/livez"))[:2] == (200, {"ok": True})
