"""The few values of a row far above its scale, kept out of the 8-bit rounding and multiplied exactly.

A row's 8-bit codes (workers.models.kernels_q8) step by max|x|/127 in each
block of 32. Transformer activations carry a few values tens of times their
row's RMS (in SmolLM2 a handful of channels, token after token); the block
holding one is rounded in steps as coarse as that value, and its other 31
values keep only a few levels. Measured on SmolLM2 Q4_1 (bench/fidelity.py,
16 prompts × 8 greedy steps): the packed logits' mean RMS distance to the
f32 path was 0.225 (llama.cpp's, which rounds the same way: 0.210); with the
values above 12 × their row's RMS kept exact, 0.139. Such values are rare:
~0.9 a row in the rows rounded for q, k, v, ~0.3 for gate and up, ~0.75
for down, so the exact products cost little.

So before a row is rounded, `spill` takes out up to SPILL_MAX values above
SPILL_RATIO × its RMS, the largest first: they are zero in the row that is
rounded (their blocks' steps then follow the rest), and after a group's
integer sums each is added back as its value times its weight column, read
from the group's blocks as the dequantizer reads them (d·q + m in float32),
while those bytes are still in cache. A row of fewer than SPILL_RATIO²
values never spills: none can exceed its RMS that many times.
"""

from __future__ import annotations

import numba
import numpy as np

from workers.models.layout import BLOCK, ROWS

SPILL_RATIO = np.float32(12)  # above this many times its row's RMS, a value is multiplied exactly
SPILL_MAX = 4  # values a row may spill: a few channels carry the outliers, whatever the token
HALF = BLOCK // 2  # a Q4 block's bytes of a row: weight j in the low nibble, weight j + 16 in the high one


# Reassociated, the row's sum of squares runs in vector lanes: the search costs ~0.3 µs a row of 1536.
@numba.njit(nogil=True, fastmath={"reassoc"}, cache=True)
def spill(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows x (T, in) float32 as (the rest to be rounded, cols (T, SPILL_MAX) int32, vals (T, SPILL_MAX)).

    Row m's spilled values are vals[m, s] at columns cols[m, s] (largest first), zero in the rest;
    an unused slot has value 0 and column 0.
    """
    T, n = x.shape
    rest = x.copy()
    cols = np.zeros((T, SPILL_MAX), dtype=np.int32)
    vals = np.zeros((T, SPILL_MAX), dtype=np.float32)
    for m in range(T):
        total = np.float32(0)
        for j in range(n):  # indexed, not iterated: an iterator over the row keeps the sum from vectorizing
            total += x[m, j] * x[m, j]
        limit = SPILL_RATIO * np.sqrt(total / np.float32(n))
        found = 0
        for j in range(n):
            v = x[m, j]
            if not abs(v) > limit:
                continue
            slot = min(found, SPILL_MAX - 1)  # a full list drops its smallest for a larger value
            if found == SPILL_MAX and abs(v) <= abs(vals[m, slot]):
                continue
            while slot > 0 and abs(vals[m, slot - 1]) < abs(v):
                vals[m, slot], cols[m, slot] = vals[m, slot - 1], cols[m, slot - 1]
                slot -= 1
            vals[m, slot], cols[m, slot] = v, j
            found = min(found + 1, SPILL_MAX)
        for s in range(found):
            rest[m, cols[m, s]] = 0
    return rest, cols, vals


@numba.njit(nogil=True, cache=True)
def add_spilled_q4(quants, sc, g, cols, vals, m0, n, acc):
    """acc[m, r] += each spilled value of row m0 + m times its weight in row r of group g (Q4 layout).

    quants: the layout's bytes (groups, blocks, 4, ROWS, 4); sc: group g's scales (blocks, 2, ROWS).
    """
    quad = quants.shape[4]
    for m in range(n):
        for s in range(SPILL_MAX):
            v = vals[m0 + m, s]
            if v == 0:
                break
            j = cols[m0 + m, s]
            b, p = j // BLOCK, j % BLOCK
            shift, k, i = (p >= HALF) * 4, (p % HALF) // quad, p % quad
            for r in range(ROWS):
                q = np.float32((quants[g, b, k, r, i] >> shift) & 15)
                acc[m, r] += v * (sc[b, 0, r] * q + sc[b, 1, r])


@numba.njit(nogil=True, cache=True)
def add_spilled_q8(quants, sc, g, cols, vals, m0, n, acc):
    """As add_spilled_q4 for a Q8_0 layout: bytes (groups, blocks, 8, ROWS, 4), sc (blocks, ROWS)."""
    quad = quants.shape[4]
    for m in range(n):
        for s in range(SPILL_MAX):
            v = vals[m0 + m, s]
            if v == 0:
                break
            j = cols[m0 + m, s]
            b, p = j // BLOCK, j % BLOCK
            for r in range(ROWS):
                byte = np.int32(quants[g, b, p // quad, r, p % quad])
                acc[m, r] += v * (sc[b, r] * np.float32(byte - 256 if byte > 127 else byte))
