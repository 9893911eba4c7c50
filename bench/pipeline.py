"""The same prefill and decode as bench/model.py, through local worker processes."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from bench.model import MODEL, greedy, prompt_ids
from bench.rawsocket import framed_round_trips, round_trips
from coordinator.launch.local import Launcher
from coordinator.plan.split import split
from coordinator.stages.chain import ForwardRequest, no_hook
from coordinator.stages.pipeline import Pipeline
from coordinator.stages.supervisor import launch_pipeline
from coordinator.stats import StageTiming
from workers import models
from workers.protocol.info import BatchItem
from workers.protocol.report import LayerRange


async def through_workers(
    stages: int = 3,
    precision: str = "f32",
    prompt_tokens: int = 128,
    new_tokens: int = 32,
    model: str = MODEL,
    reps: int = 1,
    env: dict[str, str] | None = None,
    ranges: list[LayerRange] | None = None,
) -> dict:
    """Launch `stages` workers (`env` added to theirs); time a prefill, `new_tokens` steps, best of `reps`.

    ranges: the stages' layers (and head rows), e.g. a measured plan's; an even split when None.
    """
    info = models.describe(model)
    launcher = Launcher(model, precision, extra_env=env)
    pipeline = await launch_pipeline(launcher, info, ranges or split(info.n_layers, stages))
    try:
        ids = prompt_ids(prompt_tokens, model)
        await pipeline.forward(ForwardRequest(BatchItem(ids[:8], "warm-up", 0, last_only=True)))
        await pipeline.reset("warm-up")
        best: dict | None = None
        for rep in range(reps):
            timed = await _greedy_run(pipeline, ids, new_tokens, session=f"bench-{rep}")
            if best is None or _total_ms(timed) < _total_ms(best):
                best = timed
        assert best is not None
        return {
            "model": model,
            "stages": stages,
            "precision": pipeline.nodes[0].report.precision,
            "prompt_tokens": prompt_tokens,
            "new_tokens": new_tokens,
            "build_ms": [n.report.build_ms for n in pipeline.nodes],
            "resident_bytes": [n.report.resident_bytes for n in pipeline.nodes],
            **best,
        }
    finally:
        await pipeline.close()


async def _greedy_run(pipeline: Pipeline, ids: np.ndarray, new_tokens: int, session: str) -> dict:
    """`greedy` through the pipeline, with each stage's forward time summed over the decode steps."""
    stage_ms = [0.0] * len(pipeline.nodes)

    def add(t: StageTiming) -> None:
        stage_ms[t.stage] += t.forward_ms

    async def forward(x: np.ndarray, start_pos: int) -> np.ndarray:
        record = add if start_pos >= len(ids) else no_hook
        return await pipeline.forward(
            ForwardRequest(BatchItem(x, session, start_pos, last_only=True), record)
        )

    timed = await greedy(forward, ids, new_tokens)
    await pipeline.reset(session)
    return timed | {"decode_stage_ms": [round(ms, 1) for ms in stage_ms]}


def _total_ms(timed: dict) -> float:
    return timed["prefill_ms"] + timed["decode_ms"]


async def hop_overhead(
    delay_ms: float = 6.0, stages: int = 3, forwards: int = 200, hidden: int = 576
) -> dict:
    """forward_ms − compute_ms per hop of stages that only sleep `delay_ms`, beside a bare socket's.

    The activations are `hidden` floats wide (576: SmolLM2's, one decode row);
    the raw figure is a loopback TCP round trip of the same bytes to another
    process, measured here too, and `raw_held` the same with the echo holding
    each message `delay_ms` (its hold left out), so that both ends wake from an
    idle wait as a pipeline's do; `framed_echo` is a round trip of the wire's
    frames (a Forward, its Result) to a process that only echoes them, Python
    framing at both ends and nothing else (bench.rawsocket). `chain_ms` is what a forward costs beyond its
    stages' forward_ms (handing it to a forward thread and back, each stage's
    hook on the event loop); `stage_share` is how much of the forward's wall
    time the stages' forward_ms account for.
    """
    model = f"fake:layers={stages},hidden={hidden},delay_ms={delay_ms}"
    info = models.describe(model)
    pipeline = await launch_pipeline(Launcher(model), info, split(info.n_layers, stages))
    try:
        x = np.ones((1, info.hidden), np.float32)
        await pipeline.forward(ForwardRequest(BatchItem(x, "warm-up", 0)))
        gaps: list[float] = []
        chain: list[float] = []
        share: list[float] = []
        for _ in range(forwards):
            timings: list[StageTiming] = []
            started = time.monotonic()
            await pipeline.forward(ForwardRequest(BatchItem(x, "hop", 0), timings.append))
            wall = (time.monotonic() - started) * 1000
            stages_ms = sum(t.forward_ms for t in timings)
            gaps += [t.forward_ms - t.compute_ms for t in timings]
            chain.append(wall - stages_ms)
            share.append(stages_ms / wall)
    finally:
        await pipeline.close()
    raw = await asyncio.to_thread(round_trips, x.nbytes, forwards)
    # The same, the echo holding each message as long as a stage sleeps: both ends wake from idle.
    held = await asyncio.to_thread(round_trips, x.nbytes, forwards, delay_ms) if delay_ms else raw
    framed = await asyncio.to_thread(framed_round_trips, x.nbytes, forwards)
    return {
        "stage_sleep_ms": delay_ms,
        "stages": stages,
        "payload_bytes": x.nbytes,
        "hop_ms_p50": _pct(gaps, 50),
        "hop_ms_p90": _pct(gaps, 90),
        "hop_ms_mean": round(float(np.mean(gaps)), 3),
        "raw_socket_ms_p50": _pct(raw, 50),
        "raw_socket_ms_p90": _pct(raw, 90),
        "raw_held_ms_p50": _pct(held, 50),
        "raw_held_ms_p90": _pct(held, 90),
        "framed_echo_ms_p50": _pct(framed, 50),
        "chain_ms_p50": _pct(chain, 50),
        "stage_share_p50": round(float(np.percentile(share, 50)), 3),
    }


def hop_line(name: str, hop: dict) -> str:
    """hop_overhead's figures on one line, each beside the raw socket's."""
    held = ""
    if hop["stage_sleep_ms"]:
        hold, p50 = hop["stage_sleep_ms"], hop["raw_held_ms_p50"]
        held = f" (the echo holding {hold:g} ms, less its hold: p50 {p50} ms)"
    return (
        f"hop ({name}): forward_ms - compute_ms per stage p50 {hop['hop_ms_p50']} ms,"
        f" p90 {hop['hop_ms_p90']} ms | raw loopback round trip of the same {hop['payload_bytes']} bytes"
        f" p50 {hop['raw_socket_ms_p50']} ms, p90 {hop['raw_socket_ms_p90']} ms{held}"
        f" | the same as the wire's frames, echoed with no stage: p50 {hop['framed_echo_ms_p50']} ms"
        f" | a forward's wall beyond its stages p50 {hop['chain_ms_p50']} ms"
    )


def _pct(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)), 3)
