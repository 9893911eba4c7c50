"""Products with Q5_0/Q5_1 blocks on the input rows rounded to 8 bits per 32 (as workers.models.kernels_q8).

A weight is u = nibble | fifth bit << 4 (0..31), its value d·u + m (Q5_0: m =
-16·d, exact in float32, computed from the d held alone where it is used), so
a block's product is d·dx·Σ u·xq + m·dx·Σ xq, as Q4_1's, with llama.cpp's Q8_1
rows (the same codes as its Q8_0). The quads of a block hold the 16 nibble
bytes as stored, then one quad of fifth bits (workers.models.regroup): bit 2k
of byte t goes with weight 4k + t, bit 2k + 1 with weight 16 + 4k + t, so each
is moved to bit 4 by one shift. vpmaddubsw's int16 pair sums reach 2·31·127 =
7874, so two quads (both nibbles: four such sums a lane, 31496) are added in
int16 before widening.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from workers.models.kernels_q8 import (
    AVX2,
    BLOCK,
    BYTES,
    HALF,
    PREFETCH,
    ROWS_AT_ONCE,
    Vectors,
    half_to_float,
    splat,
)
from workers.models.outliers import add_spilled_q5, memo
from workers.models.quants import QUAD, ROWS

QUADS = 5  # a block's quads: 4 of nibbles, 1 of fifth bits


def to_bit4(v: Vectors, bits, p: int):
    """Bit p of each byte of `bits` at bit 4 (other bits cleared)."""
    if p < 4:
        bits = v.b.shl(bits, splat(BYTES, 4 - p))
    elif p > 4:
        bits = v.b.lshr(bits, splat(BYTES, p - 4))
    return v.b.and_(bits, splat(BYTES, 16))


def _emit_q5_dots(v: Vectors, n_rows: int, q, x, stride, d) -> None:
    """int32 d[m, r] = Σ_j u_j of row r of the block at q times code j of row m at x + m·stride."""
    rows = [v.b.add(x, v.b.mul(stride, ir.Constant(stride.type, m))) for m in range(n_rows)]
    for line in range(0, QUADS * QUAD * ROWS, 64):
        v.prefetch(q, PREFETCH + line)
    for s in range(ROWS // 8):
        fifth = v.load(q, (4 * ROWS + 8 * s) * QUAD, BYTES)
        acc: list = [None] * n_rows
        run: list = [None] * n_rows
        for k in range(HALF // QUAD):
            w = v.load(q, (k * ROWS + 8 * s) * QUAD, BYTES)
            lo = v.b.or_(v.b.and_(w, splat(BYTES, 15)), to_bit4(v, fifth, 2 * k))
            hi = v.b.or_(v.b.lshr(w, splat(BYTES, 4)), to_bit4(v, fifth, 2 * k + 1))
            for m, x_m in enumerate(rows):
                p = v.b.add(
                    v.maddubs(lo, v.splat4(x_m, QUAD * k)), v.maddubs(hi, v.splat4(x_m, HALF + QUAD * k))
                )
                run[m] = p if run[m] is None else v.b.add(run[m], p)
            if k % 2:
                for m in range(n_rows):
                    wide = v.madd_ones(run[m])
                    acc[m] = wide if acc[m] is None else v.b.add(acc[m], wide)
                    run[m] = None
        for m, total in enumerate(acc):
            v.store(total, d, (m * ROWS + 8 * s) * 4)


@intrinsic
def q5_dots(typingctx, q, x, stride, d, n_rows):
    """(q, x, stride, d, n_rows): _emit_q5_dots for n_rows 1..ROWS_AT_ONCE, chosen at run time."""

    def codegen(context, builder, signature, args):
        *addresses, n = args
        done = builder.append_basic_block("done")
        switch = builder.switch(n, done)
        for count in range(1, ROWS_AT_ONCE + 1):
            block = builder.append_basic_block(f"rows{count}")
            switch.add_case(ir.Constant(n.type, count), block)
            with builder.goto_block(block):
                _emit_q5_dots(Vectors(builder, AVX2), count, *addresses)
                builder.branch(done)
        builder.position_at_end(done)
        return context.get_dummy_value()

    return types.void(types.intp, types.intp, types.intp, types.intp, types.intp), codegen


@numba.njit(nogil=True, cache=True)
def q5_scales(bits, f, d):
    """A group's scales (blocks, halves, ROWS) float16 bits as float32 d and m in f (blocks · 2 · ROWS).

    d: room for the group's d (blocks · ROWS float32), used when m is not held.

    Q5_1 holds d and m; Q5_0 holds d alone (2 bytes a block less), its m = -16·d computed here,
    exactly (a power of two times a float16), for what reads a group's weights (unpack, the
    spilled columns); the products compute it where they use it (q5_rows).
    """
    if bits.shape[1] == 2:
        half_to_float(bits, f)
        return
    half_to_float(bits, d)
    for b in range(bits.shape[0]):
        for r in range(ROWS):
            f[2 * b * ROWS + r] = d[b * ROWS + r]
            f[(2 * b + 1) * ROWS + r] = np.float32(-16) * d[b * ROWS + r]


@numba.njit(nogil=True, cache=True)
def q5_rows(xq, xd, xs, spilled, quants, scales, out, g0, g1):
    """out[:, g·ROWS..] for groups g0..g1 of a Q5_0/Q5_1 layout: Σ_b d·dx·Σ_j u·xq + m·dx·Σ_j xq + spilled.

    spilled: (cols, vals), the rows' values taken out before they were rounded (workers.models.outliers).
    """
    n_in, nb, width, n_halves = xq.shape[0], quants.shape[1], xq.shape[1], scales.shape[2]
    f = np.empty(nb * n_halves * ROWS, dtype=np.float32)
    acc = np.empty((ROWS_AT_ONCE, ROWS), dtype=np.float32)
    gathered = memo(quants)  # the weight columns of spilled values, each gathered once a group
    dots = np.empty((ROWS_AT_ONCE, ROWS), dtype=np.int32)
    q0, x0, d = np.intp(quants.ctypes.data), np.intp(xq.ctypes.data), np.intp(dots.ctypes.data)
    for g in range(g0, g1):
        half_to_float(scales[g], f)  # d, m (Q5_1) or d alone (Q5_0: m = -16·d, below)
        sc = f.reshape(nb, n_halves, ROWS)
        for m0 in range(0, n_in, ROWS_AT_ONCE):
            n = min(ROWS_AT_ONCE, n_in - m0)
            acc[:] = 0
            for b in range(nb):
                q5_dots(q0 + (g * nb + b) * QUADS * QUAD * ROWS, x0 + m0 * width + b * BLOCK, width, d, n)
                for m in range(n):
                    dx, sx = xd[m0 + m, b], xs[m0 + m, b]
                    if n_halves == 2:
                        for r in range(ROWS):
                            acc[m, r] += sc[b, 0, r] * (dx * np.float32(dots[m, r])) + sc[b, 1, r] * sx
                    else:  # Q5_0's m = -16·d in the loop: a group's scales then cost one conversion
                        for r in range(ROWS):
                            m_r = np.float32(-16) * sc[b, 0, r]  # exact, the m Q5_1's layout would hold
                            acc[m, r] += sc[b, 0, r] * (dx * np.float32(dots[m, r])) + m_r * sx
            add_spilled_q5(quants, f, g, spilled[0], spilled[1], m0, n, acc, gathered)
            out[m0 : m0 + n, g * ROWS : (g + 1) * ROWS] = acc[:n]
