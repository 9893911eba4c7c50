"""Products of packed blocks with input rows quantized to 8 bits per block of 32, in integers.

As llama.cpp does for its Q8_0/Q8_1 activations: each input row's block of
32 values becomes int8 codes xq = round(x / dx) with dx = max|x| / 127, and
for each weight block the dot product Σ_j q·xq is an exact integer sum,
scaled once by the block's scales (Q4_1: d·dx·Σ q·xq + m·dx·Σ xq). On this
kind of machine integer lanes carry twice as many weights as float32 lanes
and need no conversion per weight: ~1.5x faster than exact float32 on the
blocks (bench/kernels.py).

The product is exactly the weights times the rounded rows x̃ = dx·xq, so its
error against the float32 product is Σ_j w_j·(x_j - x̃_j), at most
Σ_b (dx_b / 2)·Σ_j |w_bj| per output: about 1e-3 of its scale, not float32
rounding. The integer sums are exact and the float sums run in one fixed
order, so a row's outputs do not depend on the other rows of the batch, the
thread count or how a model is split: splits agree bitwise.
"""

from __future__ import annotations

import numba
import numpy as np

from workers.models.layout import BLOCK, ROWS

HALF = BLOCK // 2  # bytes of a Q4 block's row: weight j in the low nibble, weight j + 16 in the high one


@numba.njit(nogil=True, cache=True)
def half_to_float(bits: np.ndarray, out: np.ndarray) -> None:
    """Finite float16 bit patterns (uint16, C order) to float32 in `out`, exactly (subnormals too)."""
    u = out.view(np.uint32)
    for i in range(bits.size):
        u[i] = np.uint32(bits[i] & 0x7FFF) << 13  # exponent and mantissa moved to float32's places
    for i in range(bits.size):
        out[i] *= np.float32(2.0**112)  # rebias the exponent from 15 to 127 (subnormals become normal)
        if bits[i] & 0x8000:
            out[i] = -out[i]


