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
from the group's blocks as the type's dequantizer computes them (d·q + m,
(d·sc)·u - dmin·m, ... in float32), while those bytes are still in cache,
and kept for the product's next rows that spill in the same column (`MEMO`). A
row of fewer than SPILL_RATIO² values never spills: none can exceed its RMS
that many times.

Every type with a kernel names its column add in its entry (the `spilled` of
workers.models.quants): add_spilled_q4 (Q4_0, Q4_1), add_spilled_q5 (Q5_0,
Q5_1), add_spilled_q8 (Q8_0) on rows rounded per 32, add_spilled_k (Q4_K,
Q5_K, Q6_K) on Q8_K's rows rounded per 256, whose one step for 256 values
loses even more to a single large one. The rows are spilled once for every
rounding they take (workers.models.products.activations).
"""

from __future__ import annotations

import numba
import numpy as np

from workers.models import jit  # noqa: F401  (the kernels' cache directory, before any cache=True)
from workers.models.quants import BY_NAME, QUAD, ROWS

SPILL_RATIO = np.float32(12)  # above this many times its row's RMS, a value is multiplied exactly
SPILL_MAX = 4  # values a row may spill: a few channels carry the outliers, whatever the token
BLOCK = 32  # weights of a Q4_0..Q8_0 block (kernels_q8's BLOCK; that module imports this one)
HALF = BLOCK // 2  # a Q4 block's bytes of a row: weight j in the low nibble, weight j + 16 in the high one


# fastmath: the row's sum of squares and its blocks' largest values run in vector lanes (a row's
# values are finite: the activations of a forward).
@numba.njit(nogil=True, fastmath=True, cache=True)
def spill(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows x (T, in) float32 as (the rest to be rounded, cols (T, SPILL_MAX) int32, vals (T, SPILL_MAX)).

    Row m's spilled values are vals[m, s] at columns cols[m, s] (largest first), zero in the rest;
    an unused slot has value 0 and column 0.
    """
    T = x.shape[0]
    rest = np.empty_like(x)
    cols = np.zeros((T, SPILL_MAX), dtype=np.int32)
    vals = np.zeros((T, SPILL_MAX), dtype=np.float32)
    spill_rows(x, rest, cols, vals, 0, T)
    return rest, cols, vals


@numba.njit(nogil=True, fastmath=True, cache=True)
def spill_rows(x, rest, cols, vals, m0, m1) -> None:
    """spill's rows m0..m1 of x into rest, cols and vals (cols, vals zero there before)."""
    n = x.shape[1]
    for m in range(m0, m1):
        row, kept, top, at = x[m], rest[m], vals[m], cols[m]
        total = np.float32(0)
        for j in range(n):  # indexed, not iterated: an iterator over the row keeps the loop from vectorizing
            kept[j] = row[j]
            total += row[j] * row[j]
        limit = SPILL_RATIO * np.sqrt(total / np.float32(n))
        found = 0
        for j0 in range(0, n, BLOCK):  # only a block whose largest value is above the limit is searched
            amax = np.float32(0)
            for j in range(j0, min(j0 + BLOCK, n)):
                amax = max(amax, abs(row[j]))
            if not amax > limit:
                continue
            for j in range(j0, min(j0 + BLOCK, n)):
                v = row[j]
                if abs(v) > limit and (found < SPILL_MAX or abs(v) > abs(top[SPILL_MAX - 1])):
                    slot = min(found, SPILL_MAX - 1)  # a full list drops its smallest
                    while slot > 0 and abs(top[slot - 1]) < abs(v):
                        top[slot], at[slot] = top[slot - 1], at[slot - 1]
                        slot -= 1
                    top[slot], at[slot] = v, j
                    found = min(found + 1, SPILL_MAX)
        for s in range(found):
            kept[at[s]] = 0


@numba.njit(nogil=True, cache=True)
def spills(vals, m0, n) -> bool:
    """Whether any of rows m0..m0 + n spilled a value (most rows of most products spill none)."""
    for m in range(m0, m0 + n):  # noqa: SIM110 (compiled: a loop, not a generator)
        if vals[m, 0] != 0:
            return True
    return False


# Weight columns of a group a product keeps once gathered, by column number mod MEMO. The rows of a
# prompt spill in the same few channels (Gemma 3's 110 prompt rows: 1.7 values a row of the down
# products, all in 2-3 columns), so each group gathers those once rather than once for every row.
MEMO = 16


@numba.njit(nogil=True, cache=True)
def memo(quants):
    """Room for MEMO gathered columns of the layout quants (groups, blocks, quads, ROWS, QUAD) bytes.

    (which group and column each slot holds, -1 for none; their weights (MEMO, ROWS); the layout's
    bytes flat, and as 32-bit words, a row's quad each): made once a product, as reshaping and
    viewing the layout for every group that spilled cost ~300 ns a group, more than its column.
    """
    flat = quants.reshape(quants.size)
    return (
        np.full(MEMO, -1, dtype=np.int64),
        np.empty((MEMO, ROWS), dtype=np.float32),
        flat,
        flat.view(np.uint32),
    )


