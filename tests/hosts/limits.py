"""Hosts that differ: a CPU quota by a cgroup (v1 `cpu` controller), a link narrowed by tc's tbf.

A `CpuQuota` is a folder /sys/fs/cgroup/cpu/<tag>-<name> whose cpu.cfs_quota_us
over cpu.cfs_period_us is the share of one core its processes get together; a
process is put in by writing its pid to cgroup.procs (a process `ip netns exec`
started is that pid itself: ip execs the command in place), before it forks
anything, so its children are in it too. `close()` kills what is left in it
and removes the folder once empty. Folder names carry the pid of the process
that made them, as netns's namespaces do, so `sweep_abandoned_groups` removes
those of a run killed before it could close.

`narrow_link` puts a token bucket (tbf) on both ends of a host's veth: its
eth0 (what the host sends) and its bridge port in the switch (what it is
sent). Deleting the namespaces deletes the veths and the qdiscs with them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from contextlib import suppress
from pathlib import Path

from tests.hosts.netns import TAG, Host, NetError, Network

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000
EMPTY_TIMEOUT_S = 10.0
TC_TIMEOUT_S = 10.0


class CpuQuota:
    """A cgroup whose processes share `quota_us` of CPU time per `period_us` (0.4 core: 40000/100000)."""

    def __init__(self, net: Network, name: str, quota_us: int, period_us: int = PERIOD_US) -> None:
        self.path = CPU_ROOT / f"{net.tag}-{name}"
        self.path.mkdir()
        (self.path / "cpu.cfs_period_us").write_text(str(period_us))
        (self.path / "cpu.cfs_quota_us").write_text(str(quota_us))
        self.share = quota_us / period_us

    def add(self, pid: int) -> None:
        """Move process `pid` into the group (its later children follow it)."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def pids(self) -> list[int]:
        """The processes in the group now."""
        with suppress(FileNotFoundError):
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        return []

    def throttled_us(self) -> int:
        """How long the kernel has held the group's processes back, in all (cpu.stat's throttled_time)."""
        for line in (self.path / "cpu.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "throttled_time":
                return int(value) // 1000
        return 0

    def close(self) -> None:
        """Kill what is left in the group and remove it (a cgroup folder goes only once empty)."""
        _remove_group(self.path)


def _remove_group(path: Path) -> None:
    deadline = time.monotonic() + EMPTY_TIMEOUT_S
    while path.exists():
        with suppress(FileNotFoundError):
            for pid in (path / "cgroup.procs").read_text().split():
                with suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        try:
            path.rmdir()
        except FileNotFoundError:
            return
        except OSError:  # busy: a killed process not yet reaped out of it
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def sweep_abandoned_groups() -> list[str]:
    """Remove the cgroups of runs whose process is gone (killed before closing); name them."""
    swept = []
    if not CPU_ROOT.is_dir():
        return swept
    for path in CPU_ROOT.iterdir():
        match = TAG.match(path.name)
        if path.is_dir() and match and not Path(f"/proc/{match[1]}").exists():
            _remove_group(path)
            swept.append(path.name)
    return swept


def groups_of(net: Network) -> list[str]:
    """The cgroups of this network that still exist (none after their close)."""
    if not CPU_ROOT.is_dir():
        return []
    return [p.name for p in CPU_ROOT.iterdir() if p.name.startswith(f"{net.tag}-")]


def tc(netns: str, *args: str) -> str:
    """Run `tc ARGS...` inside `netns`; a NetError with its stderr when it fails."""
    cmd = ["ip", "netns", "exec", netns, "tc", *args]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=TC_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise NetError(f"{' '.join(cmd)}: no answer in {TC_TIMEOUT_S}s") from exc
    if done.returncode != 0:
        raise NetError(f"{' '.join(cmd)}: exit {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def narrow_link(net: Network, host: Host, mbit: float, burst_kb: int = 32, latency_ms: int = 50) -> None:
    """Hold `host`'s link to `mbit` Mbit/s each way: a tbf on its eth0 and on its bridge port.

    burst: what the bucket lets through at once (at least a frame's worth, and what HZ needs at the
    rate); latency: how long a packet may wait for tokens before it is dropped (TCP sends it again).
    """
    port = f"p{list(net.hosts).index(host.name)}"
    shape = ["tbf", "rate", f"{mbit}mbit", "burst", f"{burst_kb}kb", "latency", f"{latency_ms}ms"]
    tc(host.netns, "qdisc", "add", "dev", "eth0", "root", *shape)
    tc(net.switch, "qdisc", "add", "dev", port, "root", *shape)
