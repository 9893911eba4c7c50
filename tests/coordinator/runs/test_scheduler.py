"""Several runs in flight: decode steps batched into shared forwards, each run kept apart from the others."""

from __future__ import annotations

import asyncio
import os
import signal

import numpy as np
import pytest

from coordinator.events import RunFinished, TokenGenerated
from coordinator.runs.recorder import RunCancelled
from coordinator.runs.scheduler import Scheduler
from coordinator.stages.chain import ForwardRequest, no_hook
from coordinator.stages.pipeline import StageFailed
from coordinator.stats import StageTiming
from tests.coordinator.conftest import Api
from workers.protocol.info import BatchItem, ModelInfo
from workers.protocol.report import LayerRange

TIMEOUT_S = 30
PROMPTS = ["abc", "zebra", "quiz", "hello world"]

# ---------------------------------------------------------------- the scheduler alone, on a stub pipeline


def timing(stage: int) -> StageTiming:
    return StageTiming(
        addr="stub", layers=LayerRange(stage, stage + 1), device="cpu", build_ms=0.0, forward_ms=1.0,
        resident_bytes=0, compute_ms=0.5, stage=stage,
    )  # fmt: skip


class StubPipeline:
    """Two stages that add 1 per row; records what was sent, and refuses or dies on cue."""

    info = ModelInfo(name="stub", n_layers=2, input="hidden", hidden=1)

    def __init__(self) -> None:
        self.sent: list[list[str]] = []  # the sessions of each forward, in order
        self.refuse: set[str] = set()  # sessions a stage refuses
        self.down: str | None = None

    def unready(self) -> str | None:
        return self.down

    async def forward(self, request: ForwardRequest):
        session = request.item.session
        self.sent.append([session])
        await asyncio.sleep(0.001)
        if session in self.refuse:
            raise StageFailed(f"stage 0 failed: session {session!r} holds no cache here")
        for stage in range(2):
            request.on_stage(timing(stage))
        return request.item.x + 1

    async def forward_batch(self, items, on_stage=no_hook, halt=None, on_recovery=None):
        self.sent.append([item.session for item in items])
        await asyncio.sleep(0.001)
        if self.down is not None:
            raise StageFailed(f"stage 1 failed: {self.down}")
        if any(item.session in self.refuse for item in items):
            raise StageFailed("stage 0 failed: a session holds no cache here")
        timings = [timing(0), timing(1)]
        for t in timings:
            on_stage(t)
        return [item.x + 1 for item in items], timings


async def member_steps(scheduler: Scheduler, session: str, prompt: int, steps: int) -> np.ndarray:
    """A run's forwards: a prompt of `prompt` rows, then one row per step; the last output."""
    with scheduler.member():
        y = await scheduler.forward(ForwardRequest(BatchItem(np.zeros((prompt, 1), np.float32), session, 0)))
        for step in range(steps):
            y = await scheduler.forward(ForwardRequest(BatchItem(y[-1:], session, prompt + step)))
    return y


@pytest.fixture
async def stub():
    pipeline = StubPipeline()
    scheduler = Scheduler(pipeline)
    scheduler.start()
    yield pipeline, scheduler
    await scheduler.close()


async def test_prompts_go_alone_and_the_decode_steps_of_every_member_go_together(stub):
    pipeline, scheduler = stub
    steps = 8
    runs = [member_steps(scheduler, s, 3, steps) for s in ("a", "b", "c")]
    outs = await asyncio.wait_for(asyncio.gather(*runs), TIMEOUT_S)
    assert [float(y[0, 0]) for y in outs] == [1.0 + steps] * 3  # the prompt's +1, then +1 per step
    firsts = {s: next(i for i, sent in enumerate(pipeline.sent) if s in sent) for s in "abc"}
    assert all(pipeline.sent[i] == [s] for s, i in firsts.items())  # each prompt by itself
    rows = [s for sent in pipeline.sent for s in sent]
    assert sorted(rows) == sorted("abc" * (1 + steps))  # every forward of every run, once
    # Decode steps start while later prompts are under way, and come together once all decode.
    assert ["a", "b", "c"] in [sorted(sent) for sent in pipeline.sent]
    assert scheduler.batched_rows == sum(len(sent) for sent in pipeline.sent if len(sent) > 1)


