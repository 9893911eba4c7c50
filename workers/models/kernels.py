"""Products with packed Q4_0/Q4_1/Q8_0 weights, computed on the blocks.

At load, a matrix's blocks (out, in/32 blocks) are regrouped so that ROWS
output rows lie side by side: quants[g, b, j, r] is byte j of block b of row
g·ROWS + r, and the block scales sit in scales[g, b, k, r] as float16 bits.
The inner loop then runs across the ROWS rows of a group, as wide vector
instructions, and every weight byte is read once per product, whatever the
number of input rows. The regrouped tensor holds the file's bytes (Q4_0 gains
an offset per block, a last partial group is padded with zero rows).

The block kernel sums each output in one fixed order, whatever the thread
count or the other rows of the batch, so its products are deterministic and
splits of a model agree bitwise. With many input rows (prefill), dequantizing
groups of rows to float32 tiles for BLAS is faster: `PackedMatrix.__rmatmul__`
chooses by the number of rows.
"""

from __future__ import annotations

import functools
import os

import numba
import numpy as np

from workers.models.layout import BLOCK, BLOCK_BYTES, KINDS, ROWS

# Numba's OpenMP pool spins between products, stealing the cores from the
# other stages of a pipeline that take turns on them; the workqueue pool sleeps.
if "NUMBA_THREADING_LAYER" not in os.environ:
    numba.config.THREADING_LAYER = "workqueue"

KERNEL_MAX_ROWS = 8  # input rows up to which the block kernel beats dequantizing + BLAS
TILE_BYTES = 8 << 20  # float32 bytes dequantized at once for BLAS (bounds the transient memory)
Q4_0, Q4_1, Q8_0 = KINDS


# ---------------------------------------------------------------- threads


def set_threads(n: int) -> None:
    """Use n threads for the kernels (at most the ones numba started)."""
    numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))


def threads() -> int:
    """Threads the kernels use now."""
    return numba.get_num_threads()


def threads_from_env() -> int:
    """RLX_THREADS if set, else every core this process may run on."""
    value = os.environ.get("RLX_THREADS", "")
    if value:
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"RLX_THREADS must be a whole number of threads ≥ 1, got {value!r}")
        return int(value)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@functools.cache
def warm_up() -> None:
    """Size the threads from the environment and compile every kernel on a tiny matrix of each type."""
    set_threads(threads_from_env())
    rng = np.random.default_rng(0)
    for kind, size in ((Q4_1, 20), (Q8_0, 34)):
        raw = rng.integers(0, 256, (ROWS, 2 * size), dtype=np.uint8)
        scales = np.array([0.5, 0.25], np.float16).view(np.uint8)
        raw.reshape(ROWS, 2, size)[:, :, 0:4] = scales  # finite scales
        w = PackedMatrix(raw, kind, (ROWS, 2 * BLOCK))
        x = np.ones((1, 2 * BLOCK), dtype=np.float32)
        w.kernel(x)
        w.kernel(np.ones((2, 2 * BLOCK), dtype=np.float32))
        if threads() > 1:
            _parallel(w, x, np.empty((1, ROWS), dtype=np.float32), threads())
        w.blas(np.ones((KERNEL_MAX_ROWS + 1, 2 * BLOCK), dtype=np.float32))


# ---------------------------------------------------------------- float16 bits


@numba.njit(nogil=True, cache=True)
def _half_to_float(bits: np.ndarray, out: np.ndarray) -> None:
    """Finite float16 bit patterns (uint16, C order) to float32 in `out`, exactly (subnormals too)."""
    u = out.view(np.uint32)
    for i in range(bits.size):
        u[i] = np.uint32(bits[i] & 0x7FFF) << 13  # exponent and mantissa moved to float32's places
    for i in range(bits.size):
        out[i] *= np.float32(2.0**112)  # rebias the exponent from 15 to 127 (subnormals become normal)
        if bits[i] & 0x8000:
            out[i] = -out[i]


# ---------------------------------------------------------------- the block kernels


