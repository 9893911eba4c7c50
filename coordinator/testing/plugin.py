"""The pytest plugin: the `rlx_cluster` fixture, registered through the `pytest11` entry point.

Installing rlx-cluster makes the fixture available to any project's tests with no import.
Every cluster a test starts is stopped after it, pass or fail, in bounded time; a worker
that outlives its coordinator is killed and fails the test.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest

from coordinator.testing.cluster import DEFAULT_MODEL, READY_S, RlxCluster


class ClusterFactory:
    """Start clusters for one test: `rlx_cluster(model, stages, **options)`, or `await .astart(...)`."""

    def __init__(self) -> None:
        self.started: list[RlxCluster] = []

    def __call__(self, model: str = DEFAULT_MODEL, stages: int = 2, **options: object) -> RlxCluster:
        """Start a coordinator serving `model` on `stages` workers; see RlxCluster.start for the options."""
        ready = options.pop("ready", True)
        timeout = options.pop("ready_timeout", READY_S)
        cluster = RlxCluster.start(model, stages, ready=False, **options)
        self.started.append(cluster)
        return cluster.ready(timeout) if ready else cluster

    def launch(self, argv: Sequence[str], **options: object) -> RlxCluster:
        """Start `rlx-cluster ARGV` as written, returning at once; stopped after the test like the others."""
        cluster = RlxCluster.launch(argv, **options)
        self.started.append(cluster)
        return cluster

    async def astart(self, model: str = DEFAULT_MODEL, stages: int = 2, **options: object) -> RlxCluster:
        """Start a cluster without blocking the event loop while it comes up."""
        import asyncio  # an asyncio test's concern alone

        return await asyncio.to_thread(self, model, stages, **options)

    def stop_all(self) -> list[str]:
        """Stop every cluster started; one line per cluster whose workers outlived it."""
        leaks = []
        for cluster in self.started:
            leaked = cluster.stop()
            if leaked:
                leaks.append(
                    f"coordinator {cluster.pid} ({cluster.model}): worker pid(s) {leaked} outlived it"
                )
        return leaks


@pytest.fixture
def rlx_cluster() -> Iterator[ClusterFactory]:
    """Start real coordinators and their workers; all stopped, and checked for leaks, after the test."""
    factory = ClusterFactory()
    try:
        yield factory
    finally:
        leaks = factory.stop_all()
    if leaks:
        pytest.fail("a worker leaked (killed now):\n" + "\n".join(leaks), pytrace=False)