async def test_with_two_lanes_two_batches_are_in_flight_at_once_in_groups_of_even_size():
    pipeline = StubPipeline()
    in_flight, most = 0, 0
    batch = pipeline.forward_batch

    async def counted(items, on_stage=no_hook, halt=None, on_recovery=None):
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        try:
            return await batch(items, on_stage, halt, on_recovery)
        finally:
            in_flight -= 1

    pipeline.forward_batch = counted
    scheduler = Scheduler(pipeline, lanes=2)
    scheduler.start()
    try:
        steps = 8
        runs = [member_steps(scheduler, s, 1, steps) for s in "abcd"]
        outs = await asyncio.wait_for(asyncio.gather(*runs), TIMEOUT_S)
    finally:
        await scheduler.close()
    assert [float(y[0, 0]) for y in outs] == [1.0 + steps] * 4
    assert most == 2
    batches = [sent for sent in pipeline.sent if len(sent) > 1]
    assert batches and all(len(sent) == 2 for sent in batches)  # 4 decoding runs over 2 lanes
    assert sorted(s for sent in pipeline.sent for s in sent) == sorted("abcd" * (1 + steps))


async def test_with_two_lanes_two_prompts_are_in_flight_at_once_each_by_itself():
    pipeline = StubPipeline()
    in_flight, most = 0, 0
    forward = pipeline.forward

    async def counted(request):
        nonlocal in_flight, most
        prompt = len(request.item.x) > 1
        in_flight += prompt
        most = max(most, in_flight)
        try:
            return await forward(request)
        finally:
            in_flight -= prompt

    pipeline.forward = counted
    scheduler = Scheduler(pipeline, lanes=2)
    scheduler.start()
    try:
        runs = [member_steps(scheduler, s, 3, 2) for s in "abcd"]
        outs = await asyncio.wait_for(asyncio.gather(*runs), TIMEOUT_S)
    finally:
        await scheduler.close()
    assert [float(y[0, 0]) for y in outs] == [1.0 + 2] * 4
    assert most == 2  # never more prompts under way than lanes, and more than one when several wait
    firsts = {s: next(i for i, sent in enumerate(pipeline.sent) if s in sent) for s in "abcd"}
    assert all(pipeline.sent[i] == [s] for s, i in firsts.items())  # each prompt by itself


def test_a_scheduler_refuses_fewer_than_one_lane():
    with pytest.raises(ValueError, match="lanes must be at least 1, got 0"):
        Scheduler(StubPipeline(), lanes=0)


async def test_a_run_whose_own_forward_is_refused_fails_alone_and_the_others_go_on(stub):
    pipeline, scheduler = stub
    pipeline.refuse = {"b"}
    runs = [member_steps(scheduler, s, 1, 3) for s in ("a", "b", "c")]
    a, b, c = await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True), TIMEOUT_S)
    assert isinstance(b, StageFailed) and "'b' holds no cache" in str(b)
    assert float(a[0, 0]) == float(c[0, 0]) == 4.0


async def test_a_stage_that_is_gone_fails_every_run_of_the_batch_naming_it(stub):
    pipeline, scheduler = stub
    pipeline.down = "stage 1 (127.0.0.1:1, layers 1..2) is down: worker process 7 exited with status -9"

    async def decode(session: str):
        with scheduler.member():
            return await scheduler.forward(
                ForwardRequest(BatchItem(np.zeros((1, 1), np.float32), session, 5))
            )

    results = await asyncio.wait_for(asyncio.gather(*map(decode, "ab"), return_exceptions=True), TIMEOUT_S)
    assert pipeline.sent == [["a", "b"]]
    assert all(isinstance(r, StageFailed) and "stage 1 failed" in str(r) for r in results)


async def test_a_run_cancelled_in_a_batch_leaves_it_and_the_others_take_their_rows(stub):
    pipeline, scheduler = stub

    def cancel_on_second_stage(t: StageTiming) -> None:
        if t.stage == 1:
            raise RunCancelled("cancelled while running")

    async def decode(session: str, hook):
        with scheduler.member():
            return await scheduler.forward(
                ForwardRequest(BatchItem(np.zeros((1, 1), np.float32), session, 5), hook)
            )

    told: list[StageTiming] = []
    runs = [decode("a", told.append), decode("b", cancel_on_second_stage)]
    a, b = await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True), TIMEOUT_S)
    assert pipeline.sent == [["a", "b"]]
    assert float(a[0, 0]) == 1.0 and isinstance(b, RunCancelled)
    assert [t.stage for t in told] == [0, 1]


# ---------------------------------------------------------------- runs on a real cluster


