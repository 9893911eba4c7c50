"""Valid blocks of any GGUF type the house reads, written by the tests (gguf-py cannot quantize to K types).

Any bytes are a valid encoding of a block but for its float16 scales: here the
codes, sub-block scales and bits are random bytes, and the float16 fields
(d, m, dmin) are set to finite values of a chosen size, so that a block's
weights have the magnitude asked for. gguf-py then dequantizes them as
llama.cpp would, which is what the kernels are compared with.
"""

from __future__ import annotations

import gguf
import numpy as np

T = gguf.GGMLQuantizationType
# Byte offsets of each type's float16 fields in a stored block, and the largest |code| times sub-block
# scale a weight reaches in units of d (so that d = size / that gives weights of about `size`).
HALVES = {
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q8_0: (0,),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
    T.IQ4_NL: (0,),
}
REACH = {
    T.Q4_0: 8,
    T.Q4_1: 15,
    T.Q5_0: 16,
    T.Q5_1: 31,
    T.Q8_0: 127,
    T.Q2_K: 3 * 15,
    T.Q3_K: 4 * 32,
    T.Q4_K: 15 * 63,
    T.Q5_K: 31 * 63,
    T.Q6_K: 32 * 128,
    T.IQ4_NL: 127,
}


def random_blocks(qtype: T, rows: int, n_blocks: int, seed: int, size: float = 1.0) -> np.ndarray:
    """Random valid blocks (rows, n_blocks·block bytes) of `qtype`, weights up to about ±size.

    Each block's float16 fields get a random sign-free value within a factor 4 of size / REACH (an
    offset field, m or dmin, as large as d).
    """
    rng = np.random.default_rng(seed)
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, (rows, n_blocks, block_bytes), dtype=np.uint8)
    for i, at in enumerate(HALVES[qtype]):
        value = size / REACH[qtype] * rng.uniform(0.25, 1.0, (rows, n_blocks))
        if i == 0 and qtype in (T.Q4_0, T.Q5_0, T.Q8_0, T.Q3_K, T.Q6_K, T.IQ4_NL):
            value *= rng.choice([-1.0, 1.0], (rows, n_blocks))  # d may be negative where no offset is
        raw[:, :, at : at + 2] = value.astype(np.float16).view(np.uint8).reshape(rows, n_blocks, 2)
    return raw.reshape(rows, n_blocks * block_bytes)


def quantize_like(weights: np.ndarray, qtype: T, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Blocks of `qtype` for a float32 matrix's shape and magnitude, and what they dequantize to.

    Not a quantizer: random valid blocks whose weights are about as large as the matrix's (its
    largest |value|), which is all a test of the arithmetic on them needs.
    """
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    rows, cols = weights.shape
    raw = random_blocks(qtype, rows, cols // block, seed, size=float(np.abs(weights).max()))
    return raw, gguf.quants.dequantize(raw, qtype).astype(np.float32)


def rounded_rows(x: np.ndarray, qtype: T) -> np.ndarray:
    """x (T, in) as the kernel of `qtype` rounds it, back in float64: llama.cpp's Q8_0/Q8_1 or Q8_K."""
    from workers.models import kernels_k, kernels_q8
    from workers.models.quants import BY_ID

    if BY_ID[qtype].activation == "q8_k":
        codes, dx, _ = kernels_k.quantize_k(x)
        return codes * np.repeat(dx.astype(np.float64), 256, axis=1)
    codes, dx, _ = kernels_q8.quantize(x)
    return codes * np.repeat(dx.astype(np.float64), 32, axis=1)
