"""Packed weights computed on their blocks: the kernels against dequantized float32, and SmolLM2 packed."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import REFERENCE
from workers import models
from workers.models import kernels
from workers.models.gguf_file import dequantize
from workers.models.kernels import KERNEL_MAX_ROWS
from workers.models.layout import ROWS, regrouped_bytes
from workers.report import LayerRange

QTYPES = {
    "q4_0": gguf.GGMLQuantizationType.Q4_0,
    "q4_1": gguf.GGMLQuantizationType.Q4_1,
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
}
STORED_BLOCK = {"q4_0": 18, "q4_1": 20, "q8_0": 34}
# Each output is a sum of n products; summed in another order than BLAS's, it may differ by a few
# roundings of the largest partial sums: bounded by n·eps relative to Σ|w·x|.
TOLERANCE = 4 * np.finfo(np.float32).eps
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
GREEDY_STEPS = 8


def random_blocks(kind: str, out: int, n_blocks: int, seed: int) -> np.ndarray:
    """Random stored blocks (out, n_blocks·block bytes) with finite, varied float16 scales."""
    rng = np.random.default_rng(seed)
    size = STORED_BLOCK[kind]
    raw = rng.integers(0, 256, (out, n_blocks, size), dtype=np.uint8)
    n_scales = 2 if kind == "q4_1" else 1
    scales = rng.standard_normal((out, n_blocks, n_scales)) * 10.0 ** rng.integers(-6, 2, (out, n_blocks, 1))
    raw[:, :, : 2 * n_scales] = scales.astype(np.float16).view(np.uint8).reshape(out, n_blocks, 2 * n_scales)
    return raw.reshape(out, n_blocks * size)


@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from(sorted(QTYPES)),
    out=st.integers(1, 3 * ROWS + 5),
    n_blocks=st.integers(1, 4),
    rows=st.sampled_from([1, 2, 3, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1, 40]),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_packed_product_is_the_dequantized_float32_product_within_rounding(kind, out, n_blocks, rows, seed):
    raw = random_blocks(kind, out, n_blocks, seed)
    w = dequantize(raw, QTYPES[kind])  # (out, in), as gguf-py reads the file
    packed = kernels.PackedMatrix(raw, kind, w.shape)
    x = np.random.default_rng(seed + 1).standard_normal((rows, w.shape[1]), dtype=np.float32)
    got = x @ packed
    bound = TOLERANCE * w.shape[1] * (np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64))
    assert got.shape == (rows, out)
    assert np.all(np.abs(got - x.astype(np.float64) @ w.T.astype(np.float64)) <= bound + 1e-30)
    assert np.array_equal(packed.dequantize(), w)
    ids = np.random.default_rng(seed).integers(0, out, 5)
    assert np.array_equal(packed.rows(ids), w[ids])
    assert packed.nbytes == regrouped_bytes(kind, out, w.shape[1])


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_a_row_of_a_product_does_not_depend_on_the_other_rows_or_the_threads(kind):
    raw = random_blocks(kind, 3 * ROWS, 6, seed=7)
    packed = kernels.PackedMatrix(raw, kind, (3 * ROWS, 6 * 32))
    x = np.random.default_rng(8).standard_normal((KERNEL_MAX_ROWS, 6 * 32), dtype=np.float32)
    batch = x @ packed
    for i in range(1, len(x)):  # the same row beside other rows, and first or later in the batch
        assert np.array_equal((x[[i, 0]] @ packed)[0], batch[i])
    one = x[:1] @ packed
    before = kernels.threads()
    try:
        kernels.set_threads(2)
        assert np.array_equal(x @ packed, batch) and np.array_equal(x[:1] @ packed, one)
    finally:
        kernels.set_threads(before)


def test_a_matrix_without_whole_blocks_or_of_another_type_is_refused():
    with pytest.raises(ValueError, match="whole blocks of 32, got 40"):
        kernels.PackedMatrix(np.zeros((4, 25), np.uint8), "q4_1", (4, 40))
    with pytest.raises(ValueError, match="block type 'q5_0' has no kernel; accepted: q4_0, q4_1, q8_0"):
        kernels.PackedMatrix(np.zeros((4, 22), np.uint8), "q5_0", (4, 32))


def test_rlx_threads_must_be_a_positive_whole_number(monkeypatch):
    monkeypatch.setenv("RLX_THREADS", "3")
    assert kernels.threads_from_env() == 3
    monkeypatch.setenv("RLX_THREADS", "0")
    with pytest.raises(ValueError, match="RLX_THREADS must be a whole number of threads ≥ 1, got '0'"):
        kernels.threads_from_env()


# ---------------------------------------------------------------- SmolLM2, packed


@pytest.fixture(scope="module")
def packed(smollm2):
    return models.build("smollm2", LayerRange(0, 30), "packed")


def greedy(stages, prompt: list[int], steps: int, session: str) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens through the chain of stages, with the last stage's logits at each step."""
    x, pos, tokens, logits = np.array(prompt, dtype=np.int32), 0, [], []
    for _ in range(steps):
        h = x
        for stage in stages:
            h = stage.forward(h, session=session, start_pos=pos, last_only=True)
        pos += len(x)
        logits.append(h[-1])
        tokens.append(int(np.argmax(h[-1])))
        x = np.array(tokens[-1:], dtype=np.int32)
    for stage in stages:
        stage.reset(session)
    return tokens, logits


