"""Coordinators and joiners on namespace hosts that differ (a CPU quota, a narrow link), timed as served.

`rehearsal_hosts` makes, for each of a few sets, a coordinator's host and
three joiners' hosts: "fast" (as this machine is), "quota" (held to 40% of a
core by a cgroup) and "narrow" (behind a 100 Mbit/s tbf), plus one client
host for all. `serve` starts a set's coordinator with a join plan and its
joiners in a given order, each waiting for the one before to have joined
(the even split goes in join order); `decode` times generations through the
sets' APIs from the client host, one run on each set in turn, so load that
comes and goes on this machine falls on every set alike; `stop` ends them.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.hosts.limits import CpuQuota, groups_of, narrow_link, sweep_abandoned_groups
from tests.hosts.netns import NetError, Network, stop, sweep_abandoned, wait_until
from workers.models import packages

VENV_BIN = Path(sys.executable).parent
CLIENT_SCRIPT = Path(__file__).with_name("client.py")
DECODE_SCRIPT = Path(__file__).with_name("decode_client.py")
# `ip netns exec` mounts a sysfs of the namespace's own over /sys, which holds no cgroups: a worker there
# could not read its CPU quota. Mounted again inside the command's own mount namespace (ip made it
# private), the cpu controller shows the worker its group, as a container's /sys/fs/cgroup does.
CGROUP_MOUNT = ("mount -t tmpfs cgroups /sys/fs/cgroup && mkdir /sys/fs/cgroup/cpu && "
                'mount -t cgroup -o cpu cgroup /sys/fs/cgroup/cpu && exec "$@"')  # fmt: skip
JOINERS = ("fast", "quota", "narrow")  # the roles of a set's joiner hosts, named ROLE-SET
QUOTA_US = 40_000  # of a 100,000 us period: 40% of one core
NARROW_MBIT = 100
JOIN_PORT = 8471
API_PORT = 8470
CLIENT_TIMEOUT_S = 60.0
# A joiner measures its layers before it offers them (SmolLM2 sampled: ~6 s of CPU, ~15 s at 40% of a core).
JOIN_TIMEOUT_S = 120.0
READY_TIMEOUT_S = 180.0  # three stages built at once on two busy cores
RUN_TIMEOUT_S = 120.0
LOG_TAIL = 20


@dataclass
class Case:
    """One placement of the joiners, timed: what it predicted and what its runs measured.

    plan: the coordinator's --join-plan.
    tag: the set of hosts it ran on.
    how: how the first plan was made, as /nodes says it (its prediction within).
    stages: per stage, the role of the host serving it and its layers.
    tokens_per_s: each timed run's decode tokens/s.
    stage_ms: each timed run's per-stage decode ms a token (forward_ms over its tokens).
    """

    plan: str
    tag: str = ""
    how: str = ""
    stages: list[tuple[str, str]] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    stage_ms: list[list[float]] = field(default_factory=list)
    compute_ms: list[list[float]] = field(default_factory=list)
    members: list[dict] = field(default_factory=list)
    throttled_ms: float = 0.0

    def measured_stage_ms(self) -> float:
        """The median over the runs of the stages' part of a step (Σ forward_ms a token)."""
        return statistics.median(sum(run) for run in self.stage_ms)

    def predicted_ms(self) -> float:
        """The decode step the plan predicted, from its `how`."""
        return float(self.how.split("predicted ")[1].split(" ms")[0])

    def measured_ms(self) -> float:
        """The median decode step measured (ms a token)."""
        return 1000 / statistics.median(self.tokens_per_s)

    def median_stage_ms(self) -> list[float]:
        """Per stage, the median over the runs of its ms a token."""
        return [statistics.median(run[i] for run in self.stage_ms) for i in range(len(self.stages))]

    def summary(self) -> dict:
        """The case as the closing note gives it."""
        stage_ms = self.median_stage_ms()
        return {"plan": self.plan, "stages": self.stages, "predicted_ms": round(self.predicted_ms(), 2),
                "measured_ms": round(self.measured_ms(), 2),
                "measured_stages_ms": round(self.measured_stage_ms(), 2),
                "compute_ms": [round(statistics.median(r[i] for r in self.compute_ms), 2)
                               for i in range(len(self.stages))],
                "tokens_per_s": round(statistics.median(self.tokens_per_s), 1),
                "stage_ms": [round(ms, 2) for ms in stage_ms], "throttled_ms": round(self.throttled_ms),
                "slowest_over_mean": round(max(stage_ms) / statistics.mean(stage_ms), 3),
                "links": [m["link"] for m in self.members],
                "speeds": [(m["speed"] or {}).get("decode_ms") for m in self.members]}  # fmt: skip


