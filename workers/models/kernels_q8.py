"""Products of packed blocks with input rows quantized to 8 bits per block of 32, in integers.

As llama.cpp does for its Q8_0/Q8_1 activations: each input row's block of
32 values becomes int8 codes xq = round(x / dx) with dx = max|x| / 127, and
for each weight block the dot product Σ_j q·xq is an exact integer sum,
scaled once by the block's scales (Q4_1: d·dx·Σ q·xq + m·dx·Σ xq).

The integer sums are LLVM IR built here (q4_dots, q8_dots), as llama.cpp
computes them: vpmaddubsw multiplies unsigned weight bytes (Q4's nibbles;
Q8_0's magnitudes, their signs moved to the codes by vpsignb) by the signed
codes and adds adjacent products in int16, vpmaddwd adds those in int32. The
lanes run across 8 output rows, each row's 4 bytes side by side (the layout
of workers.models.kernels), so a block's sums need no horizontal adds, and
each weight vector loaded is multiplied into up to ROWS_AT_ONCE input rows.
On a CPU without AVX2 (has_avx2: numba's target, NUMBA_CPU_FEATURES or the
host's) the same IR is built from plain vector operations that any LLVM
target lowers, with the same integer results.

Unlike llama.cpp, the few values of a row far above its RMS are taken out
first and multiplied exactly (workers.models.outliers, spilled in products.activations):
rounded with their blocks, they would coarsen the steps of the whole block.

The product is exactly the weights times the rounded rows x̃ = dx·xq, so its
error against the float32 product is Σ_j w_j·(x_j - x̃_j), at most
Σ_b (dx_b / 2)·Σ_j |w_bj| per output: about 1e-3 of its scale, not float32
rounding. The integer sums are exact and the float sums run in one fixed
order, so a row's outputs do not depend on the other rows of the batch, the
thread count or how a model is split: splits agree bitwise.
"""

from __future__ import annotations

import llvmlite.binding
import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from workers.models import jit  # noqa: F401  (the kernels' cache directory, before any cache=True)
from workers.models.outliers import add_spilled_q4, add_spilled_q8, memo
from workers.models.quants import QUAD, ROWS

BLOCK = 32  # values of an input row rounded together (Q8_0, Q8_1), and weights of a 32-weight type's block
HALF = BLOCK // 2  # bytes of a Q4 block's row: weight j in the low nibble, weight j + 16 in the high one
ROWS_AT_ONCE = 4  # input rows multiplied into each weight vector loaded
# Weight bytes times input rows below which another thread costs more than it saves, by numba's
# threading layer: waking its threads takes ~4 µs with OpenMP's pool (they spin a while between
# products), ~45 µs with the workqueue's (they sleep); a product of 1 MB takes ~130 µs. Measured on
# Zen 1, 2 cores: with OpenMP's pool even SmolLM2's smallest products gain from a second thread (a
# 576×576 Q4_1 matrix, 207 KB: 28.7 µs on one, 18.4 on two), and a decode token at 2 threads is
# 2-4% faster splitting every product than with the 256 KB a thread this was before.
CHUNK_MIN_BYTES = {"omp": 32 << 10, "workqueue": 1 << 20}
# Bytes ahead of the block being multiplied that are asked for: the weights stream from memory once a
# token, and the hardware's prefetcher stops at each 4 KB page (decode 5-10% faster at 1 KB ahead).
PREFETCH = 1024

I1, I8, I16, I32 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32)
BYTES, WORDS, DWORDS = ir.VectorType(I8, 32), ir.VectorType(I16, 16), ir.VectorType(I32, 8)
HALVES, FLOATS = ir.VectorType(I16, 8), ir.VectorType(ir.FloatType(), 8)


def has_avx2() -> bool:
    """Whether numba compiles for a CPU with AVX2 and F16C (its NUMBA_CPU_FEATURES, else this host's)."""
    features = numba.config.CPU_FEATURES or llvmlite.binding.get_host_cpu_features().flatten()
    return {"+avx2", "+f16c"} <= set(features.split(","))


# Flags that let a block's largest magnitude and its codes' sum run in vector lanes (the values of
# a forward are finite; a maximum and an integer sum are exact in any order) without changing a
# value: no reciprocal for a division, no fused multiply-add (bitwise the codes of scalar loops).
VECTOR_LANES = {"nnan", "ninf", "nsz", "reassoc"}


