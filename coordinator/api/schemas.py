"""The shapes of the answers the API builds as plain dicts, as Structs, for /openapi.json to describe.

Each extends or names the Struct it is made from (a run view is a ClusterRun
and what follows from it), so no field is written twice; the schemathesis test
holds the live answers to these shapes.
"""

from __future__ import annotations

from typing import Any

import msgspec

from coordinator.cluster import Health as ClusterHealth
from coordinator.cluster import NodeState
from coordinator.stats import ClusterRun, ReduceKind, RunStatus
from workers.protocol.report import LayerRange


class Error(msgspec.Struct):
    """Every error outside /v1. error: what was wrong, and what to do when there is something to do."""

    error: str


class RunView(ClusterRun, kw_only=True):
    """A run as served: a ClusterRun (its output only with ?output=1) and what follows from it.

    critical_path_ms: the slowest stage's forward_ms.
    tokens_per_s: seq over the whole forward's seconds.
    reduce: resident GB over the stages, by each way of reducing.
    table: the monitor table.
    decode: a generation run's decode steps, served the same way.
    finish_reason: why a generation stopped: stop (an end token or a stop string), length
        (the token budget or the context) or cancelled; null for other runs.
    steps are not served here: /runs/{id}/trace draws them.
    """

    output: list[float] = msgspec.field(default_factory=list)
    decode: RunView | None = None
    critical_path_ms: float
    tokens_per_s: float
    reduce: dict[ReduceKind, float]
    table: str


class Cancelling(msgspec.Struct, kw_only=True):
    """A running run asked to stop that has not yet reached a forward boundary (its view comes along).

    id: the run's id. cancelling: true: read the run again for how it ended.
    """

    id: int
    cancelling: bool


class ChromeTrace(msgspec.Struct):
    """A run as Chrome trace events (JSON object format): Perfetto and chrome://tracing load it.

    traceEvents: one track per stage and one for the coordinator, slices in µs.
    displayTimeUnit: ms. otherData: the run, its clock, and what was left out.
    """

    traceEvents: list[dict[str, Any]]
    displayTimeUnit: str
    otherData: dict[str, Any]


class RunsPage(msgspec.Struct):
    """Runs, newest first. next_before: pass as ?before= for the next page (null on the last)."""

    runs: list[RunView]
    next_before: int | None


class RunAccepted(msgspec.Struct):
    """A run accepted: its id, status, where to read it (also the Location header) and the runs waiting."""

    id: int
    status: RunStatus
    location: str
    queued: int


class Reduced(msgspec.Struct):
    """A run's resident memory over its stages. kind: how it was reduced. resident_gb: GB (1e9 bytes)."""

    kind: ReduceKind
    resident_gb: float
    run: int


class NodeLive(msgspec.Struct, kw_only=True):
    """What a node's worker says of itself now (?live=1), or why it cannot say (error).

    kv_bytes: the bytes its sessions' KV caches hold (within resident_bytes); kv_session_bytes: by session.
    """

    resident_bytes: int | None = None
    sessions: int | None = None
    forwards: int | None = None
    kv_bytes: int | None = None
    kv_session_bytes: dict[str, int] | None = None
    error: str | None = None


class NodeStatus(msgspec.Struct, kw_only=True):
    """A node's place and state; while a worker holds it, its NodeReport's fields come with it.

    stage: its index. layers: the layers it holds. state: up, down, restarting,
    failed, vacant or building. restarts: restarts so far. error: why it went
    down. restarts_in_window: automatic restarts that count against its budget
    now. live: with ?live=1, what its worker says now.
    """

    stage: int
    layers: LayerRange
    state: NodeState
    restarts: int
    error: str | None
    restarts_in_window: int
    live: NodeLive | None = None


class NodesPage(msgspec.Struct, kw_only=True):
    """Every node in pipeline order; with workers that join, who has joined and what the plan lacks."""

    nodes: list[dict[str, Any]]
    joined: dict[str, Any] | None = None


class Health(ClusterHealth, kw_only=True):
    """Whether a run can go through now (503 when not, `error` and `reasons` saying why)."""

    error: str | None = None


class Live(msgspec.Struct):
    """The process serves."""

    ok: bool
