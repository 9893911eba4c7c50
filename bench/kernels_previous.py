"""The decode kernels that workers.models.kernels_q8 replaced, kept to measure against (bench/kernels.py).

Rows rounded to 8 bits as now, but the codes widened to int16 and each
weight byte unpacked into int16 lanes (vpmullw/vpaddw, 16 rows a vector),
once per input row, on the previous layout (byte j of the ROWS rows side by
side). Same integer sums and float order: the same products, bitwise.
"""

from __future__ import annotations

import numba
import numpy as np

from workers.models.kernels import parallel
from workers.models.kernels_q8 import BLOCK, HALF, half_to_float, quantize
from workers.models.quants import ROWS


@numba.njit(nogil=True, fastmath=True, cache=True)
def q4_rows(xq, xd, xs, quants, scales, out, g0, g1):
    """out[:, g·ROWS..] for Q4_1 groups g0..g1, int16 lanes."""
    n_in, nb = xq.shape[0], quants.shape[1]
    f = np.empty(nb * 2 * ROWS, dtype=np.float32)
    acc = np.empty(ROWS, dtype=np.float32)
    xw = np.empty(BLOCK, dtype=np.int16)
    for g in range(g0, g1):
        half_to_float(scales[g], f)
        sc = f.reshape(nb, 2, ROWS)
        for m in range(n_in):
            acc[:] = 0
            for b in range(nb):
                q = quants[g, b]  # (16, ROWS)
                for j in range(BLOCK):
                    xw[j] = xq[m, b * BLOCK + j]
                dx, sx = xd[m, b], xs[m, b]
                for r in range(ROWS):
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
    """out[:, g·ROWS..] for Q8_0 groups g0..g1, int16 lanes."""
    n_in, nb = xq.shape[0], quants.shape[1]
    f = np.empty(nb * ROWS, dtype=np.float32)
    acc = np.empty(ROWS, dtype=np.float32)
    xw = np.empty(BLOCK, dtype=np.int16)
    for g in range(g0, g1):
        half_to_float(scales[g], f)
        sc = f.reshape(nb, ROWS)
        for m in range(n_in):
            acc[:] = 0
            for b in range(nb):
                q = quants[g, b]  # (32, ROWS)
                for j in range(BLOCK):
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
def rows_parallel(q4, xq, xd, xs, quants, scales, out, n_chunks):
    """q4_rows or q8_rows over the groups cut in n_chunks, one numba thread each."""
    n_groups = quants.shape[0]
    for c in numba.prange(n_chunks):
        g0, g1 = c * n_groups // n_chunks, (c + 1) * n_groups // n_chunks
        if q4:
            q4_rows(xq, xd, xs, quants, scales, out, g0, g1)
        else:
            q8_rows(xq, xd, xs, quants, scales, out, g0, g1)


class Previous:
    """A Q4_0/Q4_1/Q8_0 PackedMatrix's blocks in the previous layout, multiplied by the previous kernels."""

    def __init__(self, packed) -> None:
        g, nb = packed.quants.shape[:2]  # (groups, blocks, quads, ROWS, QUAD) → (.., bytes, ROWS)
        self.quants = np.ascontiguousarray(packed.quants.transpose(0, 1, 2, 4, 3).reshape(g, nb, -1, ROWS))
        self.scales, self.shape, self.q4 = packed.scales, packed.shape, packed.kind in ("q4_0", "q4_1")

    def kernel(self, x: np.ndarray) -> np.ndarray:
        """x (T, in) float32 times the matrix on the kernels' threads, as PackedMatrix.kernel: (T, out)."""
        xq, xd, xs = quantize(x)
        xq = xq.astype(np.int16)
        n_groups = self.quants.shape[0]
        out = np.empty((x.shape[0], n_groups * ROWS), dtype=np.float32)
        n = parallel(n_groups)
        if n == 1:
            (q4_rows if self.q4 else q8_rows)(xq, xd, xs, self.quants, self.scales, out, 0, n_groups)
        else:
            rows_parallel(self.q4, xq, xd, xs, self.quants, self.scales, out, n)
        return out[:, : self.shape[0]]