@numba.njit(nogil=True, fastmath=VECTOR_LANES, cache=True)
def quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows x (T, in) float32 as int8 codes in -127..127 (T, in), block scales dx and dx·Σ codes (T, in/32).

    The codes are int8, the width vpmaddubsw multiplies.
    """
    n_in, nb = x.shape[0], x.shape[1] // BLOCK
    xq = np.empty(x.shape, dtype=np.int8)
    xd, xs = np.empty((n_in, nb), dtype=np.float32), np.empty((n_in, nb), dtype=np.float32)
    quantize_rows(x, xq, xd, xs, 0, n_in)
    return xq, xd, xs


@numba.njit(nogil=True, fastmath=VECTOR_LANES, cache=True)
def quantize_rows(x, xq, xd, xs, m0, m1) -> None:
    """quantize's rows m0..m1 of x into xq, xd, xs."""
    for m in range(m0, m1):
        row, codes = x[m], xq[m]
        for b in range(x.shape[1] // BLOCK):
            j0 = b * BLOCK
            amax = np.float32(0)
            for j in range(j0, j0 + BLOCK):  # indexed: a loop over an iterator does not vectorize
                amax = max(amax, abs(row[j]))
            inv = np.float32(127) / amax if amax > 0 else np.float32(0)
            total = np.int32(0)
            for j in range(j0, j0 + BLOCK):
                code = np.int32(np.rint(row[j] * inv))
                codes[j] = np.int8(code)
                total += code
            xd[m, b] = amax / np.float32(127)
            xs[m, b] = xd[m, b] * np.float32(total)


# ---------------------------------------------------------------- vector code, as LLVM IR


def splat(ty: ir.VectorType, value) -> ir.Constant:
    """A constant vector of `ty` with every lane `value`."""
    return ir.Constant(ty, [value] * ty.count)


class Vectors:
    """The few vector operations the kernels need: AVX2 instructions, or plain IR that any target lowers."""

    def __init__(self, builder: ir.IRBuilder, native: bool) -> None:
        self.b, self.native = builder, native

    def shuffle(self, a, b, lanes: list[int]):
        return self.b.shuffle_vector(a, b, ir.Constant(ir.VectorType(I32, len(lanes)), lanes))

    def address(self, addr, offset: int):
        return self.b.add(addr, ir.Constant(addr.type, offset))

    def load(self, addr, offset: int, ty):
        return self.b.load(self.b.inttoptr(self.address(addr, offset), ty.as_pointer()), align=1)

    def store(self, value, addr, offset: int) -> None:
        self.b.store(value, self.b.inttoptr(self.address(addr, offset), value.type.as_pointer()), align=1)

    def splat4(self, addr, offset: int):
        """The 4 bytes at addr + offset repeated over 32 bytes."""
        word = self.load(addr, offset, I32)
        one = self.b.insert_element(ir.Constant(DWORDS, None), word, ir.Constant(I32, 0))
        return self.b.bitcast(self.shuffle(one, one, [0] * 8), BYTES)

    def maddubs(self, u, s):
        """Unsigned bytes u times signed bytes s, adjacent products added in int16: vpmaddubsw."""
        if self.native:
            return self._call("llvm.x86.avx2.pmadd.ub.sw", WORDS, u, s)
        wide = ir.VectorType(I16, 32)
        return self._pairs(self.b.mul(self.b.zext(u, wide), self.b.sext(s, wide)))

    def madd(self, a, b):
        """int16 lanes a times b, adjacent products added in int32: vpmaddwd."""
        if self.native:
            return self._call("llvm.x86.avx2.pmadd.wd", DWORDS, a, b)
        wide = ir.VectorType(I32, 16)
        return self._pairs(self.b.mul(self.b.sext(a, wide), self.b.sext(b, wide)))

    def madd_ones(self, w):
        """int16 lanes, adjacent ones added in int32: vpmaddwd by ones."""
        if self.native:
            return self._call("llvm.x86.avx2.pmadd.wd", DWORDS, w, splat(WORDS, 1))
        return self._pairs(self.b.sext(w, ir.VectorType(I32, 16)))

    def sign(self, x, w):
        """x negated where w < 0, zero where w == 0: vpsignb."""
        if self.native:
            return self._call("llvm.x86.avx2.psign.b", BYTES, x, w)
        zero = splat(BYTES, 0)
        kept = self.b.select(self.b.icmp_signed("==", w, zero), zero, x)
        return self.b.select(self.b.icmp_signed("<", w, zero), self.b.neg(x), kept)

    def abs(self, w):
        return self._call("llvm.abs.v32i8", BYTES, w, ir.Constant(I1, 0))

    def half_to_float(self, bits):
        """Eight float16 bit patterns as float32, exactly: vcvtph2ps."""
        if self.native:
            return self.b.fpext(self.b.bitcast(bits, ir.VectorType(ir.HalfType(), 8)), FLOATS)
        # Exponent and mantissa moved to float32's places, rebiased from 15 to 127 by 2^112
        # (subnormals become normal), then the sign put back.
        wide = self.b.zext(bits, DWORDS)
        moved = self.b.shl(self.b.and_(wide, splat(DWORDS, 0x7FFF)), splat(DWORDS, 13))
        scaled = self.b.fmul(self.b.bitcast(moved, FLOATS), splat(FLOATS, 2.0**112))
        sign = self.b.shl(self.b.and_(wide, splat(DWORDS, 0x8000)), splat(DWORDS, 16))
        return self.b.bitcast(self.b.or_(self.b.bitcast(scaled, DWORDS), sign), FLOATS)

    def prefetch(self, addr, offset: int) -> None:
        """Ask for the cache line at addr + offset, to be read soon."""
        ptr = self.b.inttoptr(self.address(addr, offset), ir.IntType(8).as_pointer())
        self._call(
            "llvm.prefetch.p0",
            ir.VoidType(),
            ptr,
            ir.Constant(I32, 0),
            ir.Constant(I32, 3),
            ir.Constant(I32, 1),
        )

    def _call(self, name: str, ret, *args):
        fn = cgutils.get_or_insert_function(self.b.module, ir.FunctionType(ret, [a.type for a in args]), name)
        return self.b.call(fn, args)

    def _pairs(self, v):
        """Adjacent lanes of v added (the sums here never leave the narrower type's range)."""
        n = v.type.count
        return self.b.add(self.shuffle(v, v, list(range(0, n, 2))), self.shuffle(v, v, list(range(1, n, 2))))


def _products(v: Vectors, q4: bool, w, rows: list, k: int) -> list:
    """Each row's codes times weight bytes w (quad k of 8 rows): int16 pair sums (Q4), int32 sums (Q8_0)."""
    if q4:  # a byte's low nibble is weight j, its high one weight j + 16
        lo, hi = v.b.and_(w, splat(BYTES, 15)), v.b.lshr(w, splat(BYTES, 4))
        at = (QUAD * k, HALF + QUAD * k)
        return [v.b.add(v.maddubs(lo, v.splat4(x, at[0])), v.maddubs(hi, v.splat4(x, at[1]))) for x in rows]
    magnitude = v.abs(w)  # Q8_0's weights are signed: their signs move to the codes
    return [v.madd_ones(v.maddubs(magnitude, v.sign(v.splat4(x, QUAD * k), w))) for x in rows]


def _emit_dots(v: Vectors, q4: bool, n_rows: int, q, x, stride, d) -> None:
    """int32 d[m, r] = Σ_j weight j of row r of the block at q times code j of row m at x + m·stride.

    Eight weight rows at a time (a vector of their quads), each vector
    multiplied into every input row. Q4's int16 sums stay exact over a
    whole block: 16 pair sums of 2·15·127 at most.
    """
    rows = [v.b.add(x, v.b.mul(stride, ir.Constant(stride.type, m))) for m in range(n_rows)]
    for line in range(0, (HALF if q4 else BLOCK) * ROWS, 64):  # as many cache lines ahead as the block has
        v.prefetch(q, PREFETCH + line)
    for s in range(ROWS // 8):
        acc: list = [None] * n_rows
        for k in range((HALF if q4 else BLOCK) // QUAD):
            w = v.load(q, (k * ROWS + 8 * s) * QUAD, BYTES)
            for m, p in enumerate(_products(v, q4, w, rows, k)):
                acc[m] = p if acc[m] is None else v.b.add(acc[m], p)
        for m, total in enumerate(acc):
            v.store(v.madd_ones(total) if q4 else total, d, (m * ROWS + 8 * s) * 4)


def _block_dots(q4: bool):
    """An intrinsic (q, x, stride, d, n_rows): _emit_dots for n_rows 1..ROWS_AT_ONCE, chosen at run time."""

    def dots(typingctx, q, x, stride, d, n_rows):
        def codegen(context, builder, signature, args):
            *addresses, n = args
            done = builder.append_basic_block("done")
            switch = builder.switch(n, done)
            for count in range(1, ROWS_AT_ONCE + 1):
                block = builder.append_basic_block(f"rows{count}")
                switch.add_case(ir.Constant(n.type, count), block)
                with builder.goto_block(block):
                    _emit_dots(Vectors(builder, AVX2), q4, count, *addresses)
                    builder.branch(done)
            builder.position_at_end(done)
            return context.get_dummy_value()

        return types.void(types.intp, types.intp, types.intp, types.intp, types.intp), codegen

    dots.__name__ = dots.__qualname__ = "q4_dots" if q4 else "q8_dots"
    return intrinsic(dots)


@intrinsic
def _eight_halves(typingctx, src, dst):
    """Eight float16 bit patterns at address src as float32 at address dst."""

    def codegen(context, builder, signature, args):
        v = Vectors(builder, AVX2)
        v.store(v.half_to_float(v.load(args[0], 0, HALVES)), args[1], 0)
        return context.get_dummy_value()

    return types.void(types.intp, types.intp), codegen


AVX2 = has_avx2()
q4_dots, q8_dots = _block_dots(True), _block_dots(False)


@numba.njit(nogil=True, cache=True)
def half_to_float(bits: np.ndarray, out: np.ndarray) -> None:
    """Finite float16 bit patterns (uint16, C-contiguous, a multiple of 8) to float32 in `out`, exactly."""
    src, dst = np.intp(bits.ctypes.data), np.intp(out.ctypes.data)
    for i in range(0, bits.size, 8):
        _eight_halves(src + 2 * i, dst + 4 * i)


# ---------------------------------------------------------------- the kernels


@numba.njit(nogil=True, cache=True)
def q4_rows(xq, xd, xs, spilled, quants, scales, out, g0, g1):
    """out[:, g·ROWS..] for groups g0..g1 of a Q4_1 layout: Σ_b d·dx·Σ_j q·xq + m·dx·Σ_j xq + spilled."""
    n_in, nb, width = xq.shape[0], quants.shape[1], xq.shape[1]
    f = np.empty(nb * 2 * ROWS, dtype=np.float32)
    acc = np.empty((ROWS_AT_ONCE, ROWS), dtype=np.float32)
    gathered = memo(quants)  # the weight columns of spilled values, each gathered once a group
    dots = np.empty((ROWS_AT_ONCE, ROWS), dtype=np.int32)
    q0, x0, d = np.intp(quants.ctypes.data), np.intp(xq.ctypes.data), np.intp(dots.ctypes.data)
    for g in range(g0, g1):
        half_to_float(scales[g], f)
        sc = f.reshape(nb, 2, ROWS)
        for m0 in range(0, n_in, ROWS_AT_ONCE):  # a group's bytes (≤ 24 KB) stay in L1 for the next rows
            n = min(ROWS_AT_ONCE, n_in - m0)
            acc[:] = 0
            for b in range(nb):
                q4_dots(q0 + (g * nb + b) * HALF * ROWS, x0 + m0 * width + b * BLOCK, width, d, n)
                for m in range(n):
                    dx, sx = xd[m0 + m, b], xs[m0 + m, b]
                    for r in range(ROWS):
                        acc[m, r] += sc[b, 0, r] * (dx * np.float32(dots[m, r])) + sc[b, 1, r] * sx
            add_spilled_q4(quants, f, g, spilled[0], spilled[1], m0, n, acc, gathered)
            out[m0 : m0 + n, g * ROWS : (g + 1) * ROWS] = acc[:n]


@numba.njit(nogil=True, cache=True)
def q8_rows(xq, xd, xs, spilled, quants, scales, out, g0, g1):
    """out[:, g·ROWS..] for groups g0..g1 of a Q8_0 layout: Σ_b d·dx·Σ_j q·xq + spilled (xs unused)."""
    n_in, nb, width = xq.shape[0], quants.shape[1], xq.shape[1]
    f = np.empty(nb * ROWS, dtype=np.float32)
    acc = np.empty((ROWS_AT_ONCE, ROWS), dtype=np.float32)
    gathered = memo(quants)  # the weight columns of spilled values, each gathered once a group
    dots = np.empty((ROWS_AT_ONCE, ROWS), dtype=np.int32)
    q0, x0, d = np.intp(quants.ctypes.data), np.intp(xq.ctypes.data), np.intp(dots.ctypes.data)
    for g in range(g0, g1):
        half_to_float(scales[g], f)
        sc = f.reshape(nb, ROWS)
        for m0 in range(0, n_in, ROWS_AT_ONCE):  # a group's bytes (≤ 48 KB) stay in cache for the next rows
            n = min(ROWS_AT_ONCE, n_in - m0)
            acc[:] = 0
            for b in range(nb):
                q8_dots(q0 + (g * nb + b) * BLOCK * ROWS, x0 + m0 * width + b * BLOCK, width, d, n)
                for m in range(n):
                    dx = xd[m0 + m, b]
                    for r in range(ROWS):
                        acc[m, r] += sc[b, r] * (dx * np.float32(dots[m, r]))
            add_spilled_q8(quants, f, g, spilled[0], spilled[1], m0, n, acc, gathered)
            out[m0 : m0 + n, g * ROWS : (g + 1) * ROWS] = acc[:n]