class Rehearsal:
    """Namespace hosts for a coordinator, a client and joiners, and the processes started on them."""

    def __init__(self, net: Network, workdir: Path, quotas: dict[str, CpuQuota]) -> None:
        self.net, self.workdir, self.quotas = net, workdir, quotas
        self.tokens = {"RLX_WORKER_TOKEN": os.urandom(16).hex(), "RLX_CLUSTER_TOKEN": os.urandom(16).hex()}
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = {
            "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', os.defpath)}",
            "HOME": str(workdir / "home"),
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
            "RLX_MODEL_CACHE": str(packages.cache_dir()),
            # Kept measurements: each host measures once for the module, every later join reads them.
            "RLX_CALIBRATION_DIR": str(workdir / "calibration"),
            # One kernel thread a worker: three workers and a coordinator share two cores.
            "RLX_THREADS": "1",
            **self.tokens,
        }
        (workdir / "home").mkdir(parents=True, exist_ok=True)
        (workdir / "logs").mkdir(parents=True, exist_ok=True)

    def log(self, host: str) -> Path:
        return self.workdir / "logs" / f"{host}.log"

    def tail(self, *hosts: str) -> str:
        parts = []
        for host in hosts or tuple(self.procs):
            path = self.log(host)
            lines = path.read_text(errors="replace").splitlines()[-LOG_TAIL:] if path.exists() else []
            parts.append(f"\n--- {host} ---\n" + "\n".join(lines))
        return "".join(parts)

    def start(self, host: str, argv: list[str]) -> subprocess.Popen:
        """Start `argv` on `host`, in its cgroup when it has one, the cgroups mounted where it looks."""
        argv = ["sh", "-c", CGROUP_MOUNT, "sh", *argv]
        proc = self.net.popen(self.net.hosts[host], argv, self.env, self.log(host))
        if host in self.quotas:
            # `ip netns exec` and sh exec the command in place: this pid becomes the worker, which forks
            # nothing while it imports, so everything it starts is in the group too.
            self.quotas[host].add(proc.pid)
        self.procs[host] = proc
        return proc

    def request(self, tag: str, method: str, path: str, body: object = None) -> tuple[int, object]:
        """One request to set `tag`'s coordinator's API from the client host."""
        url = f"http://coordinator-{tag}:{API_PORT}{path}"
        argv = [sys.executable, "-I", str(CLIENT_SCRIPT), method, url]
        if body is not None:
            argv.append(json.dumps(body))
        code, out, err = self.net.run(self.net.hosts["client"], argv, self.env, CLIENT_TIMEOUT_S)
        if code != 0:
            raise AssertionError(f"client {method} {path} failed (exit {code}): {err.strip()}")
        answer = json.loads(out)
        return answer["status"], answer["body"]

    def joined(self, tag: str) -> dict:
        status, body = self.request(tag, "GET", "/nodes")
        return body.get("joined") or {} if status == 200 else {}

    def serve(self, tag: str, model: str, plan: str, order: list[str]) -> Case:
        """Set `tag`'s coordinator of `model` with `--join-plan plan`, its joiners started in `order`."""
        coordinator = f"coordinator-{tag}"
        self.start(coordinator, ["rlx-cluster", "serve", "--model", model, "--stages", str(len(order)),
                                 "--join", f"0.0.0.0:{JOIN_PORT}", "--http", f"0.0.0.0:{API_PORT}",
                                 "--db", ":memory:", "--join-plan", plan])  # fmt: skip
        wait_until(lambda: self.request(tag, "GET", "/nodes")[0] == 200, READY_TIMEOUT_S,
                   f"{coordinator}'s API", lambda: self.tail(coordinator))  # fmt: skip
        for count, role in enumerate(order, 1):
            host = f"{role}-{tag}"
            self.start(host, ["rlx-worker", "--join", f"{coordinator}:{JOIN_PORT}"])
            wait_until(lambda n=count: len(self.joined(tag).get("members", [])) >= n, JOIN_TIMEOUT_S,
                       f"{host} to join", lambda h=host: self.tail(coordinator, h))  # fmt: skip
        return Case(plan, tag)

    def ready(self, case: Case, order: list[str]) -> Case:
        """Wait until every stage of the case's set is up; fill in its plan."""
        tag = case.tag
        wait_until(lambda: self.request(tag, "GET", "/healthz")[0] == 200, READY_TIMEOUT_S,
                   f"every stage of set {tag} up", lambda: self.tail())  # fmt: skip
        joined = self.joined(tag)
        role_at = {self.net.hosts[f"{r}-{tag}"].addr: r for r in order}
        case.members = sorted(joined["members"], key=lambda m: m["stage"])
        _, nodes = self.request(tag, "GET", "/nodes")
        layers = {n["stage"]: f"{n['layers']['start']}..{n['layers']['end']}" for n in nodes["nodes"]}
        case.how = joined["placement"]
        case.stages = [(role_at[m["addr"].rpartition(":")[0]], layers[m["stage"]]) for m in case.members]
        return case

    def decode(self, cases: list[Case], prompt: str, tokens: int, runs: int) -> None:
        """Time `runs` generations of `tokens` tokens on each case's set (after one to warm up), in turn."""
        body = json.dumps({"prompt": prompt, "max_new_tokens": tokens})
        urls = [f"http://coordinator-{c.tag}:{API_PORT}" for c in cases]
        argv = [sys.executable, "-I", str(DECODE_SCRIPT), body, str(runs + 1), str(RUN_TIMEOUT_S), *urls]
        throttled = {name: quota.throttled_us() for name, quota in self.quotas.items()}
        limit = RUN_TIMEOUT_S * (runs + 1) * len(cases)
        code, out, err = self.net.run(self.net.hosts["client"], argv, self.env, limit)
        assert code == 0, f"the decode client failed (exit {code}): {err.strip()}{self.tail()}"
        timed = json.loads(out)
        for case, runs_of in zip(cases, timed, strict=True):
            assert all(r["status"] == "ok" for r in runs_of), f"{runs_of}{self.tail()}"
            quota = self.quotas[f"quota-{case.tag}"]
            case.throttled_ms = (quota.throttled_us() - throttled[f"quota-{case.tag}"]) / 1000
            for run in runs_of[1:]:  # the first warms the workers' caches and the links up
                case.tokens_per_s.append(run["tokens_per_s"])
                case.stage_ms.append(run["forward_ms"])
                case.compute_ms.append(run["compute_ms"])

    def stop(self) -> None:
        """Stop the joiners, then the coordinators."""
        for host in sorted(self.procs, key=lambda h: h.startswith("coordinator")):
            stop(self.procs.pop(host))