@numba.njit(nogil=True, fastmath=True, cache=True)
def _q4_rows(x, quants, scales, out, g0, g1):
    """out[:, g·ROWS..] for groups g0..g1 of a Q4_1 layout: Σ_b d·Σ_j q·x + m·Σ_j x.

    A byte q holds weight j (q & 15) and weight j + 16 (q >> 4), so that
    lo·x_j + hi·x_j+16 = (q & 15)·(x_j - x_j+16/16) + q·(x_j+16/16): two
    conversions and two multiply-adds a byte, vectorized across the rows.
    """
    n_in, nb = x.shape[0], quants.shape[1]
    f = np.empty(nb * 2 * ROWS, dtype=np.float32)
    part = np.empty(ROWS, dtype=np.float32)
    acc = np.empty((n_in, ROWS), dtype=np.float32)
    for g in range(g0, g1):
        _half_to_float(scales[g].ravel(), f)
        sc = f.reshape(nb, 2, ROWS)
        acc[:] = 0
        for b in range(nb):
            for m in range(n_in):
                part[:] = 0
                xsum = np.float32(0)
                for j in range(0, 16, 4):
                    o = b * 32 + j
                    h0, h1 = x[m, o + 16] * np.float32(0.0625), x[m, o + 17] * np.float32(0.0625)
                    h2, h3 = x[m, o + 18] * np.float32(0.0625), x[m, o + 19] * np.float32(0.0625)
                    l0, l1, l2, l3 = x[m, o] - h0, x[m, o + 1] - h1, x[m, o + 2] - h2, x[m, o + 3] - h3
                    xsum += (x[m, o] + x[m, o + 1] + x[m, o + 2] + x[m, o + 3]) + (
                        x[m, o + 16] + x[m, o + 17] + x[m, o + 18] + x[m, o + 19]
                    )
                    for r in range(ROWS):
                        q0, q1 = quants[g, b, j, r], quants[g, b, j + 1, r]
                        q2, q3 = quants[g, b, j + 2, r], quants[g, b, j + 3, r]
                        part[r] += (
                            (np.float32(q0 & 15) * l0 + np.float32(q0) * h0)
                            + (np.float32(q1 & 15) * l1 + np.float32(q1) * h1)
                        ) + (
                            (np.float32(q2 & 15) * l2 + np.float32(q2) * h2)
                            + (np.float32(q3 & 15) * l3 + np.float32(q3) * h3)
                        )
                for r in range(ROWS):
                    acc[m, r] += sc[b, 0, r] * part[r] + sc[b, 1, r] * xsum
        for m in range(n_in):
            for r in range(ROWS):
                out[m, g * ROWS + r] = acc[m, r]


@numba.njit(nogil=True, fastmath=True, cache=True)
def _q8_rows(x, quants, scales, out, g0, g1):
    """out[:, g·ROWS..] for groups g0..g1 of a Q8_0 layout: Σ_b d·Σ_j q·x."""
    n_in, nb = x.shape[0], quants.shape[1]
    f = np.empty(nb * ROWS, dtype=np.float32)
    part = np.empty(ROWS, dtype=np.float32)
    acc = np.empty((n_in, ROWS), dtype=np.float32)
    for g in range(g0, g1):
        _half_to_float(scales[g].ravel(), f)
        sc = f.reshape(nb, ROWS)
        acc[:] = 0
        for b in range(nb):
            for m in range(n_in):
                part[:] = 0
                for j in range(0, 32, 4):
                    o = b * 32 + j
                    x0, x1, x2, x3 = x[m, o], x[m, o + 1], x[m, o + 2], x[m, o + 3]
                    for r in range(ROWS):
                        q0, q1 = np.float32(quants[g, b, j, r]), np.float32(quants[g, b, j + 1, r])
                        q2, q3 = np.float32(quants[g, b, j + 2, r]), np.float32(quants[g, b, j + 3, r])
                        part[r] += (q0 * x0 + q1 * x1) + (q2 * x2 + q3 * x3)
                for r in range(ROWS):
                    acc[m, r] += sc[b, r] * part[r]
        for m in range(n_in):
            for r in range(ROWS):
                out[m, g * ROWS + r] = acc[m, r]


