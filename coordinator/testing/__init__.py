"""Fake clusters for integration tests: a real coordinator process and its workers, behind a handle.

`coordinator.testing.plugin` is the pytest plugin (the `rlx_cluster` fixture); the handle,
`RlxCluster`, works without pytest too.
"""

from coordinator.testing.cluster import DEFAULT_MODEL, Response, RlxCluster, Stage
from coordinator.testing.sse import SseEvent

__all__ = ["DEFAULT_MODEL", "Response", "RlxCluster", "SseEvent", "Stage"]
