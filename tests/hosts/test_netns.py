"""The namespace hosts themselves: names resolve, traffic crosses the bridge, nothing outlives a run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hosts.conftest import _can_make_namespaces
from tests.hosts.netns import Network, ip, sweep_abandoned, wait_until

SERVE = "import socket; s = socket.create_server(('0.0.0.0', 9000)); c, _ = s.accept(); c.sendall(b'hi')"
DIAL = "import socket; print(socket.create_connection(('server', 9000), timeout=5).recv(2).decode())"
# A run that is killed before it closes: it writes down its namespaces, then waits to be killed.
ABANDONED = """
import json, pathlib, sys, time
from tests.hosts.netns import Network
out = pathlib.Path(sys.argv[1])
net = Network(); net.open(); host = net.add("a"); net.write_hosts_files({})
sleeper = net.popen(host, [sys.executable, "-c", "import time; time.sleep(60)"], {}, out.with_suffix(".log"))
out.with_suffix(".tmp").write_text(json.dumps({"namespaces": [net.switch, host.netns], "pid": sleeper.pid}))
out.with_suffix(".tmp").rename(out)
time.sleep(60)
"""


@pytest.fixture
def network():
    reason = _can_make_namespaces()
    if reason:
        pytest.skip(reason)
    net = Network()
    try:
        net.open()
        yield net
    finally:
        net.close()


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie waiting to be reaped does not count)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def namespaces() -> set[str]:
    return {line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()}


def test_hosts_reach_each_other_by_name_across_the_bridge_and_close_leaves_nothing(network, tmp_path):
    server, client = network.add("server"), network.add("client")
    network.write_hosts_files({})
    env = {"PATH": os.environ.get("PATH", os.defpath)}
    listening = network.popen(server, [sys.executable, "-c", SERVE], env, tmp_path / "server.log")
    network.popen(client, [sys.executable, "-c", "import time; time.sleep(60)"], env, tmp_path / "idle.log")

    def dialed():
        code, out, _ = network.run(client, [sys.executable, "-c", DIAL], env, timeout=10)
        return code == 0 and out.strip() == "hi"

    wait_until(dialed, 10, "the client to reach the server by name")
    assert listening.wait(5) == 0
    code, out, _ = network.run(client, ["ip", "-o", "-4", "addr", "show", "dev", "eth0"], env, timeout=10)
    assert code == 0 and f"{client.addr}/" in out

    network.close()
    assert network.leftovers() == []
    assert all(p.poll() is not None for p in network.procs)


def test_the_namespaces_and_processes_of_a_killed_run_are_swept_by_the_next(tmp_path):
    reason = _can_make_namespaces()
    if reason:
        pytest.skip(reason)
    root = str(Path(__file__).resolve().parents[2])
    said = tmp_path / "abandoned.json"
    run = subprocess.Popen(
        [sys.executable, "-c", ABANDONED, str(said)], cwd=root, env={**os.environ, "PYTHONPATH": root}
    )
    try:
        wait_until(said.exists, 20, "the abandoned run to make its namespaces")
    finally:
        run.kill()
        run.wait(10)
    left = json.loads(said.read_text())
    assert set(left["namespaces"]) <= namespaces()
    assert alive(left["pid"])

    swept = sweep_abandoned()
    assert set(left["namespaces"]) <= set(swept)
    assert not set(left["namespaces"]) & namespaces()
    wait_until(lambda: not alive(left["pid"]), 10, "the abandoned run's process to be gone")
