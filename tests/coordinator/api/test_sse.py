"""GET /events: the event bus as server-sent events over real HTTP, against real workers."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from coordinator.api import events as sse
from coordinator.events import HISTORY, KINDS, RunStarted
from tests.conftest import eventually
from tests.coordinator.conftest import Api


class Stream:
    """One open /events response, read event by event; comment lines are kept aside."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.response = response
        self.comments: list[str] = []

    async def next(self, timeout: float = 10) -> dict | None:
        """The next event as {"event", "id", "data"} (data decoded), or None when the stream ended."""
        fields: dict = {}
        async with asyncio.timeout(timeout):
            async for raw in self.response.content:
                line = raw.decode().rstrip("\n")
                if line.startswith(":"):
                    self.comments.append(line)
                elif line:
                    name, _, value = line.partition(": ")
                    fields[name] = json.loads(value) if name == "data" else value
                elif fields:
                    return fields
        return None

    async def until(self, kind: str, timeout: float = 15) -> list[dict]:
        """The events up to and including the first of `kind`."""
        got: list[dict] = []
        while not got or got[-1]["event"] != kind:
            event = await self.next(timeout)
            assert event is not None, f"the stream ended after {got}"
            got.append(event)
        return got


@pytest.fixture
async def open_stream():
    """Open /events streams for a test and close them all afterwards."""
    opened: list[aiohttp.ClientResponse] = []

    async def _open(api: Api, query: str = "", **kw) -> Stream:
        response = await api.session.get(api.url("/events" + query), **kw)
        opened.append(response)
        assert response.status == 200, await response.text()
        assert response.content_type == "text/event-stream"
        return Stream(response)

    yield _open
    for response in opened:
        response.close()


def seq_of(event: dict) -> int:
    """The sequence number in an event's id (EPOCH-SEQ)."""
    return int(event["id"].rpartition("-")[2])


def event_id(api: Api, seq: int) -> str:
    """The id this coordinator gives its event `seq`."""
    return f"{api.cluster.bus.epoch}-{seq}"


async def post_run(api: Api, seq: int = 3) -> int:
    status, body, _ = await api.post("/runs", json={"seq": seq})
    assert status == 202, body
    return body["id"]


async def test_a_runs_events_arrive_in_order_each_with_its_kind_and_id(api, open_stream):
    stream = await open_stream(api)
    run = await post_run(api)
    got = await stream.until("run_finished")
    kinds = ["run_queued", "run_started", "stage_forward", "stage_forward", "run_finished"]
    assert [e["event"] for e in got] == kinds
    ids = [seq_of(e) for e in got]
    assert ids == list(range(ids[0], ids[0] + len(got)))
    assert all(e["id"] == event_id(api, e["data"]["seq"]) and e["data"]["kind"] == e["event"] for e in got)
    assert {e["data"]["run"] for e in got} == {run}
    stored = await api.finished(run)
    forwards = [e["data"]["forward_ms"] for e in got if e["event"] == "stage_forward"]
    assert forwards == [t["forward_ms"] for t in stored["timings"]]
    assert got[-1]["data"]["status"] == "ok"


async def test_filters_keep_one_runs_events_of_the_kinds_asked_for(api, open_stream):
    stream = await open_stream(api, "?run=2&kind=stage_forward,run_finished")
    await post_run(api)
    second = await post_run(api)
    got = await stream.until("run_finished")
    assert [(e["event"], e["data"]["run"]) for e in got] == [
        ("stage_forward", second), ("stage_forward", second), ("run_finished", second)
    ]  # fmt: skip


