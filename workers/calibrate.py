"""Time each layer of a model at decode: the measured cost a planner balances.

`python -m workers.calibrate --model M --precision P` prints one JSON line,
the `Costs`. Each layer is built as a stage of its own, so the first layer's
cost includes the token embedding (always the first stage's, whatever the
split) and the last layer's the final norm. The head is timed apart, as a
stage of head rows only (`head_ms`), so that a planner may cut its rows
across stages: on Gemma 3 its 262k rows are most of a decode step. Layers
are loaded a chunk at a time, within a memory budget, so no process needs the
whole model; within a chunk each decode step goes through every layer in
turn, and a layer of weights worth caching finds them emptied from the caches
before its forward, as inside a real stage, not warm from its own last step.

A stage's forward costs something whatever its layers (its RoPE tables, the
session's cache, the call itself: ~0.1 ms a SmolLM2 packed stage), which every
layer timed alone counts once. So each chunk of several layers is also timed
as one stage, and what its layers alone add up to beyond it, per layer beyond
the first, is that fixed cost (`stage_ms`), taken off every layer's: a stage
then costs stage_ms plus its layers'. Left in, twelve layers looked 1.3 ms
dearer than the stage of them, and the planner gave the head's stage too many.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import msgspec
import numpy as np

from workers.models import build, describe
from workers.models.quants import ROWS
from workers.protocol.info import ModelInfo
from workers.protocol.report import HeadRows, LayerRange
from workers.stage import Stage

PROMPT = 32
STEPS = 16
# How a layer is timed; bumped when that changes, so costs kept from another method are measured again.
# 2: with the kernel threads a worker's forwards get (workers.models.kernels.set_threads, for the process).
# 3: a stage's fixed cost (stage_ms) measured and taken off each layer's.
# 4: the head timed apart from the last layer (head_ms), so that a planner may cut it.
# 5: a joiner's sample times a run of middle layers as one stage, out of cache as a served stage is.
# 6: the last-level cache emptied before each timed forward (see _evict).
# 7: the stages taken in a new order each step (see _decode_ms).
METHOD = 7
BUDGET_BYTES = 1 << 30
# Middle layers a joiner's sampled calibration times as one stage (see measure_sampled).
SAMPLED_RUN = 8
SESSION = "calibrate"
# A stage this small keeps no weights in a cache worth emptying (a test's tiny model): not evicted.
EVICT_PARAMS = 1 << 20
LLC_BYTES = 32 << 20  # the last-level cache where the CPU does not say
# What _evict writes through: made at its first use, dropped when the measuring that used it ends
# (_evicting), or a joiner that measured its host would hold twice the cache all its life. Kept across
# a measuring's timed calls: made again for each, its pages cost 2 s a call on a 480 MB L3.
_junk: np.ndarray | None = None


class Costs(msgspec.Struct, frozen=True):
    """What each layer of a model costs per decoded token, measured.

    layers: milliseconds of a decode step through each layer within a stage:
        the median over the steps of each step's wall or CPU time, whichever
        is less, through the layer alone, less stage_ms; the first includes
        the embedding, the last the final norm and the head.
    precision: the precision the layers were built in.
    prompt: positions each layer held before the timed steps.
    steps: decode steps timed per layer (after one more to warm up).
    stage_ms: what a decode step costs a stage beyond its layers, once per stage (0 when no chunk
        had two layers to tell it by).
    head_ms: when head_rows is not 0, what a decode step through all the head's rows costs, which
        the last layer's cost then leaves out (it keeps the final norm): a planner may cut the head.
    head_rows: the head's rows (the vocabulary); 0 for a model without a head to cut.
    """

    layers: list[float]
    precision: str
    prompt: int = PROMPT
    steps: int = STEPS
    stage_ms: float = 0.0
    head_ms: float = 0.0
    head_rows: int = 0


class StageCosts(msgspec.Struct, frozen=True):
    """What whole stages cost per decoded token, measured as `Costs` measures layers.

    ranges: the stages' layers.
    ms: milliseconds of a decode step through each stage, as `Costs.layers`.
    """

    ranges: list[LayerRange]
    ms: list[float]


@contextmanager
def _evicting() -> Iterator[None]:
    """Around a measuring: the buffer _evict made is dropped at its end, given back to the system."""
    global _junk
    try:
        yield
    finally:
        _junk = None


@_evicting()
def measure_stages(
    spec: str, precision: str, ranges: list[LayerRange], prompt: int = PROMPT, steps: int = STEPS
) -> StageCosts:
    """Time whole stages, all built at once: a check of a split's predicted times, not a calibration."""
    info = describe(spec)
    prompt = max(1, min(prompt, info.context_length - steps - 1))
    ms = _decode_ms([build(spec, r, precision) for r in ranges], info, prompt, steps)
    return StageCosts(ranges=ranges, ms=[round(t, 4) for t in ms])


