"""A worker that joins: it dials until a coordinator answers, holds what it is given, lets go when it goes."""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest

from coordinator.stages.chain import ForwardRequest
from coordinator.stages.join import JoinListener
from tests.conftest import eventually
from tests.support.tiny_gguf import TinyLlama, write_tiny_llama
from workers.fake import reference
from workers.join import ASSUMED_MODEL, QUIET_S
from workers.models import ModelSpecError, default_precision, describe, gemma3_path
from workers.models.footprint import fingerprint
from workers.protocol import auth
from workers.protocol.info import BatchItem
from workers.protocol.joining import COORDINATOR, JOINER
from workers.protocol.messages import Admit, Challenge, Hello, Offer
from workers.protocol.wire import read_frame, send

TOKEN = "join-test-token"
FAKE = "fake:layers=4"


@pytest.fixture
async def listen():
    """Open join listeners (and their pipelines) for a test; close them all at its end."""
    opened: list[JoinListener] = []

    async def _listen(
        model: str = FAKE, stages: int = 1, addr: str = "127.0.0.1:0", precision: str = ""
    ) -> JoinListener:
        listener = await JoinListener.open(
            addr, describe(model), stages, TOKEN, build_timeout=30, precision=precision
        )
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
    y = await listener.pipeline.forward(ForwardRequest(BatchItem(x, "s", 0)))
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


async def test_a_worker_started_without_a_model_is_told_the_coordinators_and_serves_it(listen, joiners):
    listener = await listen(FAKE, stages=1)
    await joiners.start(listener.addr, None, TOKEN)
    await eventually(lambda: listener.pipeline.unready() is None, 20, "the joiner to be up")
    [member] = listener.members
    assert (member.offer.model, member.offer.precision) == (FAKE, "f32")
    assert member.offer.fingerprint == fingerprint(FAKE)
    x = np.ones((2, 4), np.float32)
    y = await listener.pipeline.forward(ForwardRequest(BatchItem(x, "s", 0)))
    np.testing.assert_array_equal(y, reference(x, range(4)))


class ByHand:
    """A join listener written out by hand: it admits with the fields given and keeps the offers."""

    def __init__(self, **admit: str) -> None:
        self.admit = admit
        self.offers: list[Offer] = []
        self._writers: set[asyncio.StreamWriter] = set()
        self.addr = ""
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> ByHand:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.addr = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            nonce = auth.new_nonce()
            await send(writer, Challenge(nonce=nonce))
            hello, _ = await asyncio.wait_for(read_frame(reader), 5)
            assert isinstance(hello, Hello) and auth.verify(TOKEN, JOINER, nonce, hello.mac)
            await send(writer, Admit(mac=auth.mac(TOKEN, COORDINATOR, hello.nonce), **self.admit))
            offer, _ = await asyncio.wait_for(read_frame(reader), 5)
            self.offers.append(offer)
            await asyncio.wait_for(reader.read(), 60)  # held open, as a spare's is, until either side goes
        finally:
            writer.close()


async def test_a_worker_offers_the_model_and_precision_its_coordinator_names_unless_given_its_own(joiners):
    async with ByHand(model="fake:layers=3", precision="packed") as coordinator:
        await joiners.start(coordinator.addr, None, TOKEN)
        await joiners.start(coordinator.addr, FAKE, TOKEN, "--precision", "f32")
        await eventually(lambda: len(coordinator.offers) == 2, 20, "both workers to offer")
    told, given = sorted(coordinator.offers, key=lambda o: o.model != "fake:layers=3")
    assert (told.model, told.precision, told.fingerprint) == (
        "fake:layers=3",
        "packed",
        fingerprint("fake:layers=3"),
    )
    assert (given.model, given.precision, given.fingerprint) == (FAKE, "f32", fingerprint(FAKE))


async def test_a_coordinator_that_does_not_name_its_model_is_offered_the_model_workers_assumed_before(
    joiners,
):
    async with ByHand() as older:  # an Admit with no model field, as a coordinator before it sent
        joiner = await joiners.start(older.addr, None, TOKEN)
        await eventually(lambda: older.offers, 30, "the worker to offer")
    [offer] = older.offers
    assert offer.model == ASSUMED_MODEL == "smollm2" and offer.fingerprint == fingerprint(ASSUMED_MODEL)
    assert "does not say its model; assuming 'smollm2'" in joiner.log()


async def test_a_worker_told_gemma3_offers_the_file_joined_from_the_packages_on_its_own_host(joiners):
    try:  # the file the coordinator's host would offer (and joins it here, once, if it is not yet)
        ours = fingerprint("gemma3")
    except ModelSpecError as exc:
        pytest.skip(str(exc))
    async with ByHand(model="gemma3") as coordinator:
        joiner = await joiners.start(coordinator.addr, None, TOKEN)
        await eventually(lambda: coordinator.offers, 30, "the worker to offer")
    [offer] = coordinator.offers
    assert (offer.model, offer.precision) == ("gemma3", default_precision("gemma3"))
    assert offer.fingerprint == ours and ours.name == gemma3_path().name == "gemma-3-270m-q4_k_m.gguf"
    assert "runs model 'gemma3': this worker serves it" in joiner.log()


async def test_a_worker_told_a_model_whose_file_differs_on_its_own_disk_is_refused_saying_so(
    listen, joiners, tmp_path, monkeypatch
):
    here, there = tmp_path / "coordinator", tmp_path / "worker"
    here.mkdir()
    there.mkdir()
    write_tiny_llama(here / "model.gguf")
    write_tiny_llama(there / "model.gguf", TinyLlama(ffn=128))
    monkeypatch.chdir(here)  # the coordinator names a relative path: each side finds its own file
    listener = await listen("model.gguf", stages=1)
    joiner = await joiners.start(listener.addr, None, TOKEN, cwd=there)
    assert await joiner.exited(20) == 2, joiner.log()
    size = (here / "model.gguf").stat().st_size
    said = f"rlx-worker: refused: model mismatch: the coordinator runs model.gguf ({size} bytes"
    assert said in joiner.log() and "(its copy of model.gguf)" in joiner.log()
    assert listener.members == []


async def test_a_worker_told_a_model_it_cannot_open_says_so_on_both_sides_and_exits(
    listen, joiners, tmp_path, monkeypatch, caplog
):
    here, there = tmp_path / "coordinator", tmp_path / "worker"
    here.mkdir()
    there.mkdir()
    write_tiny_llama(here / "model.gguf")
    monkeypatch.chdir(here)
    listener = await listen("model.gguf", stages=1)
    joiner = await joiners.start(listener.addr, None, TOKEN, cwd=there)
    assert await joiner.exited(20) == 1, joiner.log()
    said = "runs model 'model.gguf', which this worker cannot open: model.gguf: cannot read model file"
    assert said in joiner.log() and "start it with --model naming its own copy" in joiner.log()
    warnings = [r.getMessage() for r in caplog.records if r.name == "coordinator.stages.join"]
    assert any("it cannot serve the model" in w and said in w for w in warnings), warnings
    assert all(r.levelno == logging.WARNING for r in caplog.records if r.name == "coordinator.stages.join")
    assert listener.members == []
