"""Products of a few input rows (2..FEW_MAX_ROWS) with float32 weights, each weight read once.

One row times a matrix goes to BLAS as a matrix-vector product, at the speed
memory delivers the weights. Two to eight rows go to its general matrix
product, which first packs the whole weight matrix into its own panels: on
this kind of machine (OpenBLAS, AVX2) two rows then cost twice what one row
costs, and four rows no less than two. A batched decode step (one row per
session in flight) is exactly such a product, so these kernels stream each
weight once and multiply it into every row while it is at hand.

Each output is summed in one fixed order, whatever the thread count, so the
product is deterministic (it may differ from BLAS's in the last bits, as two
BLAS calls of different shapes may).
"""

from __future__ import annotations

import functools

import numba
import numpy as np

from workers.models import kernels

# Up to this many rows the kernels beat BLAS here (bench/kernels.py: from 8 rows BLAS's packing pays off).
FEW_MAX_ROWS = 4
TILE = 256  # output columns summed at once: FEW_MAX_ROWS × TILE float32 accumulators stay in L1


@numba.njit(nogil=True, fastmath=True, cache=True)
def _by_rows(x, w, out, c0, c1):
    """out[:, c0:c1] = x @ w[:, c0:c1] for w (in, out) in C order: each weight read once.

    Four rows of w at a time go into each tile of accumulators, so that the
    accumulators are loaded and stored once per four multiply-adds.
    """
    n_in, inp = x.shape
    whole = inp - inp % 4
    acc = np.empty((n_in, TILE), dtype=np.float32)
    for t0 in range(c0, c1, TILE):
        t1 = min(t0 + TILE, c1)
        width = t1 - t0
        acc[:, :width] = 0
        for k in range(0, whole, 4):
            r0, r1, r2, r3 = w[k, t0:t1], w[k + 1, t0:t1], w[k + 2, t0:t1], w[k + 3, t0:t1]
            for m in range(n_in):
                x0, x1, x2, x3 = x[m, k], x[m, k + 1], x[m, k + 2], x[m, k + 3]
                for j in range(width):
                    acc[m, j] += (x0 * r0[j] + x1 * r1[j]) + (x2 * r2[j] + x3 * r3[j])
        for k in range(whole, inp):
            r0 = w[k, t0:t1]
            for m in range(n_in):
                x0 = x[m, k]
                for j in range(width):
                    acc[m, j] += x0 * r0[j]
        out[:, t0:t1] = acc[:, :width]


@numba.njit(nogil=True, fastmath=True, cache=True)
def _by_columns(x, wt, out, c0, c1):
    """out[:, c0:c1] = x @ wt[c0:c1].T for wt (out, in) in C order: each output a dot product."""
    n_in, inp = x.shape
    for c in range(c0, c1):
        col = wt[c]
        for m in range(n_in):
            s = np.float32(0)
            for k in range(inp):
                s += x[m, k] * col[k]
            out[m, c] = s


@numba.njit(nogil=True, parallel=True, cache=True)
def _parallel(x, w, out, n_chunks, transposed):
    """One of the kernels over the output columns cut in n_chunks (whole tiles), one numba thread each."""
    cols = out.shape[1]
    tiles = (cols + TILE - 1) // TILE
    for i in numba.prange(n_chunks):
        c0 = min(cols, i * tiles // n_chunks * TILE)
        c1 = min(cols, (i + 1) * tiles // n_chunks * TILE)
        if transposed:
            _by_columns(x, w, out, c0, c1)
        else:
            _by_rows(x, w, out, c0, c1)


def few_rows(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x (M, in) @ w (in, out) float32 for M >= 1 (fastest for 2..FEW_MAX_ROWS); w C- or Fortran-ordered."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    transposed = not w.flags.c_contiguous
    stored = np.ascontiguousarray(w.T) if transposed else w  # a Fortran-ordered w is C-ordered as w.T
    out = np.empty((x.shape[0], w.shape[1]), dtype=np.float32)
    n = kernels.parallel(-(-w.shape[1] // TILE))
    if n == 1:
        (_by_columns if transposed else _by_rows)(x, stored, out, 0, w.shape[1])
    else:
        _parallel(x, stored, out, n, transposed)
    return out


def product(x: np.ndarray, w: object) -> np.ndarray:
    """x @ w, with a few rows times float32 weights (a batched decode step) on the kernels above."""
    if isinstance(w, np.ndarray) and 2 <= x.shape[0] <= FEW_MAX_ROWS and w.dtype == np.float32:
        return few_rows(x, w)
    return x @ w


@functools.cache
def warm_up() -> None:
    """Size the threads from the environment and compile (or load compiled) each kernel on a tiny product."""
    kernels.set_threads(kernels.threads_from_env())
    x = np.ones((2, 4), dtype=np.float32)
    w = np.ones((4, 3), dtype=np.float32)
    few_rows(x, w)
    few_rows(x, np.asfortranarray(w))
    if kernels.threads() > 1:
        _parallel(x, w, np.empty((2, 3), dtype=np.float32), 2, False)
        _parallel(x, np.ascontiguousarray(w.T), np.empty((2, 3), dtype=np.float32), 2, True)
