"""GET /runs/{id}/trace: one run as Chrome trace-event JSON, for Perfetto or chrome://tracing.

The run is one process with a track (thread) for the coordinator and one per
stage. The coordinator's track holds the run and, inside it, a slice per
forward ("prefill", "forward" or "decode N") over the step's wall time, the
coordinator's own work (encoding, sampling) included. A stage's track holds a
slice per forward it served, from when the coordinator sent it its input, for
its forward_ms, split in two kinds of child slice: "compute" (the worker's
compute_ms) and "network" (forward_ms - compute_ms, the hop and the framing).
Only that sum is measured, not when the hop's halves happened, so the network
time is drawn half before the compute (the input going out) and half after
(the output coming back). Timestamps are µs after the run started, on the
coordinator's monotonic clock. The slices are the run record's StepTimings:
the first forward and the last KEPT_STEPS decode steps of a long generation;
`otherData` says how many were left out. A stage that went down under the run
and was rebuilt for it (the run's `recoveries`) shows on its track as "waiting
for stage N" (until it was back) then "replay" (its new worker refilled).
"""

from __future__ import annotations

from aiohttp import web

from coordinator.api.common import json_off_loop, json_response
from coordinator.api.runs import run_by_id
from coordinator.stats import KEPT_STEPS, ClusterRun, StepTiming

PID = 1
COORDINATOR_TID = 0


def _ns(ms: float) -> int:
    """Milliseconds as whole nanoseconds: children computed in them add up to their parent exactly."""
    return round(ms * 1e6)


def _slice(name: str, tid: int, start_ns: int, end_ns: int, cat: str, args: dict | None = None) -> dict:
    """A complete ("X") event from start_ns to end_ns, in the µs the format counts in."""
    event = {"name": name, "cat": cat, "ph": "X", "pid": PID, "tid": tid,
             "ts": start_ns / 1000, "dur": (end_ns - start_ns) / 1000}  # fmt: skip
    if args is not None:
        event["args"] = args
    return event


def _step_name(run: ClusterRun, step: StepTiming) -> str:
    if step.step:
        return f"decode {step.step}"
    return "prefill" if run.prompt is not None else "forward"


def _stage_slices(run: ClusterRun, step: StepTiming, stage: int) -> list[dict]:
    """One stage's part of one step: the forward, its network halves and its compute."""
    forward_ms, compute_ms = step.forward_ms[stage], step.compute_ms[stage]
    start = _ns(step.stage_start_ms[stage])
    end = start + _ns(forward_ms)
    # The worker's clock and ours differ a little: the compute is drawn within the forward.
    compute = min(_ns(compute_ms), end - start)
    sent = start + (end - start - compute) // 2
    tid = stage + 1
    args = {"step": step.step, "positions": step.positions, "forward_ms": forward_ms,
            "compute_ms": compute_ms, "network_ms": forward_ms - compute_ms}  # fmt: skip
    return [
        _slice(_step_name(run, step), tid, start, end, "forward", args),
        _slice("network", tid, start, sent, "network"),
        _slice("compute", tid, sent, sent + compute, "compute"),
        _slice("network", tid, sent + compute, end, "network"),
    ]


def _track_names(run: ClusterRun, stages: int) -> list[dict]:
    """Name the process and its tracks, in pipeline order."""
    names = {t.stage: f"stage {t.stage} {t.addr} layers {t.layers}" for t in run.timings}
    tracks = [(COORDINATOR_TID, "coordinator")] + [(i + 1, names.get(i, f"stage {i}")) for i in range(stages)]
    meta = [_meta("process_name", 0, {"name": f"run {run.id} {run.model}"})]
    for tid, name in tracks:
        meta.append(_meta("thread_name", tid, {"name": name}))
        meta.append(_meta("thread_sort_index", tid, {"sort_index": tid}))
    return meta


def _meta(name: str, tid: int, args: dict) -> dict:
    """A metadata ("M") event: names and order of the process and its tracks."""
    return {"name": name, "ph": "M", "pid": PID, "tid": tid, "args": args}


def chrome_trace(run: ClusterRun) -> dict:
    """The run's steps as a Chrome trace (JSON object format)."""
    stages = max((len(s.forward_ms) for s in run.steps), default=0)
    events = _track_names(run, stages)
    step_events: list[dict] = []
    run_end = 0
    for step in run.steps:
        start = _ns(step.start_ms)
        ends = [_ns(a) + _ns(f) for a, f in zip(step.stage_start_ms, step.forward_ms, strict=True)]
        end = max([start + _ns(step.wall_ms), *ends])
        run_end = max(run_end, end)
        args = {"step": step.step, "positions": step.positions, "wall_ms": step.wall_ms}
        step_events.append(_slice(_step_name(run, step), COORDINATOR_TID, start, end, "step", args))
        for stage in range(len(step.forward_ms)):
            step_events.extend(_stage_slices(run, step, stage))
    for r in run.recoveries:
        start, back = _ns(r.start_ms), _ns(r.start_ms + r.waited_ms)
        end = back + _ns(r.replay_ms)
        run_end = max(run_end, end)
        args = {"addr": r.addr, "new_addr": r.new_addr, "at_position": r.at_position,
                "waited_ms": r.waited_ms, "replayed_positions": r.replayed_positions,
                "replay_ms": r.replay_ms}  # fmt: skip
        step_events.append(_slice(f"waiting for stage {r.stage}", r.stage + 1, start, back, "recovery", args))
        step_events.append(_slice("replay", r.stage + 1, back, end, "recovery", args))
    if run.steps:
        events.append(_slice(f"run {run.id}", COORDINATOR_TID, 0, run_end, "run", {"status": run.status}))
    events.extend(step_events)
    decode_steps = sum(1 for s in run.steps if s.step)
    note = "every forward of the run is here"
    if run.steps_omitted:
        note = (f"decode steps 1..{run.steps_omitted} left out: a run keeps its first forward "
                f"and its last {KEPT_STEPS} decode steps")  # fmt: skip
    other = {"run": run.id, "model": run.model, "status": run.status,
             "clock": "the coordinator's monotonic clock, µs after the run started",
             "decode_steps_kept": decode_steps, "steps_omitted": run.steps_omitted, "note": note}  # fmt: skip
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


async def trace(request: web.Request) -> web.Response:
    """The run `{id}` as a Chrome trace; a run still going is drawn as far as it has got."""
    run = await run_by_id(request)
    if run.status == "running":  # its record still grows on the event loop: read it there
        return json_response(chrome_trace(run))
    return await json_off_loop(lambda: chrome_trace(run))


def setup(app: web.Application) -> None:
    """Add GET /runs/{id}/trace."""
    app.router.add_get("/runs/{id}/trace", trace)
