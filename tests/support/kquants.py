"""Valid blocks of any GGUF type the house reads, written by the tests (gguf-py cannot quantize to K types).

Two makes: random blocks (for the kernels' arithmetic), and a real, simple quantizer of float32
weights to Q4_K, Q5_K and Q6_K (`quantize_k`, for the tiny K files llama.cpp's answers are of).

For the random ones, any bytes are a valid encoding of a block but for its float16 scales: here the
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


# -------------------------------------------------------------- a real, simple quantizer to Q4_K, Q5_K, Q6_K
#
# Per super-block of 256 weights (the layouts of llama.cpp's block_q4_K, block_q5_K, block_q6_K):
#   Q4_K, Q5_K  d, dmin (float16), 12 bytes of eight 6-bit scales and eight 6-bit mins (one per
#               sub-block of 32), then Q5_K's 32 bytes of fifth bits, then 128 bytes of nibbles;
#               a weight is d·scale·code - dmin·min, code 0..15 (0..31).
#   Q6_K        128 bytes of low nibbles, 64 of high bit pairs, sixteen int8 scales (one per
#               sub-block of 16), d (float16); a weight is d·scale·(code - 32), code 0..63.
# Not llama.cpp's search for the scales that minimise the error: each sub-block's range is covered
# exactly (its scale and min rounded up, never down), so no code is clipped and every weight is
# within half its sub-block's step of the input.


def _half_up(x: np.ndarray) -> np.ndarray:
    """x as float16, rounded up where float16 rounds to nearest below it (float32 values of the result)."""
    h = x.astype(np.float16)
    h = np.where(h.astype(np.float32) < x, np.nextafter(h, np.float16(np.inf)), h)
    return h.astype(np.float32)


def _super_blocks(weights: np.ndarray) -> np.ndarray:
    """A float32 matrix (rows, cols), cols whole super-blocks of 256, as (rows · cols/256, 256)."""
    cols = weights.shape[1]
    if cols % 256:
        raise ValueError(
            f"K blocks hold rows of whole 256-weight super-blocks; a row here has {cols} weights"
        )
    return np.ascontiguousarray(weights, dtype=np.float32).reshape(-1, 256)


def _ceil_code(value: np.ndarray, unit: np.ndarray, top: int) -> np.ndarray:
    """The least multiple of `unit` (per block) at or above value, as a code 0..top (0 where unit is 0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        code = np.where(unit > 0, np.ceil(value / unit), 0.0)
    return np.clip(code, 0, top)


def _scaled_codes(x: np.ndarray, offset: np.ndarray, step: np.ndarray, top: int) -> np.ndarray:
    """round((x + offset) / step), clipped to 0..top, per sub-block (step 0: code 0), as uint8."""
    with np.errstate(divide="ignore", invalid="ignore"):
        code = np.where(step > 0, np.rint((x + offset) / step), 0.0)
    return np.clip(code, 0, top).astype(np.uint8)


def _scales_and_mins(x: np.ndarray, levels: int) -> tuple:
    """Per super-block d, dmin, and per sub-block of 32 the 6-bit scales and mins, codes 0..levels-1.

    x: (n, 8, 32). The min is the sub-block's least value, or 0 if that is positive (a min is stored
    as a non-negative number subtracted). Mins are chosen first, rounded up to whole units of dmin;
    then the scale must reach the sub-block's largest value from that offset in levels-1 steps.
    """
    low = np.minimum(x.min(axis=2), 0.0)  # (n, 8), <= 0
    dmin = _half_up(-low.min(axis=1) / 63)  # (n,)
    mins = _ceil_code(-low, dmin[:, None], 63)
    need = (x.max(axis=2) + dmin[:, None] * mins) / (levels - 1)  # each sub-block's step
    d = _half_up(need.max(axis=1) / 63)
    scales = _ceil_code(need, d[:, None], 63)
    return d, dmin, scales.astype(np.uint8), mins.astype(np.uint8)


def _pack_scales(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and eight 6-bit mins per block (n, 8) into llama.cpp's 12 bytes (n, 12).

    Bytes 0-3: scales 0-3, their top bits the top two of scales 4-7; bytes 4-7: mins 0-3 likewise
    with mins 4-7; bytes 8-11: the low nibbles of scales 4-7, with those of mins 4-7 above them.
    """
    lo_s, hi_s, lo_m, hi_m = scales[:, :4], scales[:, 4:], mins[:, :4], mins[:, 4:]
    return np.concatenate(
        [lo_s | ((hi_s >> 4) << 6), lo_m | ((hi_m >> 4) << 6), (hi_s & 0xF) | ((hi_m & 0xF) << 4)], axis=1
    ).astype(np.uint8)


def _quantize_q45_k(weights: np.ndarray, levels: int) -> np.ndarray:
    """Q4_K (levels 16) or Q5_K (levels 32) blocks of a float32 matrix, (rows, cols/256 · block bytes)."""
    x = _super_blocks(weights).reshape(-1, 8, 32)
    d, dmin, scales, mins = _scales_and_mins(x, levels)
    step = (d[:, None] * scales)[:, :, None]
    codes = _scaled_codes(x, (dmin[:, None] * mins)[:, :, None], step, levels - 1)  # (n, 8, 32)
    pairs = codes.reshape(-1, 4, 2, 32)  # 64 weights a chunk: sub-blocks 2c (low nibbles), 2c+1 (high)
    nibbles = ((pairs[:, :, 0] & 0xF) | ((pairs[:, :, 1] & 0xF) << 4)).reshape(-1, 128)
    parts = [
        d.astype(np.float16).view(np.uint8).reshape(-1, 2),
        dmin.astype(np.float16).view(np.uint8).reshape(-1, 2),
    ]
    parts.append(_pack_scales(scales, mins))
    if levels == 32:  # byte l's bit s holds the fifth bit of weight l of sub-block s
        fifth = (codes >> 4).astype(np.uint8)  # (n, 8, 32)
        parts.append(np.bitwise_or.reduce(fifth << np.arange(8, dtype=np.uint8)[None, :, None], axis=1))
    parts.append(nibbles)
    return np.concatenate(parts, axis=1).reshape(weights.shape[0], -1)


def _quantize_q6_k(weights: np.ndarray) -> np.ndarray:
    """Q6_K blocks of a float32 matrix, (rows, cols/256 · 210).

    Each sub-block of 16 is scaled symmetrically so that its largest |value| is 31 steps (codes
    -31..31 of the format's -32..31); its int8 scale is rounded up to whole units of d.
    """
    x = _super_blocks(weights).reshape(-1, 16, 16)
    need = np.abs(x).max(axis=2) / 31  # (n, 16)
    d = _half_up(need.max(axis=1) / 127)
    scales = _ceil_code(need, d[:, None], 127)
    codes = _scaled_codes(x, 32 * (d[:, None] * scales)[:, :, None], (d[:, None] * scales)[:, :, None], 63)
    q = codes.reshape(-1, 2, 4, 32)  # halves of 128, each four runs of 32 weights
    low = (q & 0xF).reshape(-1, 2, 2, 2, 32)  # (n, half, run >> 1, run & 1, 32)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)  # runs 0|2, 1|3 share a byte's nibbles
    qh = np.bitwise_or.reduce((q >> 4) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None], axis=2)
    parts = [ql, qh.reshape(-1, 64), scales.astype(np.int8).view(np.uint8)]
    parts.append(d.astype(np.float16).view(np.uint8).reshape(-1, 2))
    return np.concatenate(parts, axis=1).reshape(weights.shape[0], -1)


def quantize_k(weights: np.ndarray, qtype: T) -> np.ndarray:
    """Blocks of Q4_K, Q5_K or Q6_K holding a float32 matrix (rows, cols), cols whole super-blocks of 256."""
    if qtype == T.Q4_K:
        return _quantize_q45_k(weights, 16)
    if qtype == T.Q5_K:
        return _quantize_q45_k(weights, 32)
    if qtype == T.Q6_K:
        return _quantize_q6_k(weights)
    raise ValueError(f"quantize_k writes Q4_K, Q5_K and Q6_K, not {qtype.name}")
