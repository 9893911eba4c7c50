"""Hosts as Linux network namespaces on one private bridge, and the processes run inside them.

The bridge lives in a namespace of its own (the "switch"), so the root
namespace gets no link, address or route to the test subnet: every packet
between hosts stays among the namespaces made here. Each host has its own
address, loopback up, and an /etc/netns/<ns>/hosts file that `ip netns exec`
puts in place of /etc/hosts, so service names resolve as on a compose network.
`close()` kills every process in every namespace, deletes the namespaces (and
with them every link) and removes the hosts files, whatever state it finds.
A run killed before it could close is cleaned up by the next one
(`sweep_abandoned`): namespace names carry the pid of the process that made them.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

SUBNET = "10.231.9"  # a /24 that exists only inside this run's switch namespace
PREFIX = 24
FIRST_HOST = 2
NETNS_ETC = Path("/etc/netns")
IP_TIMEOUT = 10.0
STOP_GRACE = 5.0
# Found once, so a process given a bare environment is still started through ip.
IP = shutil.which("ip") or "ip"
TAG = re.compile(r"^rlx(\d+)x[0-9a-f]+-")


class NetError(Exception):
    """An `ip` command failed; the message carries its command line and stderr."""


def ip(*args: str, timeout: float = IP_TIMEOUT) -> str:
    """Run `ip ARGS...` and return its stdout."""
    try:
        done = subprocess.run([IP, *args], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise NetError(f"ip {' '.join(args)}: no answer in {timeout}s") from exc
    if done.returncode != 0:
        raise NetError(f"ip {' '.join(args)}: exit {done.returncode}: {done.stderr.strip()}")
    return done.stdout


@dataclass(frozen=True)
class Host:
    """One host: its name on the network, its namespace and its address."""

    name: str
    netns: str
    addr: str


class Network:
    """A bridge, the hosts on it, and the processes started in them."""

    def __init__(self) -> None:
        # Namespace names are global on the machine: the pid and a random part keep two runs apart.
        self.tag = f"rlx{os.getpid()}x{secrets.token_hex(2)}"
        self.switch = f"{self.tag}-switch"
        self.hosts: dict[str, Host] = {}
        self.procs: list[subprocess.Popen] = []
        self._namespaces: list[str] = []

    def open(self) -> None:
        """Make the switch namespace and its bridge."""
        self._add_netns(self.switch)
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")

    def add(self, name: str) -> Host:
        """Make a host: a namespace, its link to the bridge, an address, loopback up."""
        index = len(self.hosts)
        host = Host(name, f"{self.tag}-{name}", f"{SUBNET}.{FIRST_HOST + index}")
        self._add_netns(host.netns)
        port = f"p{index}"
        ip(
            "link",
            "add",
            "eth0",
            "netns",
            host.netns,
            "type",
            "veth",
            "peer",
            "name",
            port,
            "netns",
            self.switch,
        )
        ip("-n", self.switch, "link", "set", port, "master", "br0")
        ip("-n", self.switch, "link", "set", port, "up")
        ip("-n", host.netns, "addr", "add", f"{host.addr}/{PREFIX}", "dev", "eth0")
        ip("-n", host.netns, "link", "set", "eth0", "up")
        ip("-n", host.netns, "link", "set", "lo", "up")
        self.hosts[name] = host
        return host

    def write_hosts_files(self, aliases: Mapping[str, list[str]]) -> None:
        """Let every host resolve every host's name, plus each alias (a service name) to its hosts."""
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost"]
        lines += [f"{h.addr}\t{h.name}" for h in self.hosts.values()]
        lines += [f"{self.hosts[n].addr}\t{alias}" for alias, names in aliases.items() for n in names]
        for host in self.hosts.values():
            folder = NETNS_ETC / host.netns
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text("\n".join(lines) + "\n")

    def popen(self, host: Host, argv: list[str], env: Mapping[str, str], log: Path) -> subprocess.Popen:
        """Start `argv` inside `host`, its stdout and stderr appended to `log`."""
        with log.open("ab") as out:
            proc = subprocess.Popen(
                [IP, "netns", "exec", host.netns, *argv],
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def run(
        self, host: Host, argv: list[str], env: Mapping[str, str], timeout: float
    ) -> tuple[int, str, str]:
        """Run `argv` inside `host` to completion; return its status, stdout and stderr."""
        cmd = [IP, "netns", "exec", host.netns, *argv]
        done = subprocess.run(cmd, env=dict(env), capture_output=True, text=True, timeout=timeout)
        return done.returncode, done.stdout, done.stderr

    def close(self) -> None:
        """Stop every process, delete every namespace and hosts file made here."""
        for proc in self.procs:
            stop(proc)
        for netns in reversed(self._namespaces):
            _remove(netns)
        # /etc/netns may be shared with other runs: remove it only when nothing is left in it.
        with suppress(OSError):
            NETNS_ETC.rmdir()

    def leftovers(self) -> list[str]:
        """Namespaces and hosts folders of this network that still exist (empty after close)."""
        names = {line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()}
        left = [n for n in self._namespaces if n in names]
        return left + [str(NETNS_ETC / n) for n in self._namespaces if (NETNS_ETC / n).exists()]

    def _add_netns(self, netns: str) -> None:
        ip("netns", "add", netns)
        self._namespaces.append(netns)


def _kill_all_in(netns: str) -> None:
    """SIGKILL whatever still runs in `netns` (a child a process left behind)."""
    with suppress(NetError):
        for pid in ip("netns", "pids", netns).split():
            with suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def _remove(netns: str) -> None:
    """Kill what runs in `netns`, delete it and its hosts folder."""
    _kill_all_in(netns)
    with suppress(NetError):
        ip("netns", "delete", netns)
    folder = NETNS_ETC / netns
    with suppress(FileNotFoundError):
        (folder / "hosts").unlink()
    with suppress(FileNotFoundError):
        folder.rmdir()


def sweep_abandoned() -> list[str]:
    """Remove the namespaces of runs whose process is gone (killed before closing); name them."""
    swept = []
    for line in ip("netns", "list").splitlines():
        name = line.split()[0] if line.strip() else ""
        match = TAG.match(name)
        if match and not Path(f"/proc/{match[1]}").exists():
            _remove(name)
            swept.append(name)
    return swept


def stop(proc: subprocess.Popen, grace: float = STOP_GRACE) -> int | None:
    """Terminate, wait up to `grace`, kill, wait; return the exit status (None if it would not die)."""
    if proc.poll() is None:
        proc.terminate()
    try:
        return proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
    try:
        return proc.wait(grace)
    except subprocess.TimeoutExpired:
        return None


def wait_until(check, timeout: float, what: str, detail=lambda: ""):
    """Poll `check` until it returns something truthy; fail after `timeout` s with `detail()` appended."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}{detail()}")
        time.sleep(0.1)
