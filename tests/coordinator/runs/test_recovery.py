"""A generation survives a stage's death: real workers of a tiny llama, killed, stopped or starved under it.

The tiny llama is a real GGUF through the real kernels and KV caches, 3 layers on 3 stages: a stage
that was not refilled exactly would change the tokens that follow. Every test shares one cluster
(each kill costs a restart, ~0.6 s); the reference tokens are its own undisturbed runs.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Callable

import aiohttp
import msgspec
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestServer

from coordinator.api import CLUSTER, create_app
from coordinator.cluster import ClusterConfig
from coordinator.events import (
    Event,
    NodeChanged,
    RunFinished,
    RunRecovered,
    RunRecovering,
    StageForward,
    TokenGenerated,
)
from coordinator.stages.node import RestartPolicy
from tests.conftest import eventually
from tests.coordinator.api.test_metrics import scrape_when
from tests.coordinator.conftest import Api
from tests.support.tiny_chat import write_tiny_chat

pytestmark = pytest.mark.asyncio(loop_scope="module")
TIMEOUT_S = 60
GREEDY = {"prompt": "abc", "max_new_tokens": 40}
SEEDED = {"prompt": "zebra", "max_new_tokens": 40, "temperature": 1.2, "seed": 3}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def api(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Api]:
    """The tiny llama on 3 launched stages, one lane (every decoding run in one batch), shared by the file."""
    path = tmp_path_factory.mktemp("recovery") / "tiny-chat.gguf"
    write_tiny_chat(path, context_length=1024)
    server = TestServer(create_app(ClusterConfig(str(path), 3, build_timeout=60.0), ""), host="127.0.0.1")
    await server.start_server()
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
    try:
        api = Api(server, session, server.app[CLUSTER])
        api.cluster.runner.scheduler.lanes = 1
        yield api
    finally:
        await session.close()
        await server.close()


async def undisturbed(api: Api, *bodies: dict) -> list[list[int]]:
    """The tokens of `bodies` run together with nothing dying: what every recovered run must give."""
    ids = await asyncio.gather(*(api.submit(b) for b in bodies))
    runs = [await api.finished(i, TIMEOUT_S) for i in ids]
    assert all(r["status"] == "ok" and r["recoveries"] == [] for r in runs), runs
    return [r["tokens"] for r in runs]


async def all_up(api: Api) -> None:
    """Every stage is back (a test leaves none down for the next)."""
    nodes = api.cluster.pipeline.nodes
    await eventually(lambda: all(n.state == "up" for n in nodes), TIMEOUT_S, "every stage up")


def pid(api: Api, stage: int) -> int:
    return api.cluster.pipeline.nodes[stage].process.proc.pid


def expect(api: Api, accept: Callable[[Event], bool], what: str) -> asyncio.Task[Event]:
    """The next event `accept` takes from now on (subscribed at once), within TIMEOUT_S."""
    sub = api.cluster.bus.subscribe(accept=accept)

    async def wait() -> Event:
        try:
            async with asyncio.timeout(TIMEOUT_S):
                event = await sub.get()
            assert event is not None, f"the bus closed before {what}"
            return event
        finally:
            sub.close()

    return asyncio.ensure_future(wait())


async def when(api: Api, accept: Callable[[Event], bool], what: str) -> Event:
    return await expect(api, accept, what)


def token_of(ids: list[int], index: int):
    return lambda e: isinstance(e, TokenGenerated) and e.run in ids and e.index >= index


async def test_a_run_whose_stage_is_killed_at_token_10_ends_with_an_undisturbed_runs_tokens(api):
    [expected] = await undisturbed(api, GREEDY)
    events = api.cluster.bus.subscribe(accept=lambda e: isinstance(e, RunRecovering | RunRecovered))
    run_id = await api.submit(GREEDY)
    await when(api, token_of([run_id], 10), "token 10")
    old = api.cluster.pipeline.nodes[1].report.addr
    os.kill(pid(api, 1), signal.SIGKILL)
    run = await api.finished(run_id, TIMEOUT_S)
    assert run["status"] == "ok", run["error"]
    assert run["tokens"] == expected
    [r] = run["recoveries"]
    assert (r["stage"], r["addr"]) == (1, old) and r["new_addr"] not in ("", old)
    assert r["at_position"] == r["replayed_positions"] >= 10  # the prompt and 10 tokens or more, replayed
    assert r["waited_ms"] >= 0 and r["replay_ms"] > 0
    stored = await api.cluster.store.get(run_id)
    assert any(1 in step.replayed for step in stored.steps)  # the step taken again says so
    told = [await asyncio.wait_for(events.get(), 5) for _ in range(2)]
    events.close()
    assert [type(e).__name__ for e in told] == ["RunRecovering", "RunRecovered"]
    assert all(e.run == run_id and e.stage == 1 for e in told)
    await scrape_when(api, "rlx_recoveries_total", 1.0, stage="1")
    status, trace, _ = await api.get(f"/runs/{run_id}/trace")
    assert status == 200 and {"waiting for stage 1", "replay"} <= {e["name"] for e in trace["traceEvents"]}
    await all_up(api)


async def test_every_run_of_a_shared_decode_batch_recovers_greedy_and_seeded_alike(api):
    bodies = (GREEDY, SEEDED, {"prompt": "quiz", "max_new_tokens": 40})
    expected = await undisturbed(api, *bodies)
    ids = await asyncio.gather(*(api.submit(b) for b in bodies))
    for i in ids:  # every run is decoding: their steps go as one batch
        await when(api, token_of([i], 5), f"run {i} decoding")
    os.kill(pid(api, 2), signal.SIGKILL)
    runs = [await api.finished(i, TIMEOUT_S) for i in ids]
    assert [r["status"] for r in runs] == ["ok"] * 3, [r["error"] for r in runs]
    assert [r["tokens"] for r in runs] == expected
    assert all([rec["stage"] for rec in r["recoveries"]] == [2] for r in runs)
    await all_up(api)


async def test_a_stopped_stage_times_out_is_replaced_and_the_run_goes_on(api):
    [expected] = await undisturbed(api, GREEDY)
    pipeline = api.cluster.pipeline
    pipeline.forward_timeout = 1.0
    try:
        recovering = expect(api, lambda e: isinstance(e, RunRecovering), "the wait")
        run_id = await api.submit(GREEDY)
        await when(api, token_of([run_id], 8), "token 8")
        os.kill(pid(api, 1), signal.SIGSTOP)
        run = await api.finished(run_id, TIMEOUT_S)
    finally:
        pipeline.forward_timeout = 60.0
    assert run["status"] == "ok", run["error"]
    assert run["tokens"] == expected and [r["stage"] for r in run["recoveries"]] == [1]
    assert "no reply within 1s" in (await recovering).reason
    await all_up(api)


async def test_a_stage_killed_during_a_chunked_prompt_is_refilled_with_the_chunks_sent_before(api):
    body = {"prompt": "thequickbrownfoxjumpsoverthelazydog" * 2, "max_new_tokens": 8}
    [expected] = await undisturbed(api, body)
    runner = api.cluster.runner
    runner.prefill_chunk = 8  # the prompt goes as 9 forwards: a kill lands between two of them
    try:
        run_id = await api.submit(body)
        first = lambda e: isinstance(e, StageForward) and e.run == run_id and e.step == 0 and e.stage == 2  # noqa: E731
        await when(api, first, "the first chunk through stage 2")
        os.kill(pid(api, 2), signal.SIGKILL)
        run = await api.finished(run_id, TIMEOUT_S)
    finally:
        runner.prefill_chunk = 512
    assert run["status"] == "ok", run["error"]
    assert run["tokens"] == expected
    [r] = run["recoveries"]
    assert r["stage"] == 2 and 0 < r["replayed_positions"] < len(body["prompt"])
    await all_up(api)


async def test_a_recovering_run_is_cancelled_before_its_stage_is_back(api):
    run_id = await api.submit({"prompt": "abc", "max_new_tokens": 400})
    await when(api, token_of([run_id], 3), "token 3")
    recovering = expect(api, lambda e: isinstance(e, RunRecovering), "the wait")
    back = expect(api, lambda e: isinstance(e, NodeChanged) and e.state == "up", "the stage up")
    os.kill(pid(api, 1), signal.SIGKILL)
    await recovering
    async with api.session.delete(api.url(f"/runs/{run_id}")) as response:
        assert response.status == 200, await response.text()
    run = await api.finished(run_id, TIMEOUT_S)
    assert run["status"] == "cancelled" and run["recoveries"] == []
    assert not back.done(), "the stage was back before the cancel took: it did not cancel the wait"
    await back
    await all_up(api)


async def test_a_stage_not_back_within_the_recover_timeout_fails_the_run_saying_what_it_waited_for(api):
    pipeline = api.cluster.pipeline
    pipeline.recover_timeout = 0.2  # a restart waits 0.5 s before it starts a worker
    try:
        run_id = await api.submit({"prompt": "abc", "max_new_tokens": 400})
        await when(api, token_of([run_id], 3), "token 3")
        started = time.monotonic()
        os.kill(pid(api, 1), signal.SIGKILL)
        run = await api.finished(run_id, TIMEOUT_S)
    finally:
        pipeline.recover_timeout = 30.0
    assert run["status"] == "failed" and time.monotonic() - started < 10
    error = run["error"]
    assert "stage 1" in error and "not back within the recover timeout" in error, error
    assert "at most 0.2s" in error and "to be up again" in error, error
    await all_up(api)


async def stream(api: Api, body: dict, on_chunk: Callable[[int], None] = lambda n: None) -> list[dict]:
    """The data chunks of a streamed /v1/completions, told to `on_chunk` by count as they come."""
    chunks: list[dict] = []
    async with api.session.post(api.url("/v1/completions"), json={**body, "stream": True}) as r:
        assert r.status == 200, await r.text()
        async with asyncio.timeout(TIMEOUT_S):
            async for line in r.content:
                if line.startswith(b"data: {"):
                    chunks.append(msgspec.json.decode(line.removeprefix(b"data: ")))
                    on_chunk(len(chunks))
    return chunks


async def test_an_openai_stream_pauses_while_its_stage_is_rebuilt_and_ends_as_an_undisturbed_one(api):
    body = {"model": api.cluster.info.name, "prompt": "abc", "max_tokens": 60, "temperature": 0}
    undisturbed = await stream(api, body)
    victim = pid(api, 1)
    recovered = expect(api, lambda e: isinstance(e, RunRecovered), "the stream's run recovered")

    def kill_at_10(n: int) -> None:
        if n == 10:
            os.kill(victim, signal.SIGKILL)

    chunks = await stream(api, body, kill_at_10)
    assert (await recovered).stage == 1  # it was killed and replaced under the stream
    text = ["".join(c["choices"][0]["text"] for c in cs) for cs in (chunks, undisturbed)]
    assert text[0] == text[1] and len(text[0]) > 0
    last = [cs[-1]["choices"][0] for cs in (chunks, undisturbed)]
    assert last[0] == last[1] and last[0]["finish_reason"] == "length"
    await all_up(api)


async def test_a_stage_out_of_restarts_fails_its_runs_as_before(api):
    node = api.cluster.pipeline.nodes[1]
    node.policy = RestartPolicy(budget=0)
    try:
        run_id = await api.submit({"prompt": "abc", "max_new_tokens": 400})
        await when(api, token_of([run_id], 3), "token 3")
        ended = expect(api, lambda e: isinstance(e, RunFinished) and e.run == run_id, "the run's end")
        started = time.monotonic()
        os.kill(pid(api, 1), signal.SIGKILL)
        await ended
        run = await api.finished(run_id, TIMEOUT_S)
    finally:
        node.policy = RestartPolicy()
    assert (
        run["status"] == "failed"
        and "stage 1" in run["error"]
        and "out of automatic restarts" in run["error"]
    )
    assert time.monotonic() - started < 5  # no recover timeout waited out
