"""Even split vs measured plan, side by side: each stage's decode time through real workers.

`even_vs_measured()` times each layer once (as `--plan measured` does), then
launches the model on the even split and on the measured one at the same
time and runs the same greedy decode through both, a token through one then
a token through the other, so both meet the same load on a busy host. It
reports per stage the predicted and the measured decode ms per token (the
median of the workers' compute_ms over the steps), and the slowest stage over
the mean: the figure a measured plan must bring to 1.10 or less at 3 stages. Beside them,
`stage_check_ms`: each whole stage timed in one process as the layers were
(the lesser of wall and CPU time per step), which a busy host does not blur.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys

import msgspec
import numpy as np

from bench.model import MODEL, prompt_ids
from coordinator.launch.base import local_env
from coordinator.launch.local import Launcher
from coordinator.plan.calibration import head_of, imbalance, measure, measure_stages
from coordinator.plan.split import split, split_by_cost, stage_costs
from coordinator.stages.chain import ForwardRequest
from coordinator.stages.pipeline import Pipeline
from coordinator.stages.supervisor import launch_pipeline
from coordinator.stats import StageTiming
from workers import models
from workers.protocol.info import BatchItem
from workers.protocol.report import LayerRange


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
    calibrate_env = local_env(stages) | (env or {})
    costs = await measure(model, precision, calibrate_env, timeout=600.0)
    head = head_of(costs)
    plans = {"even": split(info.n_layers, stages), "measured": split_by_cost(costs.layers, stages, head=head)}
    # Whole stages timed as the layers were: where a busy host makes the workers' wall times noise,
    # this still shows whether a split's stages cost what its layers add up to.
    checked = {name: await measure_stages(model, precision, ranges, calibrate_env, timeout=600.0)
               for name, ranges in plans.items()}  # fmt: skip
    # Each launcher gives its workers the threads of one of its own stages: one pipeline computes at a time.
    launchers = {name: Launcher(model, precision, extra_env=env) for name in plans}
    pipelines: dict[str, Pipeline] = {}
    try:
        for name, ranges in plans.items():
            pipelines[name] = await launch_pipeline(launchers[name], info, ranges)
        compute = await _decode_in_turn(pipelines, prompt_ids(prompt_tokens, model), new_tokens)
    finally:
        for pipeline in pipelines.values():
            await pipeline.close()
    result: dict = {"model": model, "stages": stages, "precision": precision, "new_tokens": new_tokens,
                    "layer_ms": costs.layers, "stage_ms": costs.stage_ms, "head_ms": costs.head_ms,
                    "head_rows": costs.head_rows}  # fmt: skip
    for name, ranges in plans.items():
        predicted = stage_costs(costs.layers, ranges, costs.stage_ms, head)
        result[name] = _figures(ranges, predicted, checked[name].ms, compute[name])
    # Figures of a shared host move with what else runs: the 1, 5 and 15 minute load beside them.
    result["load_average"] = [round(load, 2) for load in os.getloadavg()]
    return result


async def _decode_in_turn(pipelines: dict[str, Pipeline], ids: np.ndarray, new_tokens: int) -> dict:
    """Prefill `ids` in each pipeline, then decode greedily a token in each in turn; compute_ms per stage."""
    compute = {name: [[] for _ in p.nodes] for name, p in pipelines.items()}
    tokens: dict[str, int] = {}
    for name, pipeline in pipelines.items():
        await pipeline.forward(ForwardRequest(BatchItem(ids[:8], "warm-up", 0, last_only=True)))
        await pipeline.reset("warm-up")
        logits = await pipeline.forward(ForwardRequest(BatchItem(ids, "bench", 0, last_only=True)))
        tokens[name] = int(np.argmax(logits[-1]))
    for step in range(new_tokens):
        for name, pipeline in pipelines.items():

            def record(t: StageTiming, taken: list[list[float]] = compute[name]) -> None:
                taken[t.stage].append(t.compute_ms)

            x = np.array([tokens[name]], dtype=np.int32)
            item = BatchItem(x, "bench", len(ids) + step, last_only=True)
            logits = await pipeline.forward(ForwardRequest(item, on_stage=record))
            tokens[name] = int(np.argmax(logits[-1]))
    for pipeline in pipelines.values():
        await pipeline.reset("bench")
    return compute


def _figures(
    ranges: list[LayerRange], predicted: list[float], checked: list[float], compute: list[list[float]]
) -> dict:
    """One plan's split; per stage its predicted, checked and measured ms per token; how uneven each is."""
    measured = [statistics.median(ms) for ms in compute]
    return {
        "ranges": [str(r) for r in ranges],
        "predicted_ms": [round(ms, 2) for ms in predicted],
        "predicted_slowest_over_mean": round(imbalance(predicted), 3),
        "stage_check_ms": [round(ms, 2) for ms in checked],
        "stage_check_slowest_over_mean": round(imbalance(checked), 3),
        "compute_ms": [round(ms, 2) for ms in measured],
        "slowest_over_mean": round(imbalance(measured), 3),
    }


if __name__ == "__main__":
    # `python -m bench.planner [PRECISION…]`: a line of JSON per precision, packed and f32 when none is named.
    for precision in sys.argv[1:] or ["packed", "f32"]:
        print(msgspec.json.encode(asyncio.run(even_vs_measured(precision=precision))).decode(), flush=True)
