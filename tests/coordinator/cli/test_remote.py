"""The command line as a person uses it: `runs` and `show` against a served coordinator, build progress."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import pty
import re
import struct
import sys
import termios

import aiohttp
import pytest
import pytest_asyncio

from tests.conftest import eventually, worker_pids
from tests.support.serving import REPO, Serve, free_port

TOKEN = "cli-client-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CLI_TIMEOUT_S = 60
# Workers that take this long to build give the display time to redraw a few times.
SLOW_BUILD = "fake:layers=6,late_ms=1500"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # colours and cursor movements
shared_loop = pytest.mark.asyncio(loop_scope="module")


class Served:
    """A served coordinator with two finished runs, and its API for the tests to compare against."""

    def __init__(self, serve: Serve, runs: list[int]) -> None:
        self.serve, self.runs = serve, runs
        self.url = f"http://127.0.0.1:{serve.port}"

    async def get(self, path: str) -> tuple[int, str]:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
            session.get(self.url + path, headers=AUTH) as r,
        ):
            return r.status, await r.text()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served():
    serve = await Serve.start(
        "--model", "fake:layers=4", "--stages", "2", "--db", ":memory:", "--token", TOKEN
    )
    try:
        await serve.said("serving on")
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            runs = []
            for seq in (2, 5):
                async with session.post(
                    f"http://127.0.0.1:{serve.port}/runs", json={"seq": seq}, headers=AUTH
                ) as r:
                    runs.append((await r.json())["id"])
        it = Served(serve, runs)

        async def finished() -> bool:
            views = [json.loads((await it.get(f"/runs/{i}"))[1]) for i in runs]
            return all(view["status"] == "ok" for view in views)

        await eventually(finished, 20, "both runs to finish")
        yield it
    finally:
        await serve.stop()


async def cli(*args: str, token: str | None = TOKEN) -> tuple[int, str, str]:
    """Run `rlx-cluster ARGS`; its exit status, stdout and stderr."""
    env = {k: v for k, v in os.environ.items() if k not in ("RLX_CLUSTER_TOKEN", "RLX_CLUSTER_URL")}
    if token is not None:
        env["RLX_CLUSTER_TOKEN"] = token
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "coordinator", *args, cwd=REPO, env=env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(proc.communicate(), CLI_TIMEOUT_S)
    finally:
        if proc.returncode is None:
            proc.kill()
            await asyncio.wait_for(proc.wait(), 10)
    return proc.returncode, out.decode(), err.decode()


@shared_loop
async def test_runs_lists_the_served_runs_newest_first(served):
    code, out, err = await cli("runs", "--url", served.url)
    assert code == 0, err
    head, *lines = out.splitlines()
    assert head.split()[:3] == ["id", "status", "model"]
    first, second = served.runs
    assert [line.split()[:4] for line in lines] == [
        [str(second), "ok", "fake:layers=4", "5"],
        [str(first), "ok", "fake:layers=4", "2"],
    ]
    code, out, _ = await cli("runs", "--url", served.url, "--limit", "1")
    assert code == 0 and [line.split()[0] for line in out.splitlines()[1:]] == [str(second)]


@shared_loop
async def test_show_prints_a_run_as_its_table_or_as_the_apis_json(served):
    first, second = served.runs
    code, out, err = await cli("show", str(first), "--url", served.url)
    status, table = await served.get(f"/runs/{first}/table")
    assert code == 0 and status == 200, err
    assert out.startswith(f"run {first} ok, model fake:layers=4") and out.endswith(table)
    code, out, err = await cli("show", "latest", "--json", "--url", served.url)
    status, latest = await served.get("/run/latest")
    assert code == 0 and status == 200, err
    assert json.loads(out) == json.loads(latest) and json.loads(out)["id"] == second


@shared_loop
@pytest.mark.parametrize(
    ("args", "token", "code", "says"),
    [
        (["show", "9999"], TOKEN, 2, "no run 9999 (HTTP 404)"),
        (["runs"], None, 2, "a bearer token is needed: pass --token or set $RLX_CLUSTER_TOKEN"),
        (["show", "latest"], "wrong", 2, "a bearer token was refused"),
    ],
)
async def test_a_run_that_is_not_there_or_a_token_that_is_not_right_is_one_line_and_exit_2(
    served, args, token, code, says
):
    got, out, err = await cli(*args, "--url", served.url, token=token)
    assert (got, out) == (code, "")
    assert err.startswith("rlx-cluster: ") and says in err and err.count("\n") == 1, err


@shared_loop
async def test_a_coordinator_that_is_not_there_is_one_line_and_exit_1():
    url = f"http://127.0.0.1:{free_port()}"
    code, out, err = await cli("runs", "--url", url)
    assert (code, out) == (1, "")
    reason = "connection refused (is rlx-cluster serving there?)"
    assert err == f"rlx-cluster: cannot reach the coordinator at {url}: {reason}\n"


@shared_loop
@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["show", "x1"], "argument ID|latest: expected a run id (a whole number >= 1) or latest, got 'x1'"),
        (
            ["runs", "--url", "localhost:8470"],
            "argument --url: expected http://HOST:PORT, got 'localhost:8470'",
        ),
        (["runs", "--limit", "0"], "argument --limit: must be a whole number in 1..1000, got '0'"),
    ],
)
async def test_client_options_that_make_no_sense_are_refused_naming_them(args, says):
    code, out, err = await cli(*args)
    assert (code, out) == (2, "") and says in err


def _read_until_closed(fd: int) -> bytes:
    """Everything written to a pseudo-terminal until its last writer closes it."""
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


@shared_loop
async def test_building_workers_show_one_line_per_stage_redrawn_in_place_on_a_terminal():
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    env = {**os.environ, "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "coordinator", "run", "--model", SLOW_BUILD, "--stages", "3",
        "--db", ":memory:", cwd=REPO, env=env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=follower,
    )  # fmt: skip
    os.close(follower)
    reading = asyncio.create_task(asyncio.to_thread(_read_until_closed, leader))
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), CLI_TIMEOUT_S)
        screen = (await asyncio.wait_for(reading, 10)).decode(errors="replace")
    finally:
        if proc.returncode is None:
            proc.kill()
            await asyncio.wait_for(proc.wait(), 10)
        os.close(leader)
    assert proc.returncode == 0, screen
    plain = ANSI.sub("", screen)
    for i, layers in enumerate(("0..2", "2..4", "4..6")):
        line = f"stage {i}  layers {layers}  "
        assert re.search(re.escape(line) + r". building … \d+\.\ds", plain), plain
        assert re.search(re.escape(line) + r"✓ ready at 127\.0\.0\.1:\d+, built in \d", plain), plain
    assert "\x1b[1A" in screen and "\x1b[2K" in screen  # the lines were redrawn in place
    assert "building: stage" not in screen  # the launcher's plain ticks are left out
    assert out.decode().startswith("node ")  # stdout is the table's alone
    await eventually(lambda: worker_pids(proc.pid) == [], 10, "the workers to exit")


@shared_loop
async def test_building_workers_print_plain_lines_when_stderr_is_not_a_terminal(rlx_cluster):
    c = rlx_cluster.launch(["run", "--model", SLOW_BUILD, "--stages", "3", "--db", ":memory:"])
    code = await c.aio.exit_code(CLI_TIMEOUT_S)
    out, err = c.stdout, c.stderr
    assert code == 0, err
    assert "\x1b[" not in err
    lines = err.splitlines()
    assert any(line.startswith("building: stage ") for line in lines)
    for i, layers in enumerate(("0..2", "2..4", "4..6")):
        assert any(line.startswith(f"stage {i} (layers {layers}): ready at 127.0.0.1:") for line in lines), (
            err
        )
    assert out.startswith("node ")