@numba.njit(nogil=True, cache=True)
def quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows x (T, in) float32 as codes in -127..127 (T, in), block scales dx and dx·Σ codes (T, in/32).

    The codes are int16, the width the kernels multiply in.
    """
    n_in, nb = x.shape[0], x.shape[1] // BLOCK
    xq = np.empty(x.shape, dtype=np.int16)
    xd, xs = np.empty((n_in, nb), dtype=np.float32), np.empty((n_in, nb), dtype=np.float32)
    for m in range(n_in):
        for b in range(nb):
            block = x[m, b * BLOCK : (b + 1) * BLOCK]
            amax = np.float32(0)
            for v in block:
                amax = max(amax, abs(v))
            inv = np.float32(127) / amax if amax > 0 else np.float32(0)
            total = 0
            for j in range(BLOCK):
                code = np.int16(np.rint(block[j] * inv))
                xq[m, b * BLOCK + j] = code
                total += code
            xd[m, b] = amax / np.float32(127)
            xs[m, b] = xd[m, b] * np.float32(total)
    return xq, xd, xs


@numba.njit(nogil=True, fastmath=True, cache=True)
def q4_rows(xq, xd, xs, quants, scales, out, g0, g1):
    """out[:, g·ROWS..] for groups g0..g1 of a Q4_1 layout: Σ_b d·dx·Σ_j q·xq + m·dx·Σ_j xq.

    A byte's two weights times their codes fit int16 (2·15·127), and so does
    the sum of eight bytes: each half block sums in int16 lanes, 16 rows a vector.
    """
    n_in, nb = xq.shape[0], quants.shape[1]
    f = np.empty(nb * 2 * ROWS, dtype=np.float32)
    acc = np.empty(ROWS, dtype=np.float32)
    xw = np.empty(BLOCK, dtype=np.int16)
    for g in range(g0, g1):
        half_to_float(scales[g].ravel(), f)
        sc = f.reshape(nb, 2, ROWS)
        for m in range(n_in):  # a group's bytes (≤ 24 KB) stay in L1 for the next row
            acc[:] = 0
            for b in range(nb):
                q = quants[g, b]  # (16, ROWS)
                for j in range(BLOCK):  # a local copy: the loop below then keeps its sums in registers
                    xw[j] = xq[m, b * BLOCK + j]
                dx, sx = xd[m, b], xs[m, b]
                for r in range(ROWS):
                    # The explicit int16 casts keep numba from widening every sum to int64.
                    s0, s1 = np.int16(0), np.int16(0)
                    for j in range(HALF // 2):
                        v = np.int16(q[j, r])
                        s0 = np.int16(s0 + (v & np.int16(15)) * xw[j] + (v >> np.int16(4)) * xw[j + HALF])
                    for j in range(HALF // 2, HALF):
                        v = np.int16(q[j, r])
                        s1 = np.int16(s1 + (v & np.int16(15)) * xw[j] + (v >> np.int16(4)) * xw[j + HALF])
                    dot = np.float32(np.int32(s0) + np.int32(s1))
                    acc[r] += sc[b, 0, r] * (dx * dot) + sc[b, 1, r] * sx
            out[m, g * ROWS : (g + 1) * ROWS] = acc


@numba.njit(nogil=True, fastmath=True, cache=True)
def q8_rows(xq, xd, xs, quants, scales, out, g0, g1):
    """out[:, g·ROWS..] for groups g0..g1 of a Q8_0 layout: Σ_b d·dx·Σ_j q·xq (xs unused: no offsets).

    Two weights times their codes fit int16 (2·128·127 < 2^15): pairs sum in
    int16 lanes, 16 rows a vector, then add up in int32.
    """
    n_in, nb = xq.shape[0], quants.shape[1]
    f = np.empty(nb * ROWS, dtype=np.float32)
    acc = np.empty(ROWS, dtype=np.float32)
    xw = np.empty(BLOCK, dtype=np.int16)
    for g in range(g0, g1):
        half_to_float(scales[g].ravel(), f)
        sc = f.reshape(nb, ROWS)
        for m in range(n_in):  # a group's bytes (≤ 48 KB) stay in cache for the next row
            acc[:] = 0
            for b in range(nb):
                q = quants[g, b]  # (32, ROWS)
                for j in range(BLOCK):  # a local copy: the loop below then keeps its sums in registers
                    xw[j] = xq[m, b * BLOCK + j]
                dx = xd[m, b]
                for r in range(ROWS):
                    s = np.int32(0)
                    for j in range(0, BLOCK, 2):
                        pair = np.int16(np.int16(q[j, r]) * xw[j] + np.int16(q[j + 1, r]) * xw[j + 1])
                        s = np.int32(s + pair)
                    acc[r] += sc[b, r] * (dx * np.float32(s))
            out[m, g * ROWS : (g + 1) * ROWS] = acc


@numba.njit(nogil=True, parallel=True, cache=True)
def q4_parallel(xq, xd, xs, quants, scales, out, n_chunks):
    """q4_rows over the groups cut in n_chunks, one numba thread each."""
    n_groups = quants.shape[0]
    for c in numba.prange(n_chunks):
        q4_rows(xq, xd, xs, quants, scales, out, c * n_groups // n_chunks, (c + 1) * n_groups // n_chunks)


@numba.njit(nogil=True, parallel=True, cache=True)
def q8_parallel(xq, xd, xs, quants, scales, out, n_chunks):
    """q8_rows over the groups cut in n_chunks, one numba thread each."""
    n_groups = quants.shape[0]
    for c in numba.prange(n_chunks):
        q8_rows(xq, xd, xs, quants, scales, out, c * n_groups // n_chunks, (c + 1) * n_groups // n_chunks)


def product(x: np.ndarray, quants: np.ndarray, scales: np.ndarray, n_threads: int) -> np.ndarray:
    """x (T, in) float32, quantized to 8 bits, times the regrouped blocks on n_threads: (T, groups·ROWS)."""
    n_groups = quants.shape[0]
    xq, xd, xs = quantize(x)
    out = np.empty((x.shape[0], n_groups * ROWS), dtype=np.float32)
    q4 = quants.shape[2] == HALF
    n = min(n_threads, n_groups)
    if n == 1:
        (q4_rows if q4 else q8_rows)(xq, xd, xs, quants, scales, out, 0, n_groups)
    else:
        (q4_parallel if q4 else q8_parallel)(xq, xd, xs, quants, scales, out, n)
    return out
