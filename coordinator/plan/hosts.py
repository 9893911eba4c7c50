"""Hosts a plan may use, and what each layer costs on each: from a hosts file, or (later) measured joiners.

A host is what the planner needs of a machine: how fast it computes a model's
layers (a speed relative to this machine, which turns the cost model's bytes
and FLOPs into time through this machine's rates, or per-layer decode times
measured on it by `python -m workers.calibrate`), how much memory it gives its
stage, and its link to the coordinator (every hop goes through the
coordinator, so a link is a host's round trip and bandwidth to it). A joined
worker that measures itself and its link fits the same fields.

The file is TOML:

    [model]             # optional: the model's shape when it is not on this machine
    name = "llama-70b"
    layers = 80
    hidden = 8192
    heads = 64
    kv_heads = 8
    ffn = 28672
    vocab = 128256
    quant = "Q4_K_M"

    [reference]         # optional: this machine's rates, one worker (defaults below)
    decode_gbps = 12.0
    prefill_gflops = 90.0

    [[hosts]]
    name = "desktop"
    cores = 8
    memory = "16GB"     # or a number of bytes
    speed = 1.0         # relative to this machine; or costs = "FILE.json" measured there
    latency_ms = 0.3    # round trip to the coordinator
    bandwidth_mbps = 1000
    count = 1           # several alike, named desktop-1..N; latency_ms = [LOW, HIGH] spreads them
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from coordinator.plan.costmodel import CONTEXT, CostModelError, ModelShape, from_numbers, from_spec
from workers.calibrate import Costs

# This machine's rates for one worker (one kernel thread), from Gemma 3 270M Q4_K_M here (README):
# its 178 MB head read at 12.3 GB/s at decode, and a 110-token prompt at 171 tokens/s of 0.54 GFLOP each.
DECODE_GBPS = 12.0
PREFILL_GFLOPS = 90.0
# What a forward costs a stage beyond its layers (calibration measures ~0.1 ms here).
STAGE_MS = 0.1
UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20,
         "GIB": 2**30, "TIB": 2**40}  # fmt: skip
HOST_FIELDS = ("name", "cores", "memory", "speed", "costs", "latency_ms", "bandwidth_mbps", "count")


class HostsError(ValueError):
    """A hosts file that cannot be planned with; the message names the host and field."""


@dataclass(frozen=True)
class Reference:
    """This machine's rates, which a host's speed scales: weight bytes read and FLOPs per second."""

    decode_gbps: float = DECODE_GBPS
    prefill_gflops: float = PREFILL_GFLOPS
    stage_ms: float = STAGE_MS


@dataclass(frozen=True)
class LayerCosts:
    """What each layer costs on one host: ms per forward whatever its rows, and ms per row.

    A decode step of one row through layer l costs weights_ms[l] + row_ms[l]; a
    stage costs stage_ms beyond its layers.
    """

    weights_ms: tuple[float, ...]
    row_ms: tuple[float, ...]
    stage_ms: float

    def range_ms(self, start: int, end: int, rows: int) -> float:
        """A forward of `rows` rows through a stage of layers start..end."""
        return self.stage_ms + sum(self.weights_ms[start:end]) + rows * sum(self.row_ms[start:end])


@dataclass(frozen=True)
class Host:
    """A machine that may serve a stage.

    cores: its cores (shown; its speed says how fast a worker computes with them).
    memory_bytes: what it can give its stage.
    speed: how fast it computes relative to this machine (2.0: in half the time).
    measured: per-layer decode ms measured on it, used instead of speed × this machine's.
    latency_ms: the round trip of its link to the coordinator.
    bandwidth: its link's bytes per second.
    cpu_share: the cores a CPU quota allows it (a cgroup's quota over its period), 0 for none: its
        costs are then what a step costs unthrottled, and the quota holds a stage to that share of
        the time (a stage that computes 4 ms a step at 0.4 core takes at least 10 ms a step).
    """

    name: str
    cores: int
    memory_bytes: int
    speed: float = 1.0
    measured: Costs | None = None
    latency_ms: float = 0.0
    bandwidth: float = 125e6
    cpu_share: float = 0.0

    def costs(self, shape: ModelShape, ref: Reference, context: int = CONTEXT) -> LayerCosts:
        """Each layer's costs on this host: measured ones split as the cost model splits them, else scaled."""
        weights = [b / (ref.decode_gbps * 1e9) * 1e3 / self.speed for b in shape.weight_bytes()]
        rows = [f / (ref.prefill_gflops * 1e9) * 1e3 / self.speed for f in shape.row_flops(context)]
        if self.measured is None:
            return LayerCosts(tuple(weights), tuple(rows), ref.stage_ms / self.speed)
        if len(self.measured.layers) != shape.n_layers:
            raise HostsError(
                f"host {self.name!r}: costs: {len(self.measured.layers)} layers measured, "
                f"the model has {shape.n_layers}"
            )
        # A measured decode step is both parts at once: shared out as the cost model has them.
        share = [r / (w + r) for w, r in zip(weights, rows, strict=True)]
        ms = self.measured.layers
        weights_ms = tuple(m * (1 - s) for m, s in zip(ms, share, strict=True))
        return LayerCosts(
            weights_ms, tuple(m * s for m, s in zip(ms, share, strict=True)), self.measured.stage_ms
        )


@dataclass(frozen=True)
class HostsFile:
    """A hosts file read: its hosts, the model it names (None: the command's --model) and rates."""

    hosts: list[Host]
    model: ModelShape | None = None
    reference: Reference = field(default_factory=Reference)


def load_hosts(path: str | Path) -> HostsFile:
    """Read and check a hosts file; a HostsError naming the file, host and field for anything wrong."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise HostsError(f"{path}: cannot read the hosts file ({exc.strerror or exc})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise HostsError(f"{path}: not a TOML file: {exc}") from None
    unknown = sorted(set(data) - {"model", "reference", "hosts"})
    if unknown:
        raise HostsError(f"{path}: unknown table(s) {', '.join(unknown)}; known: model, reference, hosts")
    rows = data.get("hosts")
    if not isinstance(rows, list) or not rows:
        raise HostsError(f"{path}: no [[hosts]]: give at least one")
    hosts = [h for i, row in enumerate(rows) for h in _hosts(path, i, row)]
    names = [h.name for h in hosts]
    if dupes := sorted({n for n in names if names.count(n) > 1}):
        raise HostsError(f"{path}: host names must differ; given twice: {', '.join(dupes)}")
    model = None
    if "model" in data:
        try:
            model = from_numbers(str(data["model"].get("name", "model")), dict(data["model"]))
        except (CostModelError, AttributeError, TypeError) as exc:
            raise HostsError(f"{path}: [model]: {exc}") from None
    return HostsFile(hosts, model, _reference(path, data.get("reference", {})))


def model_shape(hosts: HostsFile, spec: str | None) -> ModelShape:
    """The shape to plan: the hosts file's [model], else the GGUF file `spec` names."""
    if hosts.model is not None:
        return hosts.model
    if not spec:
        raise HostsError("the hosts file has no [model] and no --model was given: nothing to plan")
    return from_spec(spec)


def _reference(path: Path, table: dict) -> Reference:
    unknown = sorted(set(table) - {"decode_gbps", "prefill_gflops", "stage_ms"})
    if unknown:
        raise HostsError(f"{path}: [reference]: unknown field(s) {', '.join(unknown)}")
    values = {k: _positive(path, "[reference]", k, v, zero=k == "stage_ms") for k, v in table.items()}
    return Reference(**values)


def _hosts(path: Path, index: int, row: dict) -> list[Host]:
    """The host (or hosts, with count) a [[hosts]] entry describes."""
    name = row.get("name") if isinstance(row, dict) else None
    if not isinstance(name, str) or not re.fullmatch(r"[\w.@:-]+", name):
        raise HostsError(
            f"{path}: hosts[{index}]: name must be a word (letters, digits, .-_@:), got {name!r}"
        )
    where = f"host {name!r}"
    if unknown := sorted(set(row) - set(HOST_FIELDS)):
        raise HostsError(
            f"{path}: {where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(HOST_FIELDS)}"
        )
    for needed in ("cores", "memory", "bandwidth_mbps"):
        if needed not in row:
            raise HostsError(f"{path}: {where}: {needed} is missing")
    if ("speed" in row) == ("costs" in row):
        raise HostsError(
            f"{path}: {where}: give speed (relative to this machine) or costs (a file), one of them"
        )
    count = _whole(path, where, "count", row.get("count", 1))
    cores = _whole(path, where, "cores", row["cores"])
    memory = _memory(path, where, row["memory"])
    bandwidth = _positive(path, where, "bandwidth_mbps", row["bandwidth_mbps"]) * 1e6 / 8
    latency = row.get("latency_ms", 0.0)
    lows = latency if isinstance(latency, list) else [latency, latency]
    if len(lows) != 2:
        raise HostsError(f"{path}: {where}: latency_ms must be ms or [LOW, HIGH], got {latency!r}")
    low, high = (_positive(path, where, "latency_ms", v, zero=True) for v in lows)
    speed = _positive(path, where, "speed", row["speed"]) if "speed" in row else 1.0
    measured = _costs(path, where, row["costs"]) if "costs" in row else None
    return [
        Host(name if count == 1 else f"{name}-{i + 1}", cores, memory, speed, measured,
             low + (high - low) * (i / (count - 1) if count > 1 else 0.0), bandwidth)
        for i in range(count)
    ]  # fmt: skip


def _costs(path: Path, where: str, value: object) -> Costs:
    """Per-layer costs measured on a host: the JSON line `python -m workers.calibrate` prints."""
    if not isinstance(value, str):
        raise HostsError(f"{path}: {where}: costs must name a file, got {value!r}")
    file = path.parent / value
    try:
        costs = msgspec.json.decode(file.read_bytes().strip().splitlines()[-1], type=Costs)
    except (OSError, IndexError) as exc:
        raise HostsError(f"{path}: {where}: costs: cannot read {file} ({exc})") from None
    except msgspec.DecodeError as exc:
        raise HostsError(
            f"{path}: {where}: costs: {file} is not what workers.calibrate prints: {exc}"
        ) from None
    if not costs.layers or not all(math.isfinite(c) and c >= 0 for c in costs.layers):
        raise HostsError(f"{path}: {where}: costs: {file} has no layers, or a cost below 0 or not finite")
    return costs


def _memory(path: Path, where: str, value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value) if isinstance(value, str) else None
    if m is None or m.group(2).upper() not in UNITS or float(m.group(1)) <= 0:
        raise HostsError(f'{path}: {where}: memory must be bytes or a size such as "16GB", got {value!r}')
    return int(float(m.group(1)) * UNITS[m.group(2).upper()])


def _whole(path: Path, where: str, name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise HostsError(f"{path}: {where}: {name} must be a whole number >= 1, got {value!r}")
    return value


def _positive(path: Path, where: str, name: str, value: object, zero: bool = False) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not zero):
        raise HostsError(f"{path}: {where}: {name} must be a number {'>=' if zero else '>'} 0, got {value!r}")
    return float(value)
