"""A llama stage's batched forward: several sessions' decode rows at once, each with its own cache."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.tiny_gguf import TinyLlama, write_tiny_llama
from workers import models
from workers.protocol.info import BatchItem
from workers.protocol.report import LayerRange
from workers.stage import StageError

PROMPTS = {"a": [3, 17, 5, 39], "b": [8, 1], "c": [30, 2, 2, 11, 7, 25]}
# Rows multiplied together may round differently from a row alone (BLAS picks other kernels for
# other shapes), so batched logits match per-item ones to float32 rounding, not bitwise.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_llama(path, TinyLlama(), mixed_types=True)
    return str(path)


@pytest.fixture(scope="module")
def tiny_blocks(tmp_path_factory):
    """Every block matrix in Q4_1 or Q8_0 blocks: packed, the blocks take the compiled path."""
    path = tmp_path_factory.mktemp("tiny") / "blocks.gguf"
    write_tiny_llama(path, TinyLlama(), blocks=True)
    return str(path)


def build(path: str, split: list[tuple[int, int]], precision: str) -> list:
    return [models.build(path, LayerRange(a, b), precision) for a, b in split]


def ids(values: list[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


def prefill(stages: list) -> dict[str, int]:
    """Forward each session's prompt alone; its greedy next token."""
    nxt = {}
    for session, prompt in PROMPTS.items():
        x = ids(prompt)
        for stage in stages:
            x = stage.forward(x, session=session, start_pos=0, last_only=True)
        nxt[session] = int(x[-1].argmax())
    return nxt


def decode(stages: list, batched: bool, steps: int) -> tuple[dict[str, list[int]], list[np.ndarray]]:
    """Greedy decode every session `steps` times: each step one batch, or one forward per session."""
    nxt = prefill(stages)
    tokens = {s: [t] for s, t in nxt.items()}
    logits = []
    for step in range(steps):
        items = [BatchItem(ids([tokens[s][-1]]), s, len(p) + step, True) for s, p in PROMPTS.items()]
        for stage in stages:
            if batched:
                outs = stage.forward_batch(items)
            else:
                outs = [stage.forward(x, session=s, start_pos=pos, last_only=lo) for x, s, pos, lo in items]
            items = [item._replace(x=y) for item, y in zip(items, outs, strict=True)]
        for item in items:
            logits.append(item.x)
            tokens[item.session].append(int(item.x[-1].argmax()))
    return tokens, logits


@pytest.mark.parametrize("precision", ["f32", "packed"])
@pytest.mark.parametrize("split", [[(0, 3)], [(0, 1), (1, 3)]])
@pytest.mark.parametrize("file", ["tiny", "tiny_blocks"])
def test_a_batch_of_decode_rows_gives_each_session_what_its_own_forwards_give(
    request, file, split, precision
):
    path = request.getfixturevalue(file)
    stages = build(path, split, precision)
    # Packed blocks with kernels take the compiled path (workers.models.decode): each row alone, bitwise.
    compiled = precision == "packed" and file == "tiny_blocks"
    assert all(stage.compiled == compiled for stage in stages)
    alone_tokens, alone = decode(stages, batched=False, steps=6)
    together_tokens, together = decode(build(path, split, precision), batched=True, steps=6)
    assert together_tokens == alone_tokens
    for got, want in zip(together, alone, strict=True):
        assert got.shape == want.shape == (1, TinyLlama().vocab)
        if compiled:
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, **TOLERANCE)


def test_a_batch_of_whole_prompts_is_bitwise_each_forward(tiny):
    batched, alone = build(tiny, [(0, 3)], "f32"), build(tiny, [(0, 3)], "f32")
    items = [BatchItem(ids(p), s, 0, False) for s, p in PROMPTS.items()]
    for got, (x, s, pos, lo) in zip(batched[0].forward_batch(items), items, strict=True):
        np.testing.assert_array_equal(got, alone[0].forward(x, session=s, start_pos=pos, last_only=lo))


def test_a_refused_batch_leaves_every_session_as_it_was(tiny):
    (stage,) = build(tiny, [(0, 3)], "f32")
    prefill([stage])
    good = BatchItem(ids([4]), "a", len(PROMPTS["a"]), True)
    wrong_pos = BatchItem(ids([4]), "b", len(PROMPTS["b"]) + 1, True)
    with pytest.raises(StageError, match=r"session 'b' holds positions 0\.\.2"):
        stage.forward_batch([good, wrong_pos])
    with pytest.raises(StageError, match="session 'gone' holds no cache"):
        stage.forward_batch([good, BatchItem(ids([4]), "gone", 3, True)])
    with pytest.raises(StageError, match=r"token ids must be in 0\.\.39"):
        stage.forward_batch([good, BatchItem(ids([40]), "c", len(PROMPTS["c"]), True)])
    # Session a was not advanced by the refused batches: it still continues at its prompt's end.
    (again,) = stage.forward_batch([good])
    (fresh,) = build(tiny, [(0, 3)], "f32")
    prefill([fresh])
    want = fresh.forward(good.x, session="a", start_pos=good.start_pos, last_only=True)
    np.testing.assert_allclose(again, want, **TOLERANCE)
