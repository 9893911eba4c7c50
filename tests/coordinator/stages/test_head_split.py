"""A head cut across stages through real worker processes: the logits one stage gives, bitwise."""

from __future__ import annotations

import asyncio
import itertools
import os

import numpy as np
import pytest

from coordinator.launch.local import Launcher
from coordinator.stages.chain import ForwardRequest
from coordinator.stages.pipeline import StageFailed
from coordinator.stages.supervisor import launch_pipeline
from tests.support.tiny_gguf import TinyLlama, tiny_arch, write_tiny_arch, write_tiny_llama
from workers import models
from workers.protocol.info import BatchItem
from workers.protocol.report import HeadRows, LayerRange

PROMPT = np.arange(5, 17, dtype=np.int32)
DECODE = [3, 7]


def cut(n: int, vocab: int, rows: list[int], layers_before: int) -> list[LayerRange]:
    """Layers 0..layers_before, then the rest with the head's first rows, then stages of head rows only."""
    ends = [*rows, vocab]
    first = [LayerRange(0, layers_before)] if layers_before else []
    return [*first, LayerRange(layers_before, n, HeadRows(0, ends[0]))] + [
        LayerRange(n, n, HeadRows(a, b)) for a, b in itertools.pairwise(ends)
    ]


def steps(last_only: bool) -> list[tuple[np.ndarray, int, bool]]:
    """The prompt, then a decode step per token of DECODE: (ids, start position, last_only)."""
    return [(PROMPT, 0, last_only)] + [
        (np.array([t], np.int32), len(PROMPT) + i, True) for i, t in enumerate(DECODE)
    ]


def one_stage_logits(path: str, last_only: bool) -> list[bytes]:
    stage = models.build(path, LayerRange(0, models.describe(path).n_layers), "packed")
    return [
        stage.forward(x, session="one", start_pos=pos, last_only=lo).tobytes()
        for x, pos, lo in steps(last_only)
    ]


def write(model: str, path) -> str:
    """Tiny Gemma 3 (a tied head, its table float32: a float32 product), or tiny llama (an untied Q8_0
    head, multiplied on its blocks)."""
    if model == "llama":
        write_tiny_llama(path, TinyLlama(), blocks=True)
    else:
        write_tiny_arch(path, tiny_arch(model), "q8_0")
    return str(path)


# The prompt of the float32 head is taken last row only: a (12, rows) BLAS product of a slice may
# round a logit otherwise than the whole table's (12, vocab) product does, where one row is a dot
# product per logit, the same however the table is cut. Two workers each, as each costs a process.
@pytest.mark.parametrize(("model", "last_only"), [("gemma3", True), ("llama", False)])
async def test_a_head_cut_across_worker_processes_gives_the_logits_of_one_stage_bitwise(
    tmp_path, monkeypatch, model, last_only
):
    # The workers multiply with the BLAS threads of this process, so that the last bits may agree.
    threads = os.environ.get("OPENBLAS_NUM_THREADS") or str(len(os.sched_getaffinity(0)))
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", threads)
    path = write(model, tmp_path / f"{model}.gguf")
    info = models.describe(path)
    expected = one_stage_logits(path, last_only)
    ranges = cut(info.n_layers, info.vocab, [32], 0)
    pipeline = await launch_pipeline(Launcher(path, "packed", build_timeout=60.0), info, ranges)
    try:
        assert [node.report.layers for node in pipeline.nodes] == ranges
        for step, (x, pos, lo) in enumerate(steps(last_only)):
            request = ForwardRequest(BatchItem(x, "cut", pos, last_only=lo))
            out = await asyncio.wait_for(pipeline.forward(request), 60)
            assert out.shape == (1 if lo else len(x), info.vocab)
            assert out.tobytes() == expected[step], f"step {step} differs"
    finally:
        await pipeline.close()


# Cuts on the planner's row groups (32 rows): a float32 head's one-row products (BLAS gemv) give a
# slice's logits bitwise only there; the packed kernels' rows are each their own, cut anywhere.
ROW_CUTS = {"gemma3": [64, 160], "llama": [16, 32]}


@pytest.mark.parametrize(("model", "last_only"), [("gemma3", True), ("llama", False)])
def test_a_head_cut_over_several_stages_gives_one_stages_logits_bitwise_one_session_or_a_batch(
    tmp_path, model, last_only
):
    path = write(model, tmp_path / f"{model}.gguf")
    info = models.describe(path)
    expected = one_stage_logits(path, last_only)
    # Layers, then the last layers with the first rows, then two stages of head rows only.
    ranges = cut(info.n_layers, info.vocab, ROW_CUTS[model], info.n_layers // 2)
    stages = [models.build(path, r, "packed") for r in ranges]
    for step, (x, pos, lo) in enumerate(steps(last_only)):
        for stage in stages:
            x = stage.forward(x, session="cut", start_pos=pos, last_only=lo)
        assert x.tobytes() == expected[step], f"step {step} differs"
    # Two sessions' decode rows at once, as a batch goes through the stages (the batched products).
    whole = models.build(path, LayerRange(0, info.n_layers), "packed")
    for session in ("a", "b"):
        for pipeline in ([whole], stages):
            x = PROMPT
            for stage in pipeline:
                x = stage.forward(x, session=session, start_pos=0, last_only=True)
    items = [BatchItem(np.array([t], np.int32), s, len(PROMPT), True) for s, t in (("a", 3), ("b", 9))]
    want = whole.forward_batch(items)
    for stage in stages:
        items = [
            BatchItem(out, i.session, i.start_pos, True)
            for i, out in zip(items, stage.forward_batch(items), strict=True)
        ]
    assert [i.x.tobytes() for i in items] == [w.tobytes() for w in want]


async def test_a_pipeline_whose_head_rows_do_not_follow_is_refused_before_any_worker_starts(tmp_path):
    path = tmp_path / "llama.gguf"
    write_tiny_llama(path, TinyLlama())
    info = models.describe(str(path))
    n = info.n_layers
    gap = [LayerRange(0, n, HeadRows(0, 16)), LayerRange(n, n, HeadRows(20, info.vocab))]
    with pytest.raises(StageFailed, match=rf"stage 1's head rows 20\.\.{info.vocab} do not follow row 16"):
        await launch_pipeline(Launcher(str(path), "packed"), info, gap)
