"""The event bus: ordering, filtering, bounded subscribers, resuming from the ring buffer."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from coordinator.events import (
    KINDS,
    EventBus,
    Lagged,
    NodeChanged,
    RunFinished,
    RunQueued,
    RunStarted,
    TokenGenerated,
)


async def drain(sub, n: int) -> list:
    return [await asyncio.wait_for(sub.get(), 1.0) for _ in range(n)]


async def test_events_are_numbered_in_order_and_delivered_to_every_subscriber():
    bus = EventBus()
    a, b = bus.subscribe(), bus.subscribe()
    for run in (1, 2, 3):
        bus.publish(RunQueued(run=run))
    for sub in (a, b):
        got = await drain(sub, 3)
        assert [e.run for e in got] == [1, 2, 3]
        assert [e.seq for e in got] == [1, 2, 3]
        assert all(e.time > 0 for e in got)


async def test_a_filter_keeps_only_the_events_it_accepts():
    bus = EventBus()
    sub = bus.subscribe(accept=lambda e: getattr(e, "run", None) == 2)
    bus.publish(RunStarted(run=1))
    bus.publish(RunStarted(run=2))
    bus.publish(NodeChanged(stage=0, addr="a:1", state="down"))
    bus.publish(RunFinished(run=2, status="ok"))
    got = await drain(sub, 2)
    assert [(type(e).__name__, e.run) for e in got] == [("RunStarted", 2), ("RunFinished", 2)]


async def test_a_slow_subscriber_gets_one_lagged_event_with_the_count_it_missed_and_never_blocks_publishing():
    bus = EventBus()
    slow = bus.subscribe(maxsize=3)
    fast = bus.subscribe()
    for i in range(10):
        bus.publish(TokenGenerated(run=1, index=i, token=i, text="x"))
    got = await drain(slow, 4)
    assert [e.index for e in got[:3]] == [0, 1, 2]
    assert isinstance(got[3], Lagged) and got[3].missed == 7
    bus.publish(TokenGenerated(run=1, index=10, token=10, text="y"))
    assert (await drain(slow, 1))[0].index == 10
    assert [e.index for e in await drain(fast, 11)] == list(range(11))


def test_draining_takes_what_is_queued_then_the_lagged_count_without_waiting():
    bus = EventBus()
    sub = bus.subscribe(maxsize=2)
    assert sub.drain() == []
    for run in (1, 2, 3, 4):
        bus.publish(RunQueued(run=run))
    got = sub.drain()
    assert [e.run for e in got[:2]] == [1, 2] and isinstance(got[2], Lagged) and got[2].missed == 2
    assert sub.drain() == [] and bus.subscribers == 1
    sub.close()
    assert bus.subscribers == 0


def test_each_bus_numbers_its_events_under_an_epoch_of_its_own():
    epochs = {EventBus().epoch for _ in range(100)}
    assert len(epochs) == 100 and all(len(e) == 8 and int(e, 16) >= 0 for e in epochs)


async def test_resuming_replays_the_remembered_events_after_a_sequence_number():
    bus = EventBus(history=5)
    for run in range(1, 9):
        bus.publish(RunQueued(run=run))
    sub = bus.subscribe(since=6)
    assert [e.seq for e in await drain(sub, 2)] == [7, 8]
    with pytest.raises(LookupError, match="too old to resume"):
        bus.subscribe(since=1)
    with pytest.raises(LookupError, match="does not exist"):
        bus.subscribe(since=99)


async def test_closing_the_bus_ends_every_subscription_after_what_is_queued():
    bus = EventBus()
    sub = bus.subscribe()
    bus.publish(RunStarted(run=1))
    waiter = asyncio.ensure_future(asyncio.wait_for(_collect(sub), 1.0))
    await asyncio.sleep(0)
    bus.close()
    assert [e.run for e in await waiter] == [1]
    bus.publish(RunStarted(run=2))  # nobody is listening any more; publishing still works
    assert bus.seq == 2


async def _collect(sub) -> list:
    return [event async for event in sub]


def test_every_event_kind_encodes_to_json_with_its_kind_tag():
    encoded = msgspec.json.decode(
        msgspec.json.encode(NodeChanged(stage=1, addr="h:1", state="failed", seq=4))
    )
    assert encoded["kind"] == "node" and encoded["state"] == "failed" and encoded["seq"] == 4
    assert set(KINDS) == {
        "run_queued",
        "run_started",
        "run_finished",
        "stage_forward",
        "token",
        "node",
        "run_recovering",
        "run_recovered",
        "lagged",
    }
