"""The compose deployment on network-namespace hosts: one host per replica, plus a client host."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hosts.compose import COMPOSE_FILE, MODEL_ENV, Service, load
from tests.hosts.netns import Host, NetError, Network, stop, sweep_abandoned, wait_until
from workers.models import packages

VENV_BIN = Path(sys.executable).parent
CLIENT_SCRIPT = Path(__file__).with_name("client.py")
API_PORT = 8470
CLIENT_TIMEOUT = 30.0
LOG_TAIL = 25


class Deployment:
    """The compose services running on namespace hosts, and an HTTP client on another host."""

    def __init__(self, net: Network, services: list[Service], workdir: Path, tokens: dict[str, str]) -> None:
        self.net, self.tokens, self.workdir = net, tokens, workdir
        self.services = {s.name: s for s in services}
        self.replica_of = {r: s for s in services for r in s.replica_names()}
        self.mounts = {v: workdir / "volumes" / v for s in services for v in s.volumes.values()}
        self.procs: dict[str, subprocess.Popen] = {}
        self.started_at: dict[str, float] = {}
        self.base_env = {
            # The venv's entry points stand in for the image's; PATH finds them first.
            "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', os.defpath)}",
            "HOME": str(workdir / "home"),
            "PYTHONUNBUFFERED": "1",  # as the image sets it: logs reach the file as they happen
            # As the image sets it to the cache it was built with: a model joined from parts (gemma3) is
            # found joined, not joined again into each run's fresh HOME.
            "RLX_MODEL_CACHE": str(packages.cache_dir()),
        }
        for folder in (*self.mounts.values(), workdir / "home", workdir / "logs"):
            folder.mkdir(parents=True, exist_ok=True)

    def host(self, name: str) -> Host:
        return self.net.hosts[name]

    def addr(self, name: str) -> str:
        return self.net.hosts[name].addr

    def log(self, name: str) -> Path:
        return self.workdir / "logs" / f"{name}.log"

    def start(
        self, replica: str, env: dict[str, str] | None = None, host: str | None = None
    ) -> subprocess.Popen:
        """Start a replica's command on its host (or `host`), with its environment (or `env`)."""
        service = self.replica_of[replica]
        environment = service.env(self.mounts) if env is None else env
        host = host or replica
        proc = self.net.popen(
            self.host(host), service.argv(self.mounts), {**self.base_env, **environment}, self.log(host)
        )
        self.procs[host] = proc
        self.started_at[host] = time.monotonic()
        return proc

    def stop(self, host: str) -> int | None:
        return stop(self.procs[host])

    def tail(self, *hosts: str) -> str:
        """The last lines of each host's log, for a failure message."""
        parts = []
        for host in hosts or tuple(self.procs):
            path = self.log(host)
            lines = path.read_text(errors="replace").splitlines()[-LOG_TAIL:] if path.exists() else []
            parts.append(f"\n--- {host} (last {len(lines)} lines) ---\n" + "\n".join(lines))
        return "".join(parts)

    def request(
        self, method: str, path: str, body: object = None, token: str | None = "api"
    ) -> tuple[int, object]:
        """Send one request to the coordinator's API from the client host; token None sends none."""
        env = {**self.base_env}
        if token is not None:
            env["RLX_CLUSTER_TOKEN"] = self.tokens["RLX_CLUSTER_TOKEN"] if token == "api" else token
        argv = [sys.executable, "-I", str(CLIENT_SCRIPT), method, f"http://coordinator:{API_PORT}{path}"]
        if body is not None:
            argv.append(json.dumps(body))
        code, out, err = self.net.run(self.host("client"), argv, env, CLIENT_TIMEOUT)
        if code != 0:
            raise AssertionError(f"client {method} {path} failed (exit {code}): {err.strip()}")
        answer = json.loads(out)
        return answer["status"], answer["body"]

    def get(self, path: str, **kw) -> tuple[int, object]:
        return self.request("GET", path, **kw)

    def ready(self, timeout: float) -> dict:
        """Wait until /healthz answers 200 from the client host; return its body."""

        def healthy():
            status, body = self.get("/healthz")
            return body if status == 200 else None

        return wait_until(healthy, timeout, "the coordinator to be ready", lambda: self.tail())

    def finished(self, run_id: int, timeout: float) -> dict:
        """Wait until run `run_id` is no longer queued or running; return it."""

        def done():
            status, body = self.get(f"/runs/{run_id}")
            return body if status == 200 and body["status"] not in ("queued", "running") else None

        return wait_until(done, timeout, f"run {run_id} to finish", lambda: self.tail())


def _can_make_namespaces() -> str | None:
    """Why this machine cannot run the test, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    return None


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """The compose file's services, each replica on its own namespace host, not started yet."""
    reason = _can_make_namespaces()
    if reason:
        pytest.skip(reason)
    sweep_abandoned()
    tokens = {"RLX_WORKER_TOKEN": secrets.token_hex(16), "RLX_CLUSTER_TOKEN": secrets.token_hex(16)}
    # The model as compose would choose it: $RLX_MODEL when set (`RLX_MODEL=gemma3 make hosts`), else
    # the file's default.
    chosen = {MODEL_ENV: os.environ[MODEL_ENV]} if os.environ.get(MODEL_ENV) else {}
    services = load(COMPOSE_FILE, {**chosen, **tokens})
    net = Network()
    try:
        net.open()
        for service in services:
            for replica in service.replica_names():
                net.add(replica)
        for extra in ("client", "stranger"):
            net.add(extra)
        net.write_hosts_files({s.name: s.replica_names() for s in services})
        yield Deployment(net, services, tmp_path_factory.mktemp("hosts"), tokens)
    finally:
        net.close()
        alive = [p.args for p in net.procs if p.poll() is None]
        try:
            left = net.leftovers()
        except NetError as exc:
            left = [str(exc)]
        assert not alive and not left, f"left behind: processes {alive}, namespaces or files {left}"
