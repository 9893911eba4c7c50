"""What the runner and the pipeline tell the cluster's event bus, against real workers."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from coordinator.cluster import ClusterConfig, open_cluster
from coordinator.events import (
    Event,
    Lagged,
    NodeChanged,
    RunFinished,
    RunQueued,
    RunStarted,
    StageForward,
    Subscription,
    TokenGenerated,
)
from coordinator.runs.requests import RunRequest
from tests.support.tiny_chat import PROMPT, write_tiny_chat


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "tiny-chat.gguf"
    write_tiny_chat(path, context_length=256)
    return path


async def until(sub: Subscription, done: Callable[[Event], bool], timeout: float = 20) -> list[Event]:
    """The subscription's events up to and including the first that is `done`."""
    got: list[Event] = []
    async with asyncio.timeout(timeout):
        while not got or not done(got[-1]):
            event = await sub.get()
            assert event is not None, f"the subscription ended after {got}"
            got.append(event)
    return got


async def test_a_run_is_told_queued_started_stage_by_stage_and_finished_once_it_is_stored(cluster, tmp_path):
    db = tmp_path / "runs.sqlite3"
    opened = await cluster("fake:layers=6", 3, db=db)
    stored_when_told: list[str] = []

    def look_in_the_file(event: Event) -> bool:
        # Called as the event is published: the file must already hold the run's end.
        if isinstance(event, RunFinished):
            with sqlite3.connect(db) as conn:
                row = conn.execute("SELECT status FROM runs WHERE id = ?", (event.run,)).fetchone()
            stored_when_told.append(row[0])
        return True

    sub = opened.bus.subscribe(since=0, accept=look_in_the_file)
    run = await asyncio.wait_for(opened.runner.run(RunRequest(seq=5)), 20)
    events = await until(sub, lambda e: isinstance(e, RunFinished))
    assert [(e.stage, e.state) for e in events[:3]] == [(0, "up"), (1, "up"), (2, "up")]
    assert all(isinstance(e, NodeChanged) for e in events[:3])
    kinds = [type(e) for e in events[3:]]
    assert kinds == [RunQueued, RunStarted, StageForward, StageForward, StageForward, RunFinished]
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    forwards = events[5:8]
    assert [(e.run, e.step, e.stage, e.positions) for e in forwards] == [(run.id, 0, s, 5) for s in range(3)]
    assert [(e.addr, e.forward_ms, e.compute_ms) for e in forwards] == [
        (t.addr, t.forward_ms, t.compute_ms) for t in run.timings
    ]
    finished = events[-1]
    assert (finished.run, finished.status, finished.error) == (run.id, "ok", None)
    assert finished.total_ms == run.total_forward_ms and finished.generated_tokens == 0
    assert stored_when_told == ["ok"]


async def test_each_generated_token_is_told_with_the_stage_times_of_the_step_that_made_it(cluster, tiny_chat):
    opened = await cluster(str(tiny_chat), 2)
    sub = opened.bus.subscribe()
    run = await asyncio.wait_for(opened.runner.run(RunRequest(prompt=PROMPT, max_new_tokens=6)), 30)
    events = await until(sub, lambda e: isinstance(e, RunFinished))
    forwards = [e for e in events if isinstance(e, StageForward)]
    tokens = [e for e in events if isinstance(e, TokenGenerated)]
    assert run.status == "ok" and len(run.tokens) == 6
    steps = len(run.steps)
    assert [(e.step, e.stage) for e in forwards] == [(n, s) for n in range(steps) for s in range(2)]
    assert [e.positions for e in forwards] == [run.seq] * 2 + [1] * (2 * (steps - 1))
    assert [e.index for e in tokens] == list(range(6))
    assert [e.token for e in tokens] == run.tokens and "".join(e.text for e in tokens) == run.text
    for token in tokens:
        assert token.stage_ms == [e.forward_ms for e in forwards if e.step == token.index]
    # The record keeps the same numbers, step by step.
    by_step = [[e.forward_ms for e in forwards if e.step == n] for n in range(steps)]
    assert [s.forward_ms for s in run.steps] == by_step
    finished = events[-1]
    assert (finished.prompt_tokens, finished.generated_tokens) == (run.seq, 6)
    assert finished.total_ms == pytest.approx(run.total_forward_ms + run.decode.total_forward_ms)


async def test_a_subscriber_that_never_reads_does_not_slow_a_run_and_is_told_it_lagged(cluster, tiny_chat):
    opened = await cluster(str(tiny_chat), 2)
    request = RunRequest(prompt=PROMPT, max_new_tokens=40)
    started = time.monotonic()
    alone = await asyncio.wait_for(opened.runner.run(request), 30)
    alone_s = time.monotonic() - started
    first = opened.bus.seq + 1
    stalled = opened.bus.subscribe(maxsize=4)
    started = time.monotonic()
    watched = await asyncio.wait_for(opened.runner.run(request), 30)
    watched_s = time.monotonic() - started
    assert watched.tokens == alone.tokens and len(watched.tokens) == 40
    # Generous for 2 shared cores: a publisher that waited on the stalled queue would never finish at all.
    assert watched_s < 3 * alone_s + 0.5, (alone_s, watched_s)
    published = opened.bus.seq - first + 1
    got = [await asyncio.wait_for(stalled.get(), 1) for _ in range(5)]
    assert [e.seq for e in got[:4]] == list(range(first, first + 4))
    assert isinstance(got[4], Lagged) and got[4].missed == published - 4


async def test_a_worker_that_dies_is_told_down_then_restarting_then_up(cluster):
    # Recovery off: each new worker would crash on its first forward too, the run's retry.
    opened = await cluster("fake:layers=4,crash_on=1,stage=0", 2, recover_timeout=0)
    sub = opened.bus.subscribe(accept=lambda e: isinstance(e, NodeChanged))
    run = await asyncio.wait_for(opened.runner.run(RunRequest(seq=2)), 20)
    assert run.status == "failed"
    events = await until(sub, lambda e: e.state == "up")
    assert [(e.stage, e.state) for e in events] == [(0, "down"), (0, "restarting"), (0, "up")]
    down = events[0]
    # Whichever saw it first names why: the process watcher, or the forward that lost the connection.
    assert down.error and ("exited with status" in down.error or down.error in run.error), down.error
    assert events[2].addr == opened.pipeline.nodes[0].report.addr and events[2].error is None


async def test_closing_the_cluster_ends_every_subscription():
    async with open_cluster(ClusterConfig("fake:layers=2", 1, build_timeout=60.0)) as opened:
        sub = opened.bus.subscribe(since=0)
    events = await asyncio.wait_for(_all(sub), 5)
    assert [type(e) for e in events] == [NodeChanged]


async def _all(sub: Subscription) -> list[Event]:
    return [event async for event in sub]
