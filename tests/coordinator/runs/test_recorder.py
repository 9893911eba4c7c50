"""A run's recorder on its own: each step's stage timings in the record and on the bus, and the cancel."""

from __future__ import annotations

import time

import pytest

from coordinator.events import EventBus, StageForward, TokenGenerated
from coordinator.runs import recorder as recorder_module
from coordinator.runs.recorder import Recorder, RunCancelled
from coordinator.stages.chain import replied_at
from coordinator.stats import ClusterRun, StageTiming
from workers.protocol.report import LayerRange


def timing(stage: int, forward_ms: float = 4.0, compute_ms: float = 3.0) -> StageTiming:
    return StageTiming(
        addr=f"127.0.0.1:{4000 + stage}", layers=LayerRange(stage, stage + 1), device="cpu", build_ms=0.0,
        forward_ms=forward_ms, resident_bytes=0, compute_ms=compute_ms, stage=stage,
    )  # fmt: skip


def recording(run_id: int = 7) -> tuple[ClusterRun, EventBus, Recorder]:
    run = ClusterRun(timings=[], total_forward_ms=0.0, output=[], id=run_id, status="running")
    bus = EventBus()
    recorder = Recorder(run, bus)
    recorder.start()
    return run, bus, recorder


def test_a_steps_hook_tells_keep_records_each_stage_and_tells_the_bus():
    run, bus, recorder = recording()
    kept: list[StageTiming] = []
    hook = recorder.begin(0, 5, kept.append)
    hook(timing(0, 4.0, 3.0))
    hook(timing(1, 6.0, 5.0))
    recorder.end()
    assert [t.stage for t in kept] == [0, 1]
    (step,) = run.steps
    assert (step.step, step.positions) == (0, 5)
    assert (step.forward_ms, step.compute_ms) == ([4.0, 6.0], [3.0, 5.0])
    assert step.start_ms >= 0 and step.wall_ms >= 0
    events = bus.after(0)
    assert all(isinstance(e, StageForward) for e in events)
    assert [(e.run, e.step, e.stage, e.addr, e.forward_ms, e.compute_ms, e.positions) for e in events] == [
        (7, 0, 0, "127.0.0.1:4000", 4.0, 3.0, 5),
        (7, 0, 1, "127.0.0.1:4001", 6.0, 5.0, 5),
    ]


def test_a_stage_is_placed_when_it_replied_not_when_its_hook_runs():
    run, _, recorder = recording()
    hook = recorder.begin(0, 1, lambda t: None)
    replied = recorder.started + 0.5  # the stage replied 500 ms into the run; its hook runs later
    token = replied_at.set(replied)
    try:
        hook(timing(0, forward_ms=100.0))
    finally:
        replied_at.reset(token)
    step = run.steps[0]
    assert step.stage_start_ms == [pytest.approx(400.0)]  # sent forward_ms before it replied
    assert step.wall_ms == pytest.approx(500.0 - step.start_ms)


def test_without_a_reply_time_a_stage_is_placed_at_the_moment_its_hook_runs():
    run, _, recorder = recording()
    hook = recorder.begin(0, 1, lambda t: None)
    before = (time.monotonic() - recorder.started) * 1000
    hook(timing(0, forward_ms=2.0))
    after = (time.monotonic() - recorder.started) * 1000
    assert before - 2.0 <= run.steps[0].stage_start_ms[0] <= after - 2.0


def test_a_cancel_stops_the_run_at_the_next_forward_boundary():
    run, bus, recorder = recording()
    recorder.check()  # nothing asked yet
    hook = recorder.begin(0, 3, run.timings.append)
    recorder.cancelled = True
    with pytest.raises(RunCancelled, match="cancelled while running"):
        recorder.check()
    # The stage that replied is still recorded and told; only then does its hook stop the forward.
    with pytest.raises(RunCancelled):
        hook(timing(0))
    assert [t.stage for t in run.timings] == [0] and run.steps[0].forward_ms == [4.0]
    assert [e.stage for e in bus.after(0)] == [0]
    with pytest.raises(RunCancelled):
        recorder.begin(1, 1, run.timings.append)  # no next step is begun either
    assert len(run.steps) == 1


def test_the_first_forward_is_kept_and_decode_steps_are_a_sliding_window(monkeypatch):
    monkeypatch.setattr(recorder_module, "KEPT_STEPS", 3)
    run, _, recorder = recording()
    for step in range(8):
        hook = recorder.begin(step, 4 if step == 0 else 1, lambda t: None)
        hook(timing(0))
        recorder.end()
    assert [s.step for s in run.steps] == [0, 5, 6, 7]
    assert run.steps_omitted == 4 and run.steps[0].positions == 4


def test_every_chunk_of_the_prompt_is_kept_and_the_decode_steps_after_them_are_a_sliding_window(monkeypatch):
    monkeypatch.setattr(recorder_module, "KEPT_STEPS", 3)
    run, _, recorder = recording()
    for step, positions in [(0, 4), (0, 4), (0, 3), *((n, 1) for n in range(1, 8))]:
        hook = recorder.begin(step, positions, lambda t: None)
        hook(timing(0))
        recorder.end()
    assert [(s.step, s.positions) for s in run.steps] == [(0, 4), (0, 4), (0, 3), (5, 1), (6, 1), (7, 1)]
    assert run.steps_omitted == 4


def test_a_token_is_told_with_the_stage_times_of_the_step_that_made_it():
    _, bus, recorder = recording(run_id=3)
    hook = recorder.begin(0, 2, lambda t: None)
    hook(timing(0, forward_ms=4.0))
    hook(timing(1, forward_ms=9.0))
    recorder.end()
    recorder.token(0, 42, "ab")
    (event,) = [e for e in bus.after(0) if isinstance(e, TokenGenerated)]
    assert (event.run, event.index, event.token, event.text, event.stage_ms) == (3, 0, 42, "ab", [4.0, 9.0])