@numba.njit(nogil=True, fastmath=True, cache=True)
def _q4_batch(x, quants, scales, out, g0, g1):
    """_q4_rows for several input rows: each block's bytes converted to float32 once for all of them."""
    n_in, nb = x.shape[0], quants.shape[1]
    f = np.empty(nb * 2 * ROWS, dtype=np.float32)
    low, whole = np.empty((16, ROWS), dtype=np.float32), np.empty((16, ROWS), dtype=np.float32)
    part = np.empty(ROWS, dtype=np.float32)
    acc = np.empty((n_in, ROWS), dtype=np.float32)
    for g in range(g0, g1):
        _half_to_float(scales[g].ravel(), f)
        sc = f.reshape(nb, 2, ROWS)
        acc[:] = 0
        for b in range(nb):
            for j in range(16):
                for r in range(ROWS):
                    low[j, r], whole[j, r] = (
                        np.float32(quants[g, b, j, r] & 15),
                        np.float32(quants[g, b, j, r]),
                    )
            for m in range(n_in):
                part[:] = 0
                xsum = np.float32(0)
                for j in range(0, 16, 4):
                    o = b * 32 + j
                    h0, h1 = x[m, o + 16] * np.float32(0.0625), x[m, o + 17] * np.float32(0.0625)
                    h2, h3 = x[m, o + 18] * np.float32(0.0625), x[m, o + 19] * np.float32(0.0625)
                    l0, l1, l2, l3 = x[m, o] - h0, x[m, o + 1] - h1, x[m, o + 2] - h2, x[m, o + 3] - h3
                    xsum += (x[m, o] + x[m, o + 1] + x[m, o + 2] + x[m, o + 3]) + (
                        x[m, o + 16] + x[m, o + 17] + x[m, o + 18] + x[m, o + 19]
                    )
                    for r in range(ROWS):
                        part[r] += (
                            (low[j, r] * l0 + whole[j, r] * h0) + (low[j + 1, r] * l1 + whole[j + 1, r] * h1)
                        ) + (
                            (low[j + 2, r] * l2 + whole[j + 2, r] * h2)
                            + (low[j + 3, r] * l3 + whole[j + 3, r] * h3)
                        )
                for r in range(ROWS):
                    acc[m, r] += sc[b, 0, r] * part[r] + sc[b, 1, r] * xsum
        for m in range(n_in):
            for r in range(ROWS):
                out[m, g * ROWS + r] = acc[m, r]


@numba.njit(nogil=True, fastmath=True, cache=True)
def _q8_batch(x, quants, scales, out, g0, g1):
    """_q8_rows for several input rows: each block's bytes converted to float32 once for all of them."""
    n_in, nb = x.shape[0], quants.shape[1]
    f = np.empty(nb * ROWS, dtype=np.float32)
    w = np.empty((32, ROWS), dtype=np.float32)
    part = np.empty(ROWS, dtype=np.float32)
    acc = np.empty((n_in, ROWS), dtype=np.float32)
    for g in range(g0, g1):
        _half_to_float(scales[g].ravel(), f)
        sc = f.reshape(nb, ROWS)
        acc[:] = 0
        for b in range(nb):
            for j in range(32):
                for r in range(ROWS):
                    w[j, r] = np.float32(quants[g, b, j, r])
            for m in range(n_in):
                part[:] = 0
                for j in range(0, 32, 4):
                    o = b * 32 + j
                    x0, x1, x2, x3 = x[m, o], x[m, o + 1], x[m, o + 2], x[m, o + 3]
                    for r in range(ROWS):
                        part[r] += (w[j, r] * x0 + w[j + 1, r] * x1) + (w[j + 2, r] * x2 + w[j + 3, r] * x3)
                for r in range(ROWS):
                    acc[m, r] += sc[b, r] * part[r]
        for m in range(n_in):
            for r in range(ROWS):
                out[m, g * ROWS + r] = acc[m, r]


@numba.njit(nogil=True, parallel=True, cache=True)
def _q4_parallel(x, quants, scales, out, n_chunks):
    """_q4_rows over the groups cut in n_chunks, one numba thread each."""
    n_groups = quants.shape[0]
    for c in numba.prange(n_chunks):
        g0, g1 = c * n_groups // n_chunks, (c + 1) * n_groups // n_chunks
        if x.shape[0] == 1:
            _q4_rows(x, quants, scales, out, g0, g1)
        else:
            _q4_batch(x, quants, scales, out, g0, g1)


