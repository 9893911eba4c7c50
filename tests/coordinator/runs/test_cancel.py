"""DELETE /runs/{id}: a queued run leaves the queue, a running one stops at the next forward boundary."""

from __future__ import annotations

import asyncio

from coordinator.api import runs
from coordinator.events import Event, RunFinished, StageForward, TokenGenerated
from tests.coordinator.conftest import Api
from tests.support.tiny_chat import PROMPT


async def delete(api: Api, run_id: int | str) -> tuple[int, dict]:
    async with api.session.delete(api.url(f"/runs/{run_id}")) as r:
        return r.status, await r.json()


async def first(sub, wanted, timeout: float = 20) -> Event:
    async with asyncio.timeout(timeout):
        while not wanted(event := await sub.get()):
            pass
    return event


async def sessions(api: Api) -> list[int]:
    status, body, _ = await api.get("/nodes?live=1")
    assert status == 200
    return [node["live"]["sessions"] for node in body["nodes"]]


async def test_a_queued_run_is_cancelled_at_once_and_stored_while_the_one_ahead_goes_on(api_factory):
    api = await api_factory("fake:layers=2,delay_ms=1000", 1, max_active=1)
    told = api.cluster.bus.subscribe(accept=lambda e: isinstance(e, RunFinished))
    ahead, queued = await api.submit({"seq": 2}), await api.submit({"seq": 2})
    status, body = await delete(api, queued)
    assert status == 200 and (body["id"], body["status"]) == (queued, "cancelled")
    assert body["error"] == "cancelled before it started" and body["timings"] == []
    assert api.cluster.runner.queued() == 0
    assert (await api.get(f"/runs/{queued}"))[1]["status"] == "cancelled"
    finished = [await asyncio.wait_for(told.get(), 10) for _ in range(2)]
    assert [(e.run, e.status) for e in finished] == [(queued, "cancelled"), (ahead, "ok")]
    assert (await api.finished(ahead))["status"] == "ok"


async def test_a_running_forward_stops_once_the_stage_in_flight_replies(api_factory):
    api = await api_factory("fake:layers=3,delay_ms=500", 3)
    sub = api.cluster.bus.subscribe()
    run = await api.submit({"seq": 2})
    await first(sub, lambda e: isinstance(e, StageForward) and e.run == run)
    status, body = await delete(api, run)
    assert status == 200 and body["status"] == "cancelled" and body["error"] == "cancelled while running"
    assert 1 <= len(body["timings"]) < 3
    assert len((await api.get(f"/runs/{run}"))[1]["timings"]) == len(body["timings"])
    again = await api.submit({"seq": 2})
    assert (await api.finished(again))["status"] == "ok"


async def test_a_generation_stops_at_a_step_boundary_and_its_workers_drop_the_session(api_factory, tiny_chat):
    api = await api_factory(str(tiny_chat), 2)
    sub = api.cluster.bus.subscribe(accept=lambda e: isinstance(e, TokenGenerated))
    run = await api.submit({"prompt": PROMPT, "max_new_tokens": 1000})
    await first(sub, lambda e: e.index == 2)
    assert await sessions(api) == [1, 1]  # each stage holds the run's KV cache while it runs
    status, body = await delete(api, run)
    assert status == 200 and body["status"] == "cancelled", body
    assert 3 <= len(body["tokens"]) < 1000 and body["text"]
    assert await sessions(api) == [0, 0]  # dropped before the run's end was stored
    again = await api.submit({"prompt": PROMPT, "max_new_tokens": 3})
    assert (await api.finished(again))["tokens"] == body["tokens"][:3]


async def test_a_run_still_stopping_after_a_while_is_202_and_ends_cancelled(api_factory, monkeypatch):
    monkeypatch.setattr(runs, "CANCEL_WAIT_S", 0.05)
    api = await api_factory("fake:layers=2,delay_ms=1500", 1)
    sub = api.cluster.bus.subscribe()
    run = await api.submit({"seq": 2})
    await first(sub, lambda e: type(e).__name__ == "RunStarted")
    status, body = await delete(api, run)
    assert status == 202 and body["cancelling"] is True and body["status"] == "running"
    assert (await api.finished(run))["status"] == "cancelled"


async def test_cancelling_an_unknown_run_is_404_and_a_finished_one_409(api):
    assert await delete(api, 99) == (404, {"error": "no run 99"})
    assert (await delete(api, "x9"))[0] == 404
    done = await api.submit({"seq": 2})
    await api.finished(done)
    assert await delete(api, done) == (409, {"error": f"run {done} has already finished: it is ok"})


async def test_a_cancel_that_comes_after_a_runs_last_forward_is_409_and_every_answer_agrees_with_the_store(
    api_factory,
):
    # Four runs in flight on a slow stage 0: a run's last stage replies, then its session reset waits
    # behind the others' forwards at stage 0 before its end is stored, so a DELETE sent as its last
    # stage replies lands in that window by construction. Those sent as its first stage replies stop it.
    api = await api_factory("fake:layers=2,delay_ms=20", 2)
    replies = api.cluster.bus.subscribe(accept=lambda e: isinstance(e, StageForward))
    ids = [await api.submit({"seq": 2}) for _ in range(40)]
    answers: dict[int, asyncio.Task] = {}
    async with asyncio.timeout(60):
        while len(answers) < len(ids):
            event = await replies.get()
            assert isinstance(event, StageForward), event  # no Lagged: the test reads as fast as it goes
            last = event.stage == 1
            if event.run not in answers and last == (event.run % 2 == 1):
                answers[event.run] = asyncio.create_task(delete(api, event.run))
        told = {run: await task for run, task in answers.items()}
    stored = {run: (await api.finished(run))["status"] for run in ids}
    for run, (status, body) in told.items():
        if status == 200:
            assert body["status"] == "cancelled" == stored[run], (run, body, stored[run])
        else:
            assert status == 409 and stored[run] != "cancelled", (run, status, body, stored[run])
            assert body == {"error": f"run {run} has already finished: it is {stored[run]}"}
    assert [run for run in ids if run % 2 == 1 and told[run][0] == 409], "no cancel came after a last forward"
    assert [run for run in ids if run % 2 == 0 and told[run][0] == 200], "no cancel stopped a run"