@numba.njit(nogil=True, cache=True)
def recall(gathered, g, j):
    """Where column j of group g goes in `gathered` (memo), and whether it is there already."""
    held = gathered[0]
    slot, key = j % MEMO, np.int64(g) << 32 | j
    known = held[slot] == key
    held[slot] = key
    return slot, known


@numba.njit(nogil=True, cache=True)
def add_column(acc, m, v, columns, slot):
    """acc[m, r] += v times the weight columns[slot, r] of each of the ROWS rows."""
    for r in range(ROWS):
        acc[m, r] += v * columns[slot, r]


@numba.njit(nogil=True, cache=True)
def q4_column(words, scales, per_block, blocks, g, j, column):
    """Weight j of group g's ROWS rows (Q4 layout as 32-bit words, scales its float32 d, m): d·u + m.

    Row r's quad of a block is word r of the quad's ROWS (little-endian: byte t at bits 8t..): the
    column is a shift and a mask of contiguous words, in vector lanes.
    """
    b, p = j // BLOCK, j % BLOCK
    at = (g * blocks + b) * per_block + (p % HALF) // QUAD * ROWS
    shift = 8 * (p % QUAD) + 4 * (p >= HALF)
    d, offset = b * 2 * ROWS, b * 2 * ROWS + ROWS
    for r in range(ROWS):
        column[r] = scales[d + r] * np.float32((words[at + r] >> shift) & 15) + scales[offset + r]


@numba.njit(nogil=True, cache=True)
def add_spilled_q4(quants, f, g, cols, vals, m0, n, acc, gathered):
    """acc[m, r] += each spilled value of row m0 + m times its weight in row r of group g (Q4 layout).

    quants: the layout's bytes (groups, blocks, 4, ROWS, QUAD); f: group g's scales as float32,
    (blocks, 2, ROWS) flat; gathered: the columns gathered so far and the layout's views (`memo`).
    The bytes are read as 32-bit words, a row's quad each: the loop over the ROWS rows is vector code.
    """
    if not spills(vals, m0, n):
        return
    words, columns = gathered[3], gathered[1]
    per_block = quants.shape[2] * ROWS  # words of a block of the group's ROWS rows
    for m in range(n):
        for s in range(SPILL_MAX):
            v = vals[m0 + m, s]
            if v == 0:
                break
            slot, known = recall(gathered, g, cols[m0 + m, s])
            if not known:
                q4_column(words, f, per_block, quants.shape[1], g, cols[m0 + m, s], columns[slot])
            add_column(acc, m, v, columns, slot)


@numba.njit(nogil=True, cache=True)
def q8_column(words, scales, per_block, blocks, g, j, column):
    """Weight j of group g's ROWS rows (Q8_0 layout as 32-bit words, scales its float32 d): d·q."""
    b = j // BLOCK
    at = (g * blocks + b) * per_block + (j % BLOCK) // QUAD * ROWS
    shift = 24 - 8 * (j % QUAD)  # the byte to the top, then back with its sign
    for r in range(ROWS):
        column[r] = scales[b * ROWS + r] * np.float32(np.int32(words[at + r] << shift) >> 24)


@numba.njit(nogil=True, cache=True)
def add_spilled_q8(quants, f, g, cols, vals, m0, n, acc, gathered):
    """As add_spilled_q4 for a Q8_0 layout: bytes (groups, blocks, 8, ROWS, QUAD), f (blocks, ROWS) flat."""
    if not spills(vals, m0, n):
        return
    words, columns = gathered[3], gathered[1]
    per_block = quants.shape[2] * ROWS  # words of a block of the group's ROWS rows
    for m in range(n):
        for s in range(SPILL_MAX):
            v = vals[m0 + m, s]
            if v == 0:
                break
            slot, known = recall(gathered, g, cols[m0 + m, s])
            if not known:
                q8_column(words, f, per_block, quants.shape[1], g, cols[m0 + m, s], columns[slot])
            add_column(acc, m, v, columns, slot)


@numba.njit(nogil=True, cache=True)
def q5_column(words, scales, n_halves, per_block, blocks, g, j, column):
    """Weight j of group g's ROWS rows (Q5 layout as 32-bit words, scales d, m or d alone): d·u + m.

    A weight is its nibble (quads 0..3, as Q4's) and a fifth bit from quad 4 (workers.models.regroup):
    for weight 4k + t (or 16 + 4k + t), bit 2k (or 2k + 1) of that quad's byte t.
    """
    b, p = j // BLOCK, j % BLOCK
    high = p >= HALF
    k, t = (p % HALF) // QUAD, p % QUAD
    at = (g * blocks + b) * per_block + k * ROWS
    fifth = (g * blocks + b) * per_block + 4 * ROWS
    shift, bit = 8 * t + 4 * high, 8 * t + 2 * k + high
    d = b * n_halves * ROWS
    for r in range(ROWS):
        u = ((words[at + r] >> shift) & 15) | (((words[fifth + r] >> bit) & 1) << 4)
        m = scales[d + ROWS + r] if n_halves == 2 else np.float32(-16) * scales[d + r]  # Q5_0: m = -16·d
        column[r] = scales[d + r] * np.float32(u) + m


