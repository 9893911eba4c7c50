"""Even split vs measured plan, side by side: each stage's decode time through real workers.

`even_vs_measured()` times each layer once (as `--plan measured` does), then
launches the model on the even split and on the measured one in turn, runs
the same greedy decode through each, and reports per stage the predicted and
the measured decode ms per token, with the slowest stage over the mean: the
figure issue 12 targets (<= 1.10 at 3 stages).
"""

from __future__ import annotations

import asyncio
import statistics
import sys

import msgspec
import numpy as np

from bench.model import MODEL, prompt_ids
from coordinator.calibration import imbalance, measure, worker_env
from coordinator.launcher import Launcher
from coordinator.pipeline import Pipeline
from coordinator.planner import split, split_by_cost, stage_costs
from coordinator.stats import StageTiming
from workers import models
from workers.report import LayerRange
from workers.stage import ModelInfo


async def even_vs_measured(
    stages: int = 3,
    precision: str = "packed",
    prompt_tokens: int = 128,
    new_tokens: int = 32,
    model: str = MODEL,
    env: dict[str, str] | None = None,
) -> dict:
    """Measure each layer, then decode through the even and the measured split; per-stage ms per token."""
    info = models.describe(model)
    costs = await measure(model, precision, worker_env(model, precision, stages) | (env or {}), timeout=600.0)
    plans = {"even": split(info.n_layers, stages), "measured": split_by_cost(costs.layers, stages)}
    result: dict = {"model": model, "stages": stages, "precision": precision, "new_tokens": new_tokens,
                    "layer_ms": costs.layers}  # fmt: skip
    ids = prompt_ids(prompt_tokens, model)
    for name, ranges in plans.items():
        predicted = stage_costs(costs.layers, ranges)
        decoded = await _decode_per_stage(model, precision, env, info, ranges, ids, new_tokens)
        result[name] = {
            "ranges": [str(r) for r in ranges],
            "predicted_ms": [round(ms, 2) for ms in predicted],
            "predicted_slowest_over_mean": round(imbalance(predicted), 3),
            **decoded,
            "slowest_over_mean": round(imbalance(decoded["compute_ms"]), 3),
        }
    return result


async def _decode_per_stage(
    model: str,
    precision: str,
    env: dict[str, str] | None,
    info: ModelInfo,
    ranges: list[LayerRange],
    ids: np.ndarray,
    new_tokens: int,
) -> dict:
    """Launch workers on `ranges`, prefill, decode greedily; each stage's median compute and forward ms."""
    pipeline = await Pipeline.launch(Launcher(model, precision, extra_env=env), info, ranges)
    compute: list[list[float]] = [[] for _ in ranges]
    forward: list[list[float]] = [[] for _ in ranges]

    def record(t: StageTiming) -> None:
        compute[t.stage].append(t.compute_ms)
        forward[t.stage].append(t.forward_ms)

    try:
        await pipeline.forward(ids[:8], session="warm-up", start_pos=0, last_only=True)
        await pipeline.reset("warm-up")
        logits = await pipeline.forward(ids, session="bench", start_pos=0, last_only=True)
        for step in range(new_tokens):
            token = np.array([int(np.argmax(logits[-1]))], dtype=np.int32)
            logits = await pipeline.forward(
                token, session="bench", start_pos=len(ids) + step, last_only=True, on_stage=record
            )
        await pipeline.reset("bench")
    finally:
        await pipeline.close()
    return {
        "compute_ms": [round(statistics.median(ms), 2) for ms in compute],
        "forward_ms": [round(statistics.median(ms), 2) for ms in forward],
    }


if __name__ == "__main__":
    precision = sys.argv[1] if len(sys.argv) > 1 else "packed"
    print(msgspec.json.encode(asyncio.run(even_vs_measured(precision=precision))).decode())
