"""Products with Q4_K, Q5_K and Q6_K blocks (256 weights) on input rows rounded as llama.cpp's Q8_K.

Q8_K rounds each block of 256 values of a row to int8 codes with one float32
scale, and keeps the sums of its codes per 16 (`quantize_k`). A K block's
weights are d·sc_s·u - dmin·m_s (Q4_K, Q5_K: u a 4- or 5-bit code, eight
sub-blocks s of 32 with 6-bit scales and mins) or d·sc_s·(u - 32) (Q6_K: u a
6-bit code, sixteen sub-blocks of 16 with int8 scales), so a block's product
with a row is, in integers, exact:

    Q4_K, Q5_K: dx·(d·Σ_s sc_s·Σ_j u·xq - dmin·Σ_s m_s·Σ_j xq)
    Q6_K:       dx·d·(Σ_s sc_s·Σ_j u·xq - 32·Σ_s sc_s·Σ_j xq)

with Σ_j xq the row's sums per sub-block. As for the 32-weight types
(workers.models.kernels_q8), the lanes run across 8 output rows, 4 bytes of
each side by side: vpmaddubsw multiplies the codes u (unsigned) into the
row's codes and adds pairs in int16, and vpmaddwd multiplies those by each
row's sub-block scale (a byte of the layout, widened) and adds pairs in
int32. int16 sums stay exact: a lane's pair is at most 2·15·127 (Q4_K: 8
quads summed), 2·31·127 (Q5_K: 4) or 2·63·127 (Q6_K: 2) before vpmaddwd.
The offsets' sums (mins, the -32) are vpmaddwd of pairs of scales with pairs
of the row's sums. The float arithmetic per block is then a few roundings.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from workers.models.kernels_q8 import (
    AVX2,
    BYTES,
    DWORDS,
    I8,
    I16,
    I32,
    PREFETCH,
    ROWS_AT_ONCE,
    VECTOR_LANES,
    WORDS,
    Vectors,
    half_to_float,
    splat,
)
from workers.models.outliers import QK, add_spilled_k, memo
from workers.models.quants import BY_NAME, QUAD, ROWS

Q4_K, Q5_K, Q6_K = (BY_NAME[n].type_id for n in ("q4_k", "q5_k", "q6_k"))


@numba.njit(nogil=True, fastmath=VECTOR_LANES, cache=True)
def quantize_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows x (T, in) as llama.cpp's Q8_K: int8 codes (T, in), scales (T, in/256), sums per 16 (T, in/16).

    Per block, the value of largest magnitude becomes ∓127 (iscale = -127/max), the others
    round(iscale·x) half to even, as llama.cpp's nearest_int; the scale is 1/iscale.
    """
    n_in, nb = x.shape[0], x.shape[1] // QK
    xq = np.zeros(x.shape, dtype=np.int8)
    xd = np.zeros((n_in, nb), dtype=np.float32)
    sums = np.zeros((n_in, x.shape[1] // 16), dtype=np.int16)
    quantize_k_rows(x, xq, xd, sums, 0, n_in)
    return xq, xd, sums


@numba.njit(nogil=True, fastmath=VECTOR_LANES, cache=True)
def quantize_k_rows(x, xq, xd, sums, m0, m1) -> None:
    """quantize_k's rows m0..m1 of x into xq, xd, sums (zero there before: a block of zeros stays so)."""
    for m in range(m0, m1):
        row, codes = x[m], xq[m]
        for b in range(x.shape[1] // QK):
            j0 = b * QK
            amax = np.float32(0)
            for j in range(j0, j0 + QK):  # indexed, in vector lanes (kernels_q8.VECTOR_LANES)
                amax = max(amax, abs(row[j]))
            if amax == 0:
                continue
            top = j0  # the first value of that magnitude, with its sign
            while abs(row[top]) != amax:
                top += 1
            iscale = np.float32(-127) / row[top]
            for s in range(16):
                total = np.int32(0)
                for j in range(j0 + 16 * s, j0 + 16 * (s + 1)):
                    code = min(np.int32(127), np.int32(np.rint(iscale * row[j])))
                    codes[j] = np.int8(code)
                    total += code
                sums[m, b * 16 + s] = np.int16(total)
            xd[m, b] = np.float32(1) / iscale


# ---------------------------------------------------------------- vector code

RQ = ROWS * QUAD  # bytes of one quad of a group's ROWS rows
# Where a block's sub-block scales start: after the codes' 32 (Q4_K), 40 (Q5_K) or 48 (Q6_K) quads.
SUBS_Q4_K, SUBS_Q5_K, SUBS_Q6_K = 32 * RQ, 40 * RQ, 48 * RQ
V8 = ir.VectorType(I8, 8)


def _runtime_splat(v: Vectors, value):
    """A <32 x i8> of the run-time value (an intp) in every lane: a shift by the same amount in each."""
    byte = v.b.trunc(value, I8)
    one = v.b.insert_element(ir.Constant(BYTES, None), byte, ir.Constant(I32, 0))
    return v.shuffle(one, one, [0] * 32)


def _scale_lanes(v: Vectors, subs, offset: int, signed: bool):
    """8 rows' scale bytes at subs + offset as 16 int16 lanes: row r's at lanes 2r, 2r + 1 (for vpmaddwd)."""
    wide = (v.b.sext if signed else v.b.zext)(v.load(subs, offset, V8), ir.VectorType(I16, 8))
    return v.shuffle(wide, wide, [r for r in range(8) for _ in range(2)])


def _pair_lanes(v: Vectors, subs, first: int, second: int, signed: bool):
    """8 rows' scale bytes of two sub-blocks as 16 int16 lanes: row r's first at 2r, its second at 2r + 1."""
    a, b = v.load(subs, first, V8), v.load(subs, second, V8)
    both = v.shuffle(a, b, [i for r in range(8) for i in (r, 8 + r)])
    return (v.b.sext if signed else v.b.zext)(both, WORDS)


def _sum_pairs(v: Vectors, sums, first: int, wide: bool):
    """A row's code sums of sub-blocks first, first + 1 repeated over 16 int16 lanes (for vpmaddwd).

    sums: address of the row's Q8_K sums per 16 for this block; wide: sub-blocks of 32 (two sums each).
    """
    values = []
    for s in (first, first + 1):
        if wide:
            a, b = (v.load(sums, 2 * (2 * s + i), I16) for i in range(2))
            values.append(v.b.add(a, b))
        else:
            values.append(v.load(sums, 2 * s, I16))
    pair = v.b.or_(v.b.zext(values[0], I32), v.b.shl(v.b.zext(values[1], I32), ir.Constant(I32, 16)))
    one = v.b.insert_element(ir.Constant(ir.VectorType(I32, 8), None), pair, ir.Constant(I32, 0))
    return v.b.bitcast(v.shuffle(one, one, [0] * 8), WORDS)


def _add(acc, value, v: Vectors):
    return value if acc is None else v.b.add(acc, value)


def _row_addresses(v: Vectors, x, stride, n_rows: int) -> list:
    return [v.b.add(x, v.b.mul(stride, ir.Constant(stride.type, m))) for m in range(n_rows)]


def _emit_k45_chunk(v: Vectors, five: bool, n_rows: int, codes, fifth, subs, shift, x, stride, d) -> None:
    """d[m, r] += Σ over sub-blocks 2c, 2c + 1 (a chunk of 64 weights) of sc·Σ u·xq, Q4_K or Q5_K.

    codes: the chunk's 8 quads; fifth: Q5_K's 8 quads of fifth bits (bits shift, shift + 1 go with
    this chunk's low and high nibbles); subs: sub-block 2c's scale bytes (2c + 1's follow, ROWS on);
    x: the chunk's codes of the first input row, the next ones stride apart.
    """
    rows = _row_addresses(v, x, stride, n_rows)
    low_bit, high_bit = (
        _runtime_splat(v, shift),
        _runtime_splat(v, v.b.add(shift, ir.Constant(shift.type, 1))),
    )
    run_quads = 4 if five else 8  # int16 sums stay exact: 8·2·15·127 and 4·2·31·127 < 2^15
    for s in range(ROWS // 8):
        sc_lo, sc_hi = _scale_lanes(v, subs, 8 * s, False), _scale_lanes(v, subs, ROWS + 8 * s, False)
        acc = [v.load(d, (m * ROWS + 8 * s) * 4, DWORDS) for m in range(n_rows)]
        run_lo: list = [None] * n_rows
        run_hi: list = [None] * n_rows
        for k in range(8):
            w = v.load(codes, (k * ROWS + 8 * s) * QUAD, BYTES)
            lo, hi = v.b.and_(w, splat(BYTES, 15)), v.b.lshr(w, splat(BYTES, 4))
            if five:
                f = v.load(fifth, (k * ROWS + 8 * s) * QUAD, BYTES)
                lo = v.b.or_(lo, v.b.shl(v.b.and_(v.b.lshr(f, low_bit), splat(BYTES, 1)), splat(BYTES, 4)))
                hi = v.b.or_(hi, v.b.shl(v.b.and_(v.b.lshr(f, high_bit), splat(BYTES, 1)), splat(BYTES, 4)))
            for m, xm in enumerate(rows):
                run_lo[m] = _add(run_lo[m], v.maddubs(lo, v.splat4(xm, QUAD * k)), v)
                run_hi[m] = _add(run_hi[m], v.maddubs(hi, v.splat4(xm, 32 + QUAD * k)), v)
            if (k + 1) % run_quads == 0:
                for m in range(n_rows):
                    acc[m] = v.b.add(acc[m], v.b.add(v.madd(run_lo[m], sc_lo), v.madd(run_hi[m], sc_hi)))
                    run_lo[m] = run_hi[m] = None
        for m in range(n_rows):
            v.store(acc[m], d, (m * ROWS + 8 * s) * 4)


def _emit_k6_chunk(v: Vectors, n_rows: int, low, high, subs, nibble, pair, x, stride, d) -> None:
    """d[m, r] += Σ over two sub-blocks (32 weights a row) of sc·Σ u·xq, Q6_K.

    low: the 8 quads whose nibbles (at bit `nibble`) are these weights' low bits; high: the 8 quads of
    their high bit pairs (at bits pair, pair + 1); subs: the first sub-block's scale bytes.
    """
    rows = _row_addresses(v, x, stride, n_rows)
    nibble, pair = _runtime_splat(v, nibble), _runtime_splat(v, pair)
    for s in range(ROWS // 8):
        acc = [v.load(d, (m * ROWS + 8 * s) * 4, DWORDS) for m in range(n_rows)]
        for k0 in range(0, 8, 2):  # int16 sums of two quads stay exact: 2·2·63·127 < 2^15
            scale = _scale_lanes(v, subs, (k0 // 4) * ROWS + 8 * s, True)
            run: list = [None] * n_rows
            for k in (k0, k0 + 1):
                lo = v.b.and_(
                    v.b.lshr(v.load(low, (k * ROWS + 8 * s) * QUAD, BYTES), nibble), splat(BYTES, 15)
                )
                hi = v.b.and_(v.b.lshr(v.load(high, (k * ROWS + 8 * s) * QUAD, BYTES), pair), splat(BYTES, 3))
                u = v.b.or_(lo, v.b.shl(hi, splat(BYTES, 4)))
                for m, xm in enumerate(rows):
                    run[m] = _add(run[m], v.maddubs(u, v.splat4(xm, QUAD * k)), v)
            for m in range(n_rows):
                acc[m] = v.b.add(acc[m], v.madd(run[m], scale))
        for m in range(n_rows):
            v.store(acc[m], d, (m * ROWS + 8 * s) * 4)


def _emit_offsets(v: Vectors, six: bool, n_rows: int, subs, sums, sums_stride, d) -> None:
    """d[m, r] = Σ_s o_s·Σ xq over the block's sub-blocks: o the mins (Q4_K, Q5_K) or scales (Q6_K).

    subs: the first sub-block's bytes of o; sums: the block's Q8_K sums per 16 of the first input row.
    """
    row_sums = _row_addresses(v, sums, sums_stride, n_rows)
    for s in range(ROWS // 8):
        for m, sm in enumerate(row_sums):
            total = None
            for p in range(8 if six else 4):  # sub-blocks 2p, 2p + 1
                pair = _pair_lanes(v, subs, 2 * p * ROWS + 8 * s, (2 * p + 1) * ROWS + 8 * s, six)
                total = _add(total, v.madd(pair, _sum_pairs(v, sm, 2 * p, not six)), v)
            v.store(total, d, (m * ROWS + 8 * s) * 4)


def _rows_switch(emit, n_args: int, name: str):
    """An intrinsic of n_args addresses and n_rows: emit(v, n_rows, *addresses) for n_rows 1..ROWS_AT_ONCE."""

    def codegen(context, builder, signature, values):
        *addresses, n = values
        done = builder.append_basic_block("done")
        switch = builder.switch(n, done)
        for count in range(1, ROWS_AT_ONCE + 1):
            block = builder.append_basic_block(f"rows{count}")
            switch.add_case(ir.Constant(n.type, count), block)
            with builder.goto_block(block):
                emit(Vectors(builder, AVX2), count, *addresses)
                builder.branch(done)
        builder.position_at_end(done)
        return context.get_dummy_value()

    signature = types.void(*[types.intp] * (n_args + 1))
    # numba types an intrinsic by its parameters, one each (no *args)
    if n_args == 4:

        def typer(typingctx, a, b, c, d, n_rows):
            return signature, codegen
    elif n_args == 7:

        def typer(typingctx, a, b, c, d, e, f, g, n_rows):
            return signature, codegen
    else:

        def typer(typingctx, a, b, c, d, e, f, g, h, n_rows):
            return signature, codegen

    typer.__name__ = typer.__qualname__ = name
    return intrinsic(typer)


k4_chunk = _rows_switch(lambda v, n, *a: _emit_k45_chunk(v, False, n, *a), 7, "k4_chunk")
k5_chunk = _rows_switch(lambda v, n, *a: _emit_k45_chunk(v, True, n, *a), 7, "k5_chunk")
k6_chunk = _rows_switch(_emit_k6_chunk, 8, "k6_chunk")
mins_sums = _rows_switch(lambda v, n, *a: _emit_offsets(v, False, n, *a), 4, "mins_sums")
scale_sums = _rows_switch(lambda v, n, *a: _emit_offsets(v, True, n, *a), 4, "scale_sums")


@intrinsic
def prefetch(typingctx, addr):
    """Ask for the cache line at addr, to be read soon."""

    def codegen(context, builder, signature, args):
        Vectors(builder, AVX2).prefetch(args[0], 0)
        return context.get_dummy_value()

    return types.void(types.intp), codegen


@numba.njit(nogil=True, cache=True)
def _block_dots(kind, q, x, width, sums, sums_width, d, n):
    """The int32 sums of one K block of a group (at q) with n input rows: d[m, r], d[ROWS_AT_ONCE + m, r]."""
    offsets = d + ROWS_AT_ONCE * ROWS * 4
    subs = q + (SUBS_Q6_K if kind == Q6_K else SUBS_Q5_K if kind == Q5_K else SUBS_Q4_K)
    if kind == Q6_K:
        for half in range(2):
            for i in range(4):  # weights 128·half + 32·i.., sub-blocks 8·half + 2i, + 1
                low = q + (16 * half + 8 * (i % 2)) * RQ
                k6_chunk(low, q + (32 + 8 * half) * RQ, subs + (8 * half + 2 * i) * ROWS, 4 * (i // 2), 2 * i,
                         x + 128 * half + 32 * i, width, d, n)  # fmt: skip
        scale_sums(subs, sums, sums_width, offsets, n)
    else:
        for c in range(4):  # weights 64·c.., sub-blocks 2c, 2c + 1
            if kind == Q5_K:
                k5_chunk(q + 8 * c * RQ, q + 32 * RQ, subs + 2 * c * ROWS, 2 * c, x + 64 * c, width, d, n)
            else:
                k4_chunk(q + 8 * c * RQ, q + 32 * RQ, subs + 2 * c * ROWS, 2 * c, x + 64 * c, width, d, n)
        mins_sums(subs + 8 * ROWS, sums, sums_width, offsets, n)


@numba.njit(nogil=True, cache=True)
def k_rows(xq, xd, sums, spilled, kind, quants, scales, out, g0, g1):
    """out[:, g·ROWS..] for groups g0..g1 of a Q4_K, Q5_K or Q6_K layout, on Q8_K rows (quantize_k).

    spilled: (cols, vals), the rows' values taken out before they were rounded (workers.models.outliers).
    """
    n_in, nb, width, n_halves = xq.shape[0], quants.shape[1], xq.shape[1], scales.shape[2]
    block_bytes = quants.shape[2] * RQ
    f = np.empty(nb * n_halves * ROWS, dtype=np.float32)
    acc = np.empty((ROWS_AT_ONCE, ROWS), dtype=np.float32)
    gathered = memo(quants)  # the weight columns of spilled values, each gathered once a group
    dots = np.empty((2 * ROWS_AT_ONCE, ROWS), dtype=np.int32)
    q0, x0, s0 = np.intp(quants.ctypes.data), np.intp(xq.ctypes.data), np.intp(sums.ctypes.data)
    d, sums_width = np.intp(dots.ctypes.data), sums.shape[1] * 2
    for g in range(g0, g1):
        half_to_float(scales[g], f)
        sc = f.reshape(nb, n_halves, ROWS)
        for m0 in range(0, n_in, ROWS_AT_ONCE):  # a group's block (≤ 7 KB) stays in L1 for the next rows
            n = min(ROWS_AT_ONCE, n_in - m0)
            acc[:] = 0
            for b in range(nb):
                q = q0 + (g * nb + b) * block_bytes
                for line in range(0, block_bytes, 64):
                    prefetch(q + PREFETCH + line)
                dots[:ROWS_AT_ONCE] = 0
                _block_dots(
                    kind, q, x0 + m0 * width + b * QK, width, s0 + m0 * sums_width + b * 32, sums_width, d, n
                )
                for m in range(n):
                    dx = xd[m0 + m, b]
                    if kind == Q6_K:
                        for r in range(ROWS):
                            isum = np.float32(dots[m, r] - 32 * dots[ROWS_AT_ONCE + m, r])
                            acc[m, r] += dx * (sc[b, 0, r] * isum)
                    else:
                        for r in range(ROWS):
                            isum, msum = np.float32(dots[m, r]), np.float32(dots[ROWS_AT_ONCE + m, r])
                            acc[m, r] += dx * (sc[b, 0, r] * isum - sc[b, 1, r] * msum)
            add_spilled_k(kind, quants, f, g, spilled[0], spilled[1], m0, n, acc, gathered)
            out[m0 : m0 + n, g * ROWS : (g + 1) * ROWS] = acc[:n]