async def test_last_event_id_resumes_after_that_event_then_goes_on_live(api, open_stream):
    first = await post_run(api)
    await api.finished(first)
    # Events 1 and 2 are the two nodes coming up; the run's own begin at 3.
    stream = await open_stream(api, headers={"Last-Event-ID": event_id(api, 2)})
    replayed = await stream.until("run_finished")
    assert [seq_of(e) for e in replayed] == list(range(3, 3 + len(replayed)))
    assert {e["data"]["run"] for e in replayed} == {first} and replayed[0]["event"] == "run_queued"
    second = await post_run(api)
    live = await stream.until("run_finished")
    assert live[0]["event"] == "run_queued" and {e["data"]["run"] for e in live} == {second}
    assert seq_of(live[0]) == seq_of(replayed[-1]) + 1


async def test_a_client_that_cannot_set_headers_resumes_with_last_event_id_in_the_query(api, open_stream):
    await api.finished(await post_run(api))
    stream = await open_stream(api, f"?last_event_id={event_id(api, 3)}")
    assert [(e["id"], e["event"]) for e in await stream.until("run_started")] == [
        (event_id(api, 4), "run_started")
    ]


async def test_resuming_from_events_no_longer_remembered_is_410_saying_so(api):
    bus = api.cluster.bus
    for _ in range(HISTORY + 1):  # push event 1 out of the ring buffer
        bus.publish(RunStarted(run=10**9))
    status, body, _ = await api.get("/events", headers={"Last-Event-ID": "0"})
    assert status == 410 and "too old to resume" in body["error"] and "without Last-Event-ID" in body["error"]
    # An id from before a coordinator restart (beyond the newest) cannot be resumed either.
    status, body, _ = await api.get("/events", headers={"Last-Event-ID": event_id(api, bus.seq + 50)})
    assert status == 410 and "does not exist" in body["error"]
    # Nor a bare number, as ids were before they had an epoch.
    status, body, _ = await api.get("/events", headers={"Last-Event-ID": str(bus.seq + 50)})
    assert status == 410 and "does not exist" in body["error"]


async def test_an_idle_stream_gets_a_keep_alive_comment(api, monkeypatch, open_stream):
    monkeypatch.setattr(sse, "KEEPALIVE_S", 0.1)
    stream = await open_stream(api)
    waiting = asyncio.ensure_future(stream.next(timeout=5))
    await eventually(lambda: len(stream.comments) >= 2, 5, "two keep-alive comments")
    assert stream.comments[:2] == [": keep-alive", ": keep-alive"] and not waiting.done()
    await post_run(api)
    assert (await asyncio.wait_for(waiting, 5))["event"] == "run_queued"


async def test_shutting_down_ends_open_streams_at_once(api_factory, open_stream):
    api = await api_factory()
    streams = [await open_stream(api) for _ in range(3)]
    await asyncio.wait_for(api.server.close(), 10)
    for stream in streams:
        assert await stream.next(timeout=5) is None


async def test_the_stream_needs_the_token_when_one_is_set(api_factory, open_stream):
    api = await api_factory(token="s3cret")
    status, body, _ = await api.get("/events")
    assert status == 401 and "bearer token" in body["error"]
    await open_stream(api, headers={"Authorization": "Bearer s3cret"})


# Last, on the file's shared cluster (`pristine`), as it changes nothing: the function-scoped fixtures above
# check that no worker of this process is alive, which holds only before that cluster starts.
@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize(
    ("query", "headers", "says"),
    [
        ("?kind=run_finished,nope", {}, f"unknown kind 'nope': kinds are {', '.join(KINDS)}"),
        ("?run=abc", {}, "run must be an integer in 1.."),
        ("?run=0", {}, "run must be in 1.."),
        (
            "",
            {"Last-Event-ID": "x1"},
            "Last-Event-ID must be an event id as this stream sends them (EPOCH-SEQ",
        ),
        ("", {"Last-Event-ID": "x1"}, "got 'x1'"),
        ("?last_event_id=-3", {}, "Last-Event-ID must be an event id"),
    ],
)
async def test_a_bad_filter_or_event_id_is_400_saying_what_is_accepted(pristine, query, headers, says):
    status, body, _ = await pristine.get("/events" + query, headers=headers)
    assert status == 400 and says in body["error"], body