@numba.njit(nogil=True, parallel=True, cache=True)
def _q8_parallel(x, quants, scales, out, n_chunks):
    """_q8_rows over the groups cut in n_chunks, one numba thread each."""
    n_groups = quants.shape[0]
    for c in numba.prange(n_chunks):
        g0, g1 = c * n_groups // n_chunks, (c + 1) * n_groups // n_chunks
        if x.shape[0] == 1:
            _q8_rows(x, quants, scales, out, g0, g1)
        else:
            _q8_batch(x, quants, scales, out, g0, g1)


@numba.njit(nogil=True, cache=True)
def _dequantize_q4(quants, scales, g0, g1, out):
    """Weights of Q4_1 groups g0..g1 as float32 (in, (g1-g0)·ROWS) in `out`: the file's d·q + m."""
    nb = quants.shape[1]
    f = np.empty(nb * 2 * ROWS, dtype=np.float32)
    for g in range(g0, g1):
        _half_to_float(scales[g].ravel(), f)
        sc = f.reshape(nb, 2, ROWS)
        c0 = (g - g0) * ROWS
        for b in range(nb):
            for j in range(16):
                lo, hi = out[b * 32 + j], out[b * 32 + 16 + j]
                for r in range(ROWS):
                    q = quants[g, b, j, r]
                    lo[c0 + r] = sc[b, 0, r] * np.float32(q & 15) + sc[b, 1, r]
                    hi[c0 + r] = sc[b, 0, r] * np.float32(q >> 4) + sc[b, 1, r]


@numba.njit(nogil=True, cache=True)
def _dequantize_q8(quants, scales, g0, g1, out):
    """Weights of Q8_0 groups g0..g1 as float32 (in, (g1-g0)·ROWS) in `out`: the file's d·q."""
    nb = quants.shape[1]
    f = np.empty(nb * ROWS, dtype=np.float32)
    for g in range(g0, g1):
        _half_to_float(scales[g].ravel(), f)
        sc = f.reshape(nb, ROWS)
        c0 = (g - g0) * ROWS
        for b in range(nb):
            for j in range(32):
                row = out[b * 32 + j]
                for r in range(ROWS):
                    row[c0 + r] = sc[b, r] * np.float32(quants[g, b, j, r])


# ---------------------------------------------------------------- the layout