@_evicting()
def measure(
    spec: str, precision: str, prompt: int = PROMPT, steps: int = STEPS, budget: int = BUDGET_BYTES
) -> Costs:
    """Time every layer of the model `spec` names, built in `precision`, a chunk of layers at a time."""
    info = describe(spec)
    prompt = max(1, min(prompt, info.context_length - steps - 1))
    layers: list[float] = []
    beyond, counted = 0.0, 0  # what chunks' layers alone add up to beyond each chunk as one stage
    for chunk in _chunks(spec, precision, info.n_layers, budget):
        stages = [build(spec, LayerRange(i, i + 1), precision) for i in chunk]
        alone = _decode_ms(stages, info, prompt, steps)
        del stages  # before the chunk is built as one stage, or the next chunk
        layers += alone
        if len(chunk) > 1:
            [together] = _decode_ms(
                [build(spec, LayerRange(chunk.start, chunk.stop), precision)], info, prompt, steps
            )
            beyond += sum(alone) - together
            counted += len(chunk) - 1
    # Each layer alone counted a stage's fixed cost once; no layer costs less than nothing.
    fixed = min(max(0.0, beyond / counted), min(layers)) if counted else 0.0
    head_ms = 0.0
    if info.input == "tokens" and info.vocab > 4 * ROWS:
        layers[-1], head_ms = _head_ms(spec, precision, info, prompt, steps, fixed)
    return Costs(
        layers=[round(ms - fixed, 4) for ms in layers],
        precision=precision,
        prompt=prompt,
        steps=steps,
        stage_ms=round(fixed, 4),
        head_ms=round(head_ms, 4),
        head_rows=info.vocab if head_ms else 0,
    )