def test_packed_smollm2_continues_the_reference_prompt_with_the_reference_tokens(packed):
    ref = json.loads(REFERENCE.read_text())
    tokens, _ = greedy([packed], ref["prompt_ids"], len(ref["greedy_first_5"]), "reference")
    assert tokens == ref["greedy_first_5"]  # " Paris.\n\nThe"
    assert packed.precision == "q4_1+q8_0" and packed.n_packed == packed.n_params - 61 * 576


@pytest.mark.parametrize("prompt", PROMPTS)
def test_packed_and_f32_agree_on_the_top_token_at_every_greedy_step(packed, smollm2_f32, prompt):
    ids = tokenize(prompt)
    tokens, _ = greedy([packed], ids, GREEDY_STEPS, f"top1-{prompt}")
    session = f"f32-{prompt}"
    x, pos = np.array(ids, dtype=np.int32), 0
    for step in range(GREEDY_STEPS):  # f32 fed packed's own continuation
        logits = smollm2_f32.forward(x, session=session, start_pos=pos, last_only=True)
        assert int(np.argmax(logits[-1])) == tokens[step], f"step {step} of {prompt!r}"
        pos += len(x)
        x = np.array(tokens[step : step + 1], dtype=np.int32)
    smollm2_f32.reset(session)


def tokenize(text: str) -> list[int]:
    from workers.models.tokenizer import load_tokenizer

    return load_tokenizer(models.smollm2_path()).encode(text)


@pytest.mark.parametrize("n_stages", [2, 3, 4, 5])
def test_any_split_of_packed_smollm2_gives_bitwise_the_same_logits(packed, n_stages):
    bounds = [round(i * 30 / n_stages) for i in range(n_stages + 1)]
    stages = [models.build("smollm2", LayerRange(a, b), "packed") for a, b in itertools.pairwise(bounds)]
    prompt = tokenize(PROMPTS[1])
    whole_tokens, whole_logits = greedy([packed], prompt, 4, f"whole-{n_stages}")
    tokens, logits = greedy(stages, prompt, 4, "split")
    assert tokens == whole_tokens
    assert all(np.array_equal(a, b) for a, b in zip(logits, whole_logits, strict=True))


def test_two_workers_compiling_the_kernels_at_once_share_the_cache(tmp_path):
    code = "from workers.models import kernels; kernels.warm_up(); print(kernels.threads())"
    env = os.environ | {"NUMBA_CACHE_DIR": str(tmp_path), "RLX_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        assert out.strip() == "1"
    assert list(tmp_path.rglob("*.nbc")), "no compiled kernel was cached"