@numba.njit(nogil=True, cache=True)
def add_spilled_q5(quants, f, g, cols, vals, m0, n, acc, gathered):
    """As add_spilled_q4 for a Q5_0/Q5_1 layout: bytes (groups, blocks, 5, ROWS, QUAD), f (blocks, 2, ROWS)

    flat, or (blocks, 1, ROWS) for Q5_0, which holds d alone (its m = -16·d is computed)."""
    if not spills(vals, m0, n):
        return
    words, columns = gathered[3], gathered[1]
    n_halves = f.size // (quants.shape[1] * ROWS)  # Q5_1's d, m; Q5_0's d alone
    per_block = quants.shape[2] * ROWS  # words of a block of the group's ROWS rows
    for m in range(n):
        for s in range(SPILL_MAX):
            v = vals[m0 + m, s]
            if v == 0:
                break
            slot, known = recall(gathered, g, cols[m0 + m, s])
            if not known:
                q5_column(words, f, n_halves, per_block, quants.shape[1], g, cols[m0 + m, s], columns[slot])
            add_column(acc, m, v, columns, slot)


QK = 256  # weights of a K block (kernels_k's QK; that module imports this one)
Q5_K, Q6_K = BY_NAME["q5_k"].type_id, BY_NAME["q6_k"].type_id


@numba.njit(nogil=True, cache=True)
def k_column(kind, flat, words, scales, base, n_halves, b, p, column):
    """Weight p of K block b of a group's ROWS rows (its bytes from flat[base]), as unpack computes it.

    Q4_K, Q5_K: (d·sc_s)·u - dmin·m_s, u a nibble of the 32 quads as stored (Q5_K: and a fifth bit from
    the 8 quads after them); Q6_K: (d·sc_s)·(u - 32), u a low nibble (32 quads) and a high bit pair
    (16 quads). The codes are read as 32-bit words (words: flat's), row r's quad the r-th of its
    quad's ROWS (as q4_column's); the sub-block scales follow them, a sub-block's ROWS bytes side by side.
    """
    d0, w0 = b * n_halves * ROWS, base // QUAD
    if kind == Q6_K:
        half, i, ll = p // 128, (p % 128) // 32, p % 32
        low = 64 * half + 32 * (i % 2) + ll  # its byte of low nibbles, and of high bit pairs
        high = 128 + 32 * half + ll
        lo, lo_shift = w0 + low // QUAD * ROWS, 8 * (low % QUAD) + 4 * (i // 2)
        hi, hi_shift = w0 + high // QUAD * ROWS, 8 * (high % QUAD) + 2 * i
        subs = base + 48 * ROWS * QUAD + (p // 16) * ROWS
        for r in range(ROWS):
            u = ((words[lo + r] >> lo_shift) & 15) | (((words[hi + r] >> hi_shift) & 3) << 4)
            scale = scales[d0 + r] * np.float32(np.int8(flat[subs + r]))
            column[r] = scale * np.float32(np.int32(u) - 32)
        return
    s, i = p // 32, p % 32
    codes = 32 * (s // 2) + i
    at, shift = w0 + codes // QUAD * ROWS, 8 * (codes % QUAD) + 4 * (s % 2)
    fifth, bit = w0 + (32 + i // QUAD) * ROWS, 8 * (i % QUAD) + s
    five = kind == Q5_K
    subs = base + (40 if five else 32) * ROWS * QUAD + s * ROWS
    for r in range(ROWS):
        u = (words[at + r] >> shift) & 15
        if five:
            u |= ((words[fifth + r] >> bit) & 1) << 4
        scale = scales[d0 + r] * np.float32(flat[subs + r])
        low = scales[d0 + ROWS + r] * np.float32(flat[subs + 8 * ROWS + r])
        column[r] = scale * np.float32(u) - low


@numba.njit(nogil=True, cache=True)
def add_spilled_k(kind, quants, f, g, cols, vals, m0, n, acc, gathered):
    """As add_spilled_q4 for a Q4_K, Q5_K or Q6_K layout of `kind` (its GGML type id).

    quants: bytes (groups, blocks, quads, ROWS, QUAD); f: (blocks, 2 or 1, ROWS) flat, d and dmin (Q6_K: d).
    """
    if not spills(vals, m0, n):
        return
    flat, words, columns = gathered[2], gathered[3], gathered[1]
    per_block = quants.shape[2] * ROWS * QUAD
    for m in range(n):
        for s in range(SPILL_MAX):
            v = vals[m0 + m, s]
            if v == 0:
                break
            j = cols[m0 + m, s]
            slot, known = recall(gathered, g, j)
            if not known:
                b = j // QK
                base = (g * quants.shape[1] + b) * per_block
                k_column(
                    kind, flat, words, f, base, f.size // (quants.shape[1] * ROWS), b, j % QK, columns[slot]
                )
            add_column(acc, m, v, columns, slot)
