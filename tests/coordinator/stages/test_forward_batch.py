"""Batched forwards on the wire: several sessions' rows through real workers as one forward per stage."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from coordinator.stages.chain import ForwardRequest
from coordinator.stages.pipeline import StageFailed
from tests.support.tiny_gguf import TinyLlama, write_tiny_llama
from workers import models
from workers.fake import reference
from workers.models.synthetic import make_input
from workers.protocol.info import BatchItem

SYNTHETIC = "synthetic:layers=6,hidden=32,seed=3"


def synthetic_items() -> list[BatchItem]:
    """Three sessions of different lengths, positions and last_only."""
    return [
        BatchItem(make_input(3, 32, 1), "a", 0, False),
        BatchItem(make_input(1, 32, 2), "b", 7, True),
        BatchItem(make_input(4, 32, 3), "c", 2, True),
    ]


@pytest.mark.parametrize("stages", [1, 3])
async def test_a_batch_of_three_sessions_gives_the_rows_of_three_single_forwards_bitwise(launch, stages):
    pipeline = await launch(SYNTHETIC, stages)
    items = synthetic_items()
    outputs, timings = await asyncio.wait_for(pipeline.forward_batch(items), 30)
    for item, got in zip(items, outputs, strict=True):
        alone = await pipeline.forward(ForwardRequest(item))
        assert got.shape == alone.shape and got.tobytes() == alone.tobytes()
    assert [o.shape[0] for o in outputs] == [3, 1, 1]  # last_only cuts on the last stage only
    assert [t.stage for t in timings] == list(range(stages))
    assert all(t.forward_ms >= t.compute_ms > 0 for t in timings)


async def test_each_stage_reports_one_timing_for_the_whole_batch_as_it_finishes(launch):
    pipeline = await launch("fake:layers=4,delay_ms=30", 2)
    heard = []
    items = [BatchItem(np.full((1, 4), i, np.float32), f"s{i}", 0, True) for i in range(3)]
    outputs, timings = await asyncio.wait_for(pipeline.forward_batch(items, on_stage=heard.append), 10)
    assert heard == timings and len(timings) == 2
    # The fake stage sleeps per item: one batch of three is one compute of three sleeps, per stage.
    assert all(t.compute_ms >= 3 * 30 for t in timings)
    for item, got in zip(items, outputs, strict=True):
        np.testing.assert_array_equal(got, reference(item.x, range(4)))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_llama(path, TinyLlama())
    return str(path)


async def test_a_llama_batch_through_workers_equals_the_same_batch_in_one_process_bitwise(launch, tiny_llama):
    pipeline = await launch(tiny_llama, 2)
    local = [models.build(tiny_llama, node.layers, "f32") for node in pipeline.nodes]
    prompts = {"a": [3, 17, 5], "b": [8, 1], "c": [30, 2, 2, 11]}
    for session, prompt in prompts.items():  # each session's prefill alone, on both sides
        x = y = np.asarray(prompt, np.int32)
        await pipeline.forward(ForwardRequest(BatchItem(x, session, 0, last_only=True)))
        for stage in local:
            y = stage.forward(y, session=session, start_pos=0, last_only=True)
    items = [
        BatchItem(np.asarray([7 + i], np.int32), s, len(p), True) for i, (s, p) in enumerate(prompts.items())
    ]
    outputs, _ = await asyncio.wait_for(pipeline.forward_batch(items), 30)
    expected = items
    for stage in local:
        ys = stage.forward_batch(expected)
        expected = [
            BatchItem(y, i.session, i.start_pos, i.last_only) for i, y in zip(expected, ys, strict=True)
        ]
    for got, want in zip(outputs, expected, strict=True):
        assert got.shape == (1, TinyLlama().vocab) and got.tobytes() == want.x.tobytes()


async def test_a_stage_that_fails_a_batch_fails_it_naming_the_stage_and_stays_up(launch):
    pipeline = await launch("fake:layers=4,fail_on=1,stage=2", 2)
    items = [BatchItem(np.ones((1, 4), np.float32), "a", 0, False)]
    with pytest.raises(StageFailed, match=r"stage 1 .* failed: .*fake failure on forward 1"):
        await asyncio.wait_for(pipeline.forward_batch(items), 10)
    assert [n.state for n in pipeline.nodes] == ["up", "up"]
    outputs, _ = await asyncio.wait_for(pipeline.forward_batch(items), 10)
    np.testing.assert_array_equal(outputs[0], reference(items[0].x, range(4)))


async def test_a_batch_past_the_context_names_the_session(launch, tiny_llama):
    pipeline = await launch(tiny_llama, 1)
    items = [
        BatchItem(np.asarray([1], np.int32), "fits", 0, True),
        BatchItem(np.asarray([1, 2], np.int32), "beyond", TinyLlama().context_length - 1, True),
    ]
    with pytest.raises(StageFailed, match=r"session beyond: positions 31\.\.33 exceed the context length 32"):
        await asyncio.wait_for(pipeline.forward_batch(items), 10)


@pytest.mark.parametrize(
    ("items", "why"),
    [
        ([], "at least one item"),
        ([BatchItem(np.ones((1, 4), np.float32), "a", 0, True)] * 2, "each session once"),
        ([BatchItem(np.ones((0, 4), np.float32), "a", 0, True)], "sessions without: \\['a'\\]"),
    ],
)
async def test_a_batch_the_wire_would_refuse_is_refused_before_it_is_sent(launch, items, why):
    pipeline = await launch("fake:layers=2", 1)
    with pytest.raises(ValueError, match=why):
        await pipeline.forward_batch(items)
    assert pipeline.nodes[0].client.lost is None
    x = np.ones((1, 4), np.float32)
    np.testing.assert_array_equal(
        await pipeline.forward(ForwardRequest(BatchItem(x, "s", 0))), reference(x, range(2))
    )
