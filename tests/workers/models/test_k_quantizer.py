"""The tests' own quantizer to Q4_K, Q5_K and Q6_K (tests/support/kquants.py), read back by gguf-py.

The tiny K files llama.cpp's fixtures are made of are written by it: its blocks must be valid
ones, each weight within half a step of what was asked, and the step no coarser than the format
allows for a sub-block of that range.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from tests.support.kquants import quantize_k

T = gguf.GGMLQuantizationType
# float32 arithmetic in gguf-py's d·scale·code - dmin·min and in the quantizer's division: a few
# roundings of numbers no larger than the sub-block's largest |weight|.
SLACK = 8 * np.finfo(np.float32).eps


def awkward_matrix() -> np.ndarray:
    """Weights of the size a tiny file's matrices have, with sub-blocks that test the edges of the format.

    Row 0: a zero super-block; row 1: positive weights only (the min is then 0), row 2 negative only;
    row 3: one sub-block a thousand times its neighbours' size; row 4: constant.
    """
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((8, 512)) / 16).astype(np.float32)
    w[0, :256] = 0.0
    w[1] = np.abs(w[1])
    w[2] = -np.abs(w[2])
    w[3, 32:48] *= 1000.0
    w[4] = 0.25
    return w


def steps(blocks: np.ndarray, qtype: T) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per sub-block, as the blocks store them: the step d·scale, and the units d and dmin of the scales."""
    n = blocks.reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])
    if qtype == T.Q6_K:
        d = n[:, 208:210].copy().view(np.float16).astype(np.float32)  # (n, 1)
        scales = n[:, 192:208].view(np.int8).astype(np.float32)
        return d * scales, d, np.zeros_like(d)
    d, dmin = (n[:, at : at + 2].copy().view(np.float16).astype(np.float32) for at in (0, 2))
    scales, _ = gguf.quants.Q4_K.get_scale_min(n[:, 4:16].copy())
    return d * scales.astype(np.float32), d, dmin


@pytest.mark.parametrize(
    ("qtype", "levels", "sub"),
    [(T.Q4_K, 16, 32), (T.Q5_K, 32, 32), (T.Q6_K, 63, 16)],
    ids=["q4_k", "q5_k", "q6_k"],
)
def test_every_weight_is_within_half_a_step_of_the_input_and_the_step_is_as_fine_as_the_format_allows(
    qtype, levels, sub
):
    w = awkward_matrix()
    blocks = quantize_k(w, qtype)
    assert blocks.shape == (8, 2 * gguf.GGML_QUANT_SIZES[qtype][1])
    got = gguf.quants.dequantize(blocks, qtype).reshape(-1, 256 // sub, sub)
    x = w.reshape(got.shape)
    step, d, dmin = steps(blocks, qtype)
    size = np.abs(x).max(axis=2)
    assert (np.abs(got - x).max(axis=2) <= step / 2 + SLACK * size).all()
    # The step covers the sub-block's range (from its least value or 0, whichever is lower) in levels-1
    # steps (Q6_K: ±31 steps of its largest |value|), with its scale rounded up by at most one unit d,
    # and its min (Q4_K, Q5_K) by at most one unit dmin.
    span = 2 * size if qtype == T.Q6_K else x.max(axis=2) - np.minimum(x.min(axis=2), 0.0) + dmin
    assert (step <= span / (levels - 1) + d + SLACK * size).all()
    assert np.array_equal(got[0, : 256 // sub], np.zeros((256 // sub, sub)))  # a zero super-block is zeros


def test_the_same_weights_give_the_same_blocks_and_a_k_row_must_hold_whole_super_blocks():
    w = awkward_matrix()
    assert np.array_equal(quantize_k(w, T.Q4_K), quantize_k(w.copy(), T.Q4_K))
    with pytest.raises(ValueError, match="whole 256-weight super-blocks; a row here has 288 weights"):
        quantize_k(np.zeros((2, 288), np.float32), T.Q6_K)
    with pytest.raises(ValueError, match="writes Q4_K, Q5_K and Q6_K, not Q3_K"):
        quantize_k(w, T.Q3_K)