@_evicting()
def measure_sampled(spec: str, precision: str, prompt: int = PROMPT, steps: int = STEPS) -> Costs:
    """Time a middle layer alone, a run of middle layers as one stage, and the last with its head.

    What a joining worker measures of its own host: three small stages rather than
    one per layer. The blocks of a transformer hold the same tensors, so a middle
    layer stands for every one before the last (the first's embedding is a row's
    lookup at decode); the last is timed with the final norm and the whole head,
    as a joined last stage holds it. What the run adds to the layer alone, per
    layer, is a layer's cost; what the layer alone costs beyond that is the
    stage's fixed cost, as `measure` tells it from a chunk.

    A run of SAMPLED_RUN layers, not two: a layer or two of SmolLM2 (3.5 MB each) stay in this
    machine's 32 MB L3 cache from one step to the next, which a stage of ten does not, and two
    layers alone made its layers 0.16 ms where a stage of ten takes 0.21 ms a layer (a plan of
    three stages then predicted 30% less than a step took). A run of eight takes 0.21.
    """
    info = describe(spec)
    n = info.n_layers
    if n < 3:
        return measure(spec, precision, prompt, steps)
    prompt = max(1, min(prompt, info.context_length - steps - 1))
    run = min(SAMPLED_RUN, n - 1)
    first = max(0, min(n // 2 - run // 2, n - 1 - run))  # the run lies among the layers before the last

    def alone(layers: LayerRange) -> float:
        return _decode_ms([build(spec, layers, precision)], info, prompt, steps)[0]

    one, many, last = alone(LayerRange(first, first + 1)), alone(LayerRange(first, first + run)), alone(
        LayerRange(n - 1, n))  # fmt: skip
    layer = max(0.0, many - one) / (run - 1)
    fixed = min(max(0.0, one - layer), one, last)
    return Costs(
        layers=[round(layer, 4)] * (n - 1) + [round(last - fixed, 4)],
        precision=precision,
        prompt=prompt,
        steps=steps,
        stage_ms=round(fixed, 4),
    )


def _head_ms(
    spec: str, precision: str, info: ModelInfo, prompt: int, steps: int, fixed: float
) -> tuple[float, float]:
    """The last layer's decode ms with the final norm but none of the head, and the whole head's.

    Timed as a cut head runs: the last layer with the head's first group of rows, and two stages of
    head rows only, of one group and of all the others. What a stage of rows only costs beyond its
    rows (a call, its output's copy) is not a layer stage's fixed cost, so a row's cost is told by the
    difference of the two; the first group is then taken off the last layer at that rate.
    """
    n, vocab = info.n_layers, info.vocab

    def alone(layers: LayerRange) -> float:
        # Each alone, as each runs in a process of its own when the head is cut: taking turns here,
        # the head's rows (most of a cache's worth) would evict the last layer's weights between steps.
        return _decode_ms([build(spec, layers, precision)], info, prompt, steps)[0]

    last = alone(LayerRange(n - 1, n, HeadRows(0, ROWS)))
    group = alone(LayerRange(n, n, HeadRows(ROWS, 2 * ROWS)))
    rest = alone(LayerRange(n, n, HeadRows(ROWS, vocab)))
    per_row = max(0.0, rest - group) / (vocab - 2 * ROWS)
    return max(fixed, last - ROWS * per_row), per_row * vocab


def _chunks(spec: str, precision: str, n_layers: int, budget: int) -> list[range]:
    """Consecutive layers whose stages together stay within `budget` bytes (at least one layer each)."""
    from workers.models.footprint import footprint  # imports gguf: only when calibrating

    held = footprint(spec, precision)
    chunks, start, used = [], 0, 0
    for i in range(n_layers):
        size = held.stage_bytes(LayerRange(i, i + 1))
        if i > start and used + size > budget:
            chunks.append(range(start, i))
            start, used = i, 0
        used += size
    chunks.append(range(start, n_layers))
    return chunks


def _decode_ms(stages: list[Stage], info: ModelInfo, prompt: int, steps: int) -> list[float]:
    """Each stage's milliseconds per decode step, the stages taken in turn every step (in a new order
    each step), each forward after the cache is emptied of its weights (_evict).

    A step counts the lesser of its wall time and the CPU time this process
    spent in it: on a loaded machine the wall time also counts the waits for a
    core, which a long step meets more often than a short one (a head looked
    3x dearer than it is beside its layers), while on several threads the CPU
    time adds up past the wall time. The median over the steps then drops the
    odd step that met a cache or page miss.
    """
    rng = np.random.default_rng(0)
    times: list[list[float]] = [[] for _ in stages]
    # The positions before the timed steps are filled a row at a time: only the decode path is ever
    # run, so a kernel that a prefill's many rows would take (and compile) costs nothing here.
    for pos in range(prompt):
        for stage in stages:
            stage.forward(_input(stage, info, 1, rng), session=SESSION, start_pos=pos, last_only=True)
    for step in range(steps + 1):
        # In a new order each step: whatever a forward leaves the next to pay (a time slice or a CPU
        # quota it used up, which a virtual machine may count as the next one's CPU time) then falls on
        # layers at random, which the median drops, not always on the layer after the dearest one. The
        # order is nothing to the caches: a stage large enough to keep weights in them finds them
        # emptied (_evict).
        for i in rng.permutation(len(stages)):
            stage, taken = stages[i], times[i]
            x = _input(stage, info, 1, rng)
            if stage.n_params >= EVICT_PARAMS:
                _evict()
            wall, cpu = time.perf_counter(), time.process_time()
            stage.forward(x, session=SESSION, start_pos=prompt + step, last_only=True)
            if step:  # the first step warms up
                taken.append(min(time.perf_counter() - wall, time.process_time() - cpu) * 1000)
    for stage in stages:
        stage.reset(SESSION)
    return [statistics.median(taken) for taken in times]


def last_cache_bytes() -> int:
    """The CPU's last-level cache, as sysfs tells it of cpu0 (LLC_BYTES where it does not)."""
    sizes = {}
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        with suppress(OSError, ValueError):
            size = (index / "size").read_text().strip()
            scale = {"K": 1 << 10, "M": 1 << 20}.get(size[-1:], 1)
            sizes[int((index / "level").read_text())] = int(size.rstrip("KM")) * scale
    return sizes[max(sizes)] if sizes else LLC_BYTES


def _evict() -> None:
    """Write a line of every 64 bytes of a buffer twice the last-level cache: what the cache held is gone.

    A served stage's weights do not wait in the cache for its next token: between two of its forwards
    the other stages, the coordinator and its host's other work run, and on a machine that hosts several
    stages they stream their own weights through the same cache. Timed back to back, a run of eight
    SmolLM2 layers (18 MB) stayed partly in this machine's 32 MB L3: the sample made its layers 0.14
    ms, where a stage of sixteen takes 0.18, and a plan's three stages were predicted at 6.4 ms a token
    where they computed for 9.0 served. Emptied first, the sample's layers give each of those stages
    within 3% of the stage timed whole.
    """
    global _junk
    if _junk is None:
        _junk = np.zeros(2 * last_cache_bytes(), dtype=np.uint8)
    _junk[::64] += 1


def _input(stage: Stage, info: ModelInfo, rows: int, rng: np.random.Generator) -> np.ndarray:
    """What the stage takes: token ids on a language model's first stage, else hidden states."""
    if stage.layers.is_first and info.input == "tokens":
        return rng.integers(0, info.vocab, rows, dtype=np.int32)  # (T,)
    r = stage.layers
    before = r.head.start if r.head is not None and len(r) == 0 else 0  # head rows only: logits before them
    return rng.standard_normal((rows, info.hidden + before), dtype=np.float32)  # (T, hidden + before)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m workers.calibrate", description=__doc__)
    p.add_argument("--model", required=True, help="the model spec, as the workers are given it")
    p.add_argument("--precision", default="f32", help="the precision the workers build in")
    p.add_argument("--prompt", type=int, default=PROMPT, help="positions held before the timed steps")
    p.add_argument("--steps", type=int, default=STEPS, help="decode steps timed per layer")
    p.add_argument("--budget-mb", type=int, default=BUDGET_BYTES >> 20, help="memory for layers at once")
    p.add_argument("--stages", default="", help="time these whole stages instead (a..b,c..d), all at once")
    args = p.parse_args(argv)
    if args.prompt < 1 or args.steps < 1 or args.budget_mb < 1:
        p.error("--prompt, --steps and --budget-mb must be at least 1")
    try:
        if args.stages:
            ranges = [LayerRange.parse(r) for r in args.stages.split(",")]
            costs = measure_stages(args.model, args.precision, ranges, args.prompt, args.steps)
        else:
            costs = measure(args.model, args.precision, args.prompt, args.steps, args.budget_mb << 20)
    except ValueError as exc:  # ModelSpecError, a precision the model does not take, a bad range
        print(f"calibrate: {exc}", file=sys.stderr)
        sys.exit(2)
    sys.stdout.write(msgspec.json.encode(costs).decode() + "\n")


if __name__ == "__main__":
    main()