async def alone(api: Api, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    """Each prompt's greedy tokens, generated with no other run in flight."""
    tokens = []
    for prompt in prompts:
        run = await api.submit({"prompt": prompt, "max_new_tokens": max_new_tokens})
        tokens.append((await api.finished(run, TIMEOUT_S))["tokens"])
    return tokens


async def test_runs_in_flight_together_give_the_tokens_they_give_one_at_a_time(api_factory, tiny_chat):
    api = await api_factory(str(tiny_chat), 2)
    want = await alone(api, PROMPTS, 32)
    scheduler = api.cluster.runner.scheduler
    assert scheduler.batches == 0
    ids = await asyncio.gather(*(api.submit({"prompt": p, "max_new_tokens": 32}) for p in PROMPTS))
    runs = [await api.finished(run, TIMEOUT_S) for run in ids]
    assert [run["status"] for run in runs] == ["ok"] * len(PROMPTS)
    assert [run["tokens"] for run in runs] == want
    assert scheduler.batches > 0 and scheduler.batched_rows >= 2 * scheduler.batches
    for run in runs:  # each run keeps its own record: every stage of every step it took
        assert [t["stage"] for t in run["decode"]["timings"]] == [0, 1]
        assert run["decode"]["seq"] == 31 and all(t["compute_ms"] > 0 for t in run["decode"]["timings"])


async def test_a_run_refused_mid_batch_fails_alone_and_the_others_finish(api_factory, tiny_chat):
    api = await api_factory(str(tiny_chat), 2)
    api.cluster.runner.scheduler.lanes = 1  # every decoding run in one batch: the batch is the point
    want = await alone(api, PROMPTS[:3], 48)
    sub = api.cluster.bus.subscribe(accept=lambda e: isinstance(e, TokenGenerated))
    ids = await asyncio.gather(*(api.submit({"prompt": p, "max_new_tokens": 48}) for p in PROMPTS[:3]))
    victim = ids[1]
    async with asyncio.timeout(TIMEOUT_S):
        while not ((e := await sub.get()).run == victim and e.index == 4):
            pass
    # The first stage forgets the run's session (as if evicted): its next forward there is refused.
    await api.cluster.pipeline.nodes[0].client.reset(f"run-{victim}", timeout=TIMEOUT_S)
    runs = [await api.finished(run, TIMEOUT_S) for run in ids]
    assert [run["status"] for run in runs] == ["ok", "failed", "ok"]
    assert f"session 'run-{victim}' holds no cache" in runs[1]["error"] and "stage 0" in runs[1]["error"]
    assert [runs[0]["tokens"], runs[2]["tokens"]] == [want[0], want[2]]
    assert runs[1]["tokens"] == want[1][: len(runs[1]["tokens"])] and len(runs[1]["tokens"]) >= 5


async def test_cancelling_one_run_takes_it_out_of_the_batch_and_the_others_finish(api_factory, tiny_chat):
    api = await api_factory(str(tiny_chat), 2)
    api.cluster.runner.scheduler.lanes = 1  # every decoding run in one batch: the batch is the point
    want = await alone(api, PROMPTS[:3], 48)
    sub = api.cluster.bus.subscribe(accept=lambda e: isinstance(e, (TokenGenerated, RunFinished)))
    ids = await asyncio.gather(*(api.submit({"prompt": p, "max_new_tokens": 48}) for p in PROMPTS[:3]))
    victim = ids[0]
    async with asyncio.timeout(TIMEOUT_S):
        while not ((e := await sub.get()).run == victim and isinstance(e, TokenGenerated) and e.index == 4):
            pass
    assert api.cluster.runner.live(ids[2]) is not None  # every run is running, not only the latest
    cancelled = await asyncio.wait_for(api.cluster.runner.cancel(victim), TIMEOUT_S)
    assert cancelled.status == "cancelled" and 5 <= len(cancelled.tokens) < 48
    rows_then = api.cluster.runner.scheduler.batched_rows
    runs = [await api.finished(run, TIMEOUT_S) for run in ids[1:]]
    assert [run["status"] for run in runs] == ["ok", "ok"]
    assert [run["tokens"] for run in runs] == want[1:]
    assert api.cluster.runner.scheduler.batched_rows > rows_then  # the other two went on batched
    latest = (await api.get("/run/latest"))[1]  # the run started last, as stored once it ended
    assert latest["id"] in ids and latest["status"] in ("ok", "cancelled")


async def test_with_recovery_off_a_worker_dying_mid_batch_fails_every_run_in_flight_naming_its_stage(
    api_factory, tiny_chat
):
    api = await api_factory(str(tiny_chat), 2, recover_timeout=0)
    api.cluster.runner.scheduler.lanes = 1  # every decoding run in one batch: the batch is the point
    sub = api.cluster.bus.subscribe(accept=lambda e: isinstance(e, TokenGenerated))
    ids = await asyncio.gather(*(api.submit({"prompt": p, "max_new_tokens": 400}) for p in PROMPTS[:3]))
    seen: set[int] = set()
    async with asyncio.timeout(TIMEOUT_S):
        while len(seen) < len(ids):  # every run is decoding
            seen.add((await sub.get()).run)
    os.kill(api.cluster.pipeline.nodes[1].process.proc.pid, signal.SIGKILL)
    runs = [await api.finished(run, TIMEOUT_S) for run in ids]
    assert [run["status"] for run in runs] == ["failed"] * len(ids)
    assert all("stage 1" in run["error"] for run in runs), [run["error"] for run in runs]