class PackedMatrix:
    """A matrix (out, in) of Q4_0, Q4_1 or Q8_0 blocks, regrouped ROWS rows at a time; `x @ w` works.

    quants: (groups, blocks, 16 or 32, ROWS) uint8 (Q4: two weights a byte) or int8 (Q8_0).
    scales: (groups, blocks, 2 or 1, ROWS) float16 bits: d and m (Q4), d (Q8_0).
    """

    __array_ufunc__ = None  # so that `x @ w` calls __rmatmul__

    def __init__(self, raw: np.ndarray, kind: str, shape: tuple[int, int]) -> None:
        if kind not in KINDS:
            raise ValueError(f"block type {kind!r} has no kernel; accepted: {', '.join(KINDS)}")
        out, inp = shape
        if inp % BLOCK:
            raise ValueError(f"a packed matrix's rows must hold whole blocks of {BLOCK}, got {inp}")
        self.kind, self.shape = kind, shape
        self.quants, self.scales = _regroup(raw, kind, out, inp // BLOCK)
        self.nbytes = self.quants.nbytes + self.scales.nbytes

    def __rmatmul__(self, x: np.ndarray) -> np.ndarray:
        """x (T, in) float32 times the matrix: (T, out)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.shape[1]:
            raise ValueError(f"cannot multiply {x.shape} by a packed ({self.shape[1]}, {self.shape[0]})")
        if x.shape[0] <= KERNEL_MAX_ROWS:
            return self.kernel(x)
        return self.blas(x)

    def kernel(self, x: np.ndarray) -> np.ndarray:
        """The product on the blocks: each weight byte read (and converted) once for all rows of x."""
        n_groups = self.quants.shape[0]
        out = np.empty((x.shape[0], n_groups * ROWS), dtype=np.float32)
        n = min(numba.get_num_threads(), n_groups)
        if n == 1:
            q4, one = self.quants.shape[2] == 16, x.shape[0] == 1
            kernel = (_q4_rows if one else _q4_batch) if q4 else (_q8_rows if one else _q8_batch)
            kernel(x, self.quants, self.scales, out, 0, n_groups)
        else:
            _parallel(self, x, out, n)
        return out[:, : self.shape[0]]

    def blas(self, x: np.ndarray) -> np.ndarray:
        """The product through BLAS on float32 tiles of ROWS-row groups, dequantized one tile at a time."""
        n_groups, inp = self.quants.shape[0], self.shape[1]
        step = max(1, TILE_BYTES // (inp * ROWS * 4))
        out = np.empty((x.shape[0], n_groups * ROWS), dtype=np.float32)
        tile = np.empty((inp, min(step, n_groups) * ROWS), dtype=np.float32)
        for g0 in range(0, n_groups, step):
            g1 = min(g0 + step, n_groups)
            w = tile[:, : (g1 - g0) * ROWS]
            self._dequantize(g0, g1, w)
            np.matmul(x, w, out=out[:, g0 * ROWS : g1 * ROWS])
        return out[:, : self.shape[0]]

    def dequantize(self) -> np.ndarray:
        """The whole matrix as float32 (out, in), as the file's blocks give it."""
        w = np.empty((self.shape[1], self.quants.shape[0] * ROWS), dtype=np.float32)
        self._dequantize(0, self.quants.shape[0], w)
        return np.ascontiguousarray(w[:, : self.shape[0]].T)

    def _dequantize(self, g0: int, g1: int, out: np.ndarray) -> None:
        q4 = self.quants.shape[2] == 16
        (_dequantize_q4 if q4 else _dequantize_q8)(self.quants, self.scales, g0, g1, out)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` (T,) of the matrix as float32 (T, in): a table's embedding lookup."""
        g, r = np.divmod(ids, ROWS)
        q = self.quants[g, :, :, r]  # (T, blocks, 16 or 32)
        sc = self.scales[g, :, :, r].view(np.float16).astype(np.float32)  # (T, blocks, 2 or 1)
        if q.shape[2] == 32:
            w = sc[:, :, :1] * q.astype(np.float32)
        else:
            both = np.concatenate([q & 15, q >> 4], axis=2).astype(np.float32)  # (T, blocks, 32)
            w = sc[:, :, :1] * both + sc[:, :, 1:]
        return w.reshape(len(ids), self.shape[1])


def _parallel(w: PackedMatrix, x: np.ndarray, out: np.ndarray, n: int) -> None:
    """The block kernel with w's groups cut in n chunks, one numba thread each."""
    q4 = w.quants.shape[2] == 16
    (_q4_parallel if q4 else _q8_parallel)(x, w.quants, w.scales, out, n)


def _regroup(raw: np.ndarray, kind: str, out: int, nb: int) -> tuple[np.ndarray, np.ndarray]:
    """The file's blocks (out, nb·block bytes) as (quants, scales) in the ROWS-row layout."""
    size = BLOCK_BYTES[kind] - (kind == Q4_0) * 2  # as stored: Q4_0 has no offset
    if raw.shape != (out, nb * size):
        raise ValueError(f"{kind} data of shape {raw.shape} does not hold ({out}, {nb * BLOCK}) weights")
    blocks = raw.reshape(out, nb, size)
    d = blocks[:, :, 0:2].copy().view(np.float16)  # (out, nb, 1)
    if kind == Q4_0:  # q - 8 with scale d is q with scale d and offset -8·d (exact in float16)
        scales, q = np.concatenate([d, d * np.float16(-8)], axis=2), blocks[:, :, 2:]
    elif kind == Q4_1:
        scales, q = blocks[:, :, 0:4].copy().view(np.float16), blocks[:, :, 4:]
    else:
        scales, q = d, blocks[:, :, 2:].view(np.int8)
    pad = -out % ROWS
    if pad:  # zero rows fill the last group; products drop their columns
        scales = np.concatenate([scales, np.zeros((pad, *scales.shape[1:]), scales.dtype)])
        q = np.concatenate([q, np.zeros((pad, *q.shape[1:]), q.dtype)])
    groups = (out + pad) // ROWS

    def interleave(a: np.ndarray) -> np.ndarray:  # (rows, nb, k) → (groups, nb, k, ROWS)
        return np.ascontiguousarray(a.reshape(groups, ROWS, nb, a.shape[2]).transpose(0, 2, 3, 1))

    return interleave(q), interleave(scales.view(np.uint16))
