"""A node's state changes in one place, Node.set, which tells the bus once, with the whole change."""

from __future__ import annotations

import asyncio
import time

import pytest

from coordinator.events import EventBus, NodeChanged
from coordinator.stages.node import Node, RestartPolicy
from workers.protocol.report import LayerRange, NodeReport

REPORT = NodeReport(
    addr="127.0.0.1:40123", layers=LayerRange(2, 4), device="cpu", precision="f32",
    build_ms=5, resident_bytes=1, n_params=1,
)  # fmt: skip


def published(bus: EventBus) -> list[tuple]:
    """What the bus was told, as (stage, addr, state, error)."""
    return [(e.stage, e.addr, e.state, e.error) for e in bus.after(0) if isinstance(e, NodeChanged)]


@pytest.mark.parametrize(
    ("policy", "says"),
    [
        ({"budget": -1}, "restart budget must be an integer >= 0, got -1"),
        ({"window_s": 0}, "restart window must be a finite number of seconds > 0, got 0"),
        ({"window_s": float("nan")}, "restart window"),
        ({"backoff_s": ()}, "restart backoff must be one or more finite seconds >= 0, got ()"),
        ({"backoff_s": (1.0, -2.0)}, "got (1.0, -2.0)"),
    ],
)
def test_a_restart_policy_that_makes_no_sense_is_refused_naming_the_value(policy, says):
    with pytest.raises(ValueError) as refused:
        RestartPolicy(**policy)
    assert says in str(refused.value)


def test_a_node_publishes_its_state_once_it_is_told_where():
    bus = EventBus()
    node = Node(1, LayerRange(2, 4), REPORT)
    node.set("down", "before anyone listened")
    assert published(bus) == []
    node.publish_to(bus)
    assert published(bus) == [(1, "127.0.0.1:40123", "down", "before anyone listened")]


def test_set_publishes_one_event_with_the_new_state_and_its_error_together():
    bus = EventBus()
    node = Node(1, LayerRange(2, 4), REPORT)
    node.publish_to(bus)
    node.set("down", "worker process 7 exited with status -9")
    assert (node.state, node.error) == ("down", "worker process 7 exited with status -9")
    assert published(bus)[1:] == [(1, "127.0.0.1:40123", "down", "worker process 7 exited with status -9")]
    node.set("up")
    assert node.error is None
    assert published(bus)[2:] == [(1, "127.0.0.1:40123", "up", None)]


def test_setting_the_state_a_node_already_has_publishes_nothing_but_keeps_the_new_error():
    bus = EventBus()
    node = Node(0, LayerRange(0, 2), state="vacant")
    node.publish_to(bus)
    node.set("vacant")
    node.set("vacant", "waiting for workers to join: 1 of 2 have joined")
    assert published(bus) == [(0, "", "vacant", None)]
    assert node.error == "waiting for workers to join: 1 of 2 have joined"


def test_a_node_without_a_bus_changes_state_quietly():
    node = Node(0, LayerRange(0, 2))
    node.set("failed", "out of automatic restarts")
    assert (node.state, node.error) == ("failed", "out of automatic restarts")


def test_a_node_is_named_by_its_stage_its_address_when_held_and_its_layers():
    assert Node(1, LayerRange(2, 4), REPORT).name == "stage 1 (127.0.0.1:40123, layers 2..4)"
    assert Node(0, LayerRange(0, 2), state="vacant").name == "stage 0 (layers 0..2)"


def test_restarts_in_window_counts_only_the_restarts_of_the_last_window():
    node = Node(0, LayerRange(0, 2), policy=RestartPolicy(window_s=10.0))
    now = time.monotonic()
    node.restart_times.extend([now - 30.0, now - 11.0, now - 5.0, now])
    assert node.restarts_in_window == 2
    assert list(node.restart_times) == [now - 5.0, now]  # the forgotten ones are gone for good


async def test_a_wait_for_the_nodes_change_ends_when_its_state_changes_not_at_its_timeout():
    node = Node(1, LayerRange(2, 4), REPORT, state="down")
    waiting = [asyncio.create_task(node.changed(3600)) for _ in range(2)]
    await asyncio.sleep(0)
    node.set("down", "the same state again")  # no change: nobody is woken
    await asyncio.sleep(0)
    assert not any(w.done() for w in waiting)
    node.set("up")
    async with asyncio.timeout(5):
        await asyncio.gather(*waiting)
    # The change is spent: a later wait waits for the next one, and ends at its timeout without it.
    async with asyncio.timeout(5):
        await node.changed(0.01)
    assert node.state == "up"
