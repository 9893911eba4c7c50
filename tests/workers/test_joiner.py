"""A worker that joins: it dials until a coordinator answers, holds what it is given, lets go when it goes."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest

from coordinator.stages.join import JoinListener
from tests.conftest import eventually, worker_pids
from tests.support.joiners import Joiners
from workers.fake import reference
from workers.join import QUIET_S
from workers.models import describe

TOKEN = "join-test-token"
FAKE = "fake:layers=4"


@pytest.fixture
async def joiners():
    started = Joiners()
    yield started
    await started.close()
    assert worker_pids(os.getpid()) == [], "a joiner outlived its test"


@pytest.fixture
async def listen():
    """Open join listeners (and their pipelines) for a test; close them all at its end."""
    opened: list[JoinListener] = []

    async def _listen(model: str = FAKE, stages: int = 1, addr: str = "127.0.0.1:0") -> JoinListener:
        listener = await JoinListener.open(addr, describe(model), stages, TOKEN, build_timeout=30)
        opened.append(listener)
        return listener

    yield _listen
    for listener in opened:
        await close(listener)


async def close(listener: JoinListener) -> None:
    await listener.close()
    await listener.pipeline.close()


def vm_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


async def refused(addr: str) -> bool:
    """Whether nothing listens at `addr` any more."""
    host, port = addr.rsplit(":", 1)
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 2)
    except OSError:
        return True
    writer.close()
    return False


async def test_a_worker_that_cannot_join_keeps_trying_and_logs_at_most_once_every_few_seconds(joiners):
    attempts = []

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        attempts.append(asyncio.get_running_loop().time())
        writer.close()

    server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        joiner = await joiners.start(f"127.0.0.1:{port}", FAKE, TOKEN)
        await eventually(lambda: len(attempts) >= 3, 15, "three attempts to join")
        lines = [line for line in joiner.stderr if "cannot join the coordinator" in line]
        assert attempts[2] - attempts[0] < QUIET_S, "the attempts came slower than the test assumes"
        assert len(lines) == 1, joiner.log()
        assert "the coordinator closed the connection; trying again in 0.5s" in lines[0]
        assert joiner.proc.returncode is None, "a worker must not give up on an absent coordinator"
        gaps = [b - a for a, b in pairwise(attempts)]
        assert gaps[1] > gaps[0] * 1.5, f"no backoff between attempts: {gaps}"
    finally:
        server.close()


async def test_a_worker_offers_this_end_of_its_connection_and_serves_the_layers_it_is_given(listen, joiners):
    listener = await listen(FAKE, stages=1)
    await joiners.start(listener.addr, FAKE, TOKEN)
    await eventually(lambda: listener.pipeline.unready() is None, 20, "the joiner to be up")
    [member] = listener.members
    node = listener.pipeline.nodes[0]
    assert member.offer.addr == node.report.addr and node.report.addr.startswith("127.0.0.1:")
    assert member.offer.memory_bytes > 0 and member.offer.cores >= 1 and member.offer.model == FAKE
    x = np.ones((2, 4), np.float32)
    y = await listener.pipeline.forward(x, session="s", start_pos=0)
    np.testing.assert_array_equal(y, reference(x, range(4)))


async def test_a_worker_advertises_the_address_it_is_told_to(listen, joiners):
    listener = await listen(FAKE, stages=1)
    with socket.socket() as probe:  # a free port the worker then binds, named differently
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    await joiners.start(
        listener.addr,
        FAKE,
        TOKEN,
        "--host",
        "0.0.0.0",
        "--port",
        str(port),
        "--advertise",
        f"localhost:{port}",
    )
    await eventually(lambda: listener.members, 20, "the joiner to join")
    assert listener.members[0].offer.addr == f"localhost:{port}"
    await eventually(lambda: listener.pipeline.unready() is None, 20, "the coordinator to reach it there")


async def test_a_worker_whose_coordinator_goes_frees_its_stage_and_joins_the_next_one(listen, joiners):
    model = "synthetic:layers=2,hidden=1024"  # 33 MB of weights: enough to see them freed
    first = await listen(model, stages=1)
    joiner = await joiners.start(first.addr, model, TOKEN)
    await eventually(lambda: first.pipeline.unready() is None, 30, "the joiner to be up")
    old_addr = first.pipeline.nodes[0].report.addr
    held = vm_rss(joiner.pid)

    await close(first)
    await eventually(lambda: refused(old_addr), 10, "the worker to stop serving its stage")
    await eventually(lambda: vm_rss(joiner.pid) < held - 25_000_000, 10, "the worker to free its stage")
    assert joiner.proc.returncode is None

    second = await listen(model, stages=1, addr=first.addr)
    await eventually(lambda: second.pipeline.unready() is None, 30, "the worker to join the new coordinator")
    assert any("dropped" in line for line in joiner.stderr), joiner.log()


def test_join_excludes_layers_and_needs_a_host_and_port():
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-P", "-m", "workers", *args], capture_output=True, text=True, timeout=30
        )

    both = run("--join", "127.0.0.1:9", "--layers", "0..2")
    assert both.returncode == 2 and "--layers and --join exclude each other" in both.stderr
    bad = run("--join", "nowhere")
    assert bad.returncode == 2 and "'nowhere' is not HOST:PORT" in bad.stderr
    alone = run("--advertise", "a:1", "--model", FAKE, "--layers", "0..2")
    assert alone.returncode == 2 and "--advertise goes with --join" in alone.stderr


def test_an_advertised_address_that_is_not_host_port_is_refused_naming_the_option():
    bad = subprocess.run(
        [sys.executable, "-P", "-m", "workers", "--join", "127.0.0.1:9", "--advertise", "nowhere"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert bad.returncode == 2, bad.stderr
    assert "argument --advertise: expected HOST:PORT" in bad.stderr
    assert "'nowhere' is not HOST:PORT" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_a_worker_whose_model_file_cannot_be_read_says_so_before_joining(tmp_path):
    missing = tmp_path / "missing.gguf"
    # Nothing listens on port 9: the worker must fail on its model before it ever dials.
    done = subprocess.run(
        [sys.executable, "-P", "-m", "workers", "--join", "127.0.0.1:9", "--model", str(missing)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 1
    assert f"rlx-worker: {missing}: cannot read model file" in done.stderr
    assert "cannot join" not in done.stderr