def _cannot() -> str | None:
    """Why this machine cannot make the hosts, or None."""
    if os.geteuid() != 0:
        return "network namespaces and cgroups need root"
    for tool in ("ip", "tc", "mount"):
        if shutil.which(tool) is None:
            return f"the `{tool}` command is not installed"
    if not (Path("/sys/fs/cgroup/cpu") / "cpu.cfs_quota_us").exists():
        return "no cgroup v1 cpu controller at /sys/fs/cgroup/cpu"
    return None


@contextmanager
def rehearsal_hosts(workdir: Path, tags: tuple[str, ...]) -> Iterator[Rehearsal]:
    """The client's host and, for each set in `tags`, a coordinator's and three joiners' (see the module).

    Everything made is removed on the way out, pass or fail; what is left is a failure naming it. Where
    the hosts cannot be made the test is skipped, saying why, except under CI (which runs as root),
    where that fails it.
    """
    reason = _cannot()
    if reason:
        (pytest.fail if os.environ.get("CI") else pytest.skip)(reason)
    sweep_abandoned()
    sweep_abandoned_groups()
    net = Network()
    quotas: dict[str, CpuQuota] = {}
    try:
        net.open()
        net.add("client")
        for tag in tags:
            for role in ("coordinator", *JOINERS):
                net.add(f"{role}-{tag}")
            quotas[f"quota-{tag}"] = CpuQuota(net, f"quota-{tag}", QUOTA_US)
            narrow_link(net, net.hosts[f"narrow-{tag}"], NARROW_MBIT)
        net.write_hosts_files({})
        yield Rehearsal(net, workdir, quotas)
    finally:
        net.close()
        for quota in quotas.values():
            quota.close()
        alive = [p.args for p in net.procs if p.poll() is None]
        try:
            left = net.leftovers() + groups_of(net)
        except NetError as exc:
            left = [str(exc)]
        assert not alive and not left, f"left behind: processes {alive}, namespaces, files or groups {left}"
