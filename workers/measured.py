"""What a joining worker measures of its own host before it is given layers: its layer costs, kept.

A worker times its layers where it runs, in the precision and threads it will
serve with (`workers.calibrate.measure_sampled`: a middle layer, a run of
middle layers and the last, for less than half a full per-layer pass), and
keeps the result in a file on this host, under a key of everything the
timing depends on: the CPU model, the cores it may run on, its cgroup's CPU
quota, the model file's fingerprint, the precision, the threads (the
variables that size a worker's compute) and how calibrate times a layer. The
next join with the same key reads the file instead of measuring; a changed
quota, thread count or model file is another key, measured afresh.

The files live in $RLX_CALIBRATION_DIR, else ~/.cache/rlx-cluster/calibration.
One that cannot be read or written is logged and the layers measured: a cache
never keeps a worker from joining.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

import msgspec

from workers import calibrate
from workers.calibrate import Costs
from workers.fake import FakeModel
from workers.models import parse
from workers.models.footprint import fingerprint

log = logging.getLogger("workers.measured")

CACHE_ENV = "RLX_CALIBRATION_DIR"
KEPT = "sampled, kept on this host"
FAKE_LAYER_MS = 0.001
CGROUP_ROOT = Path("/sys/fs/cgroup")
# The variables that size a worker's compute (as coordinator.plan.cost_cache reads them).
COMPUTE_VARS = ("RLX_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                "NUMBA_NUM_THREADS", "NUMBA_THREADING_LAYER")  # fmt: skip


class Kept(msgspec.Struct, frozen=True):
    """A cache file: the key it was measured under (to tell a hash collision) and the costs."""

    key: dict[str, str]
    costs: Costs


def cache_dir() -> Path:
    """Where this host keeps its measured costs."""
    given = os.environ.get(CACHE_ENV, "")
    return Path(given) if given else Path.home() / ".cache" / "rlx-cluster" / "calibration"


def cpu_model() -> str:
    """The CPU's model name, as /proc/cpuinfo says it ("" where it does not)."""
    with suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return ""


def cpu_quota() -> str:
    """This process's cgroup CPU quota: v2 `cpu.max` ("max 100000": none), else v1's quota and period."""
    with suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, group = line.split(":", 2)
            group = group.strip().lstrip("/")
            if controllers == "" and (CGROUP_ROOT / group / "cpu.max").exists():
                return (CGROUP_ROOT / group / "cpu.max").read_text().strip()
            if "cpu" in controllers.split(","):
                v1 = CGROUP_ROOT / controllers / group
                quota, period = (v1 / "cpu.cfs_quota_us").read_text(), (v1 / "cpu.cfs_period_us").read_text()
                return f"{quota.strip()} {period.strip()}"
    return ""


def cpu_share() -> float:
    """The cores this process's cgroup CPU quota allows (quota over period); 0.0 without a quota."""
    quota, _, period = cpu_quota().partition(" ")
    try:
        share = int(quota) / int(period)
    except (ValueError, ZeroDivisionError):  # no quota: "" (none read), "max" (v2), or a malformed file
        return 0.0
    return max(share, 0.0)  # v1 writes -1 for no quota


def memory_available() -> int:
    """Bytes this worker can use: MemAvailable, or what its cgroup's limit leaves when that is less."""
    found = []
    with suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    with suppress(OSError, ValueError, IndexError):
        # cgroup v2: "0::/path" names our group; a container sees its own group as "/".
        group = Path("/proc/self/cgroup").read_text().split("::", 1)[1].strip().lstrip("/")
        limit = (CGROUP_ROOT / group / "memory.max").read_text().strip()
        if limit != "max":
            found.append(max(0, int(limit) - int((CGROUP_ROOT / group / "memory.current").read_text())))
    return min(found, default=0)


def cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def host_key(spec: str, precision: str) -> dict[str, str]:
    """Everything a layer's measured cost depends on, on this host."""
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    print_ = fingerprint(spec)
    return {
        "cpu": cpu_model(),
        "cores": ",".join(str(c) for c in sorted(cores)),
        "quota": cpu_quota(),
        "model": f"{print_.kind}:{print_.name}:{print_.size}:{print_.head_sha256}",
        "precision": precision,
        "threads": ";".join(f"{v}={os.environ.get(v, '')}" for v in COMPUTE_VARS),
        "method": f"sampled-{calibrate.METHOD}",
    }


def own_costs(
    spec: str, precision: str, measure: Callable[[str, str], Costs] = calibrate.measure_sampled
) -> tuple[Costs, str]:
    """This host's costs of `spec`'s layers in `precision`, and how it has them (sampled, kept, declared)."""
    model = parse(spec)
    if isinstance(model, FakeModel):
        # A fake's forward sleeps (which a calibration's CPU-bound timing does not count) and counts
        # forwards for its crash knobs: its cost is what its spec declares, a delay a forward, and a
        # microsecond a layer (an affine map of a few floats), so that equal hosts tie to an even split.
        layers = [FAKE_LAYER_MS] * model.layers
        return Costs(layers=layers, precision=precision, stage_ms=model.delay_ms), "declared"
    key = host_key(spec, precision)
    digest = hashlib.sha256(msgspec.json.encode(key)).hexdigest()[:32]
    path = cache_dir() / f"{digest}.json"
    try:
        kept = msgspec.json.decode(path.read_bytes(), type=Kept)
        if kept.key == key:
            return kept.costs, KEPT
    except FileNotFoundError:
        pass
    except (OSError, msgspec.DecodeError) as exc:
        log.warning("measuring the layers again: cannot read the kept costs %s: %s", path, exc)
    costs = measure(spec, precision)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_bytes(msgspec.json.encode(Kept(key=key, costs=costs)))
        partial.replace(path)  # whole or not at all, beside another worker reading it
    except OSError as exc:
        log.warning("cannot keep the measured costs in %s: %s", path, exc)
    return costs, "sampled"
