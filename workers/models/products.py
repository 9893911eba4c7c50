"""Rows times a matrix of any type with a kernel: the rows rounded once per kind, then the blocks.

A matrix is passed to compiled code as (kind, quants, scales) (PackedMatrix.blocks):
its GGML type id, and the regrouped layout (workers.models.regroup) as bytes
and float16 bits, so one numba type serves every type and a block of mixed
types (Q4_K_M: Q4_K, Q6_K, Q5_0, Q8_0) runs in one compiled path. `needs`
says which roundings of the input rows a set of matrices takes (llama.cpp's
Q8_0/Q8_1 per 32, its Q8_K per 256), `activations` rounds the rows once for
each, and `multiply` dispatches on the kind. Before either rounding, a row's few
values far above its RMS are spilled (workers.models.outliers), once, and
every type's kernel adds them back times their exact weight columns.
"""

from __future__ import annotations

import numba
import numpy as np

from workers.models.kernels_k import Q4_K, Q5_K, Q6_K, k_rows, quantize_k, quantize_k_rows
from workers.models.kernels_q5 import q5_rows
from workers.models.kernels_q8 import CHUNK_MIN_BYTES, q4_rows, q8_rows, quantize, quantize_rows
from workers.models.outliers import SPILL_MAX, spill, spill_rows
from workers.models.quants import BY_NAME, ROWS

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = (BY_NAME[n].type_id for n in ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0"))
BY_32, BY_256 = 1, 2  # the roundings a matrix takes (needs): Q8_0/Q8_1's, per 32; Q8_K's, per 256
# Rows from which their rounding (and a session's attention, workers.models.decode) is split between
# the threads: a prompt's, not a decode step's, where waking the other threads costs more than it
# saves (110 rows of Gemma 3's 2048-wide FFN: ~0.8 ms a block to spill and round on one thread).
PARALLEL_ROWS = 16


@numba.njit(nogil=True, cache=True)
def needs(weights) -> int:
    """The roundings (BY_32 | BY_256) the matrices `weights` (a tuple of (kind, quants, scales)) take."""
    need = 0
    for w in weights:
        need |= BY_256 if w[0] in (Q4_K, Q5_K, Q6_K) else BY_32
    return need


@numba.njit(nogil=True, cache=True)
def activations(x, need):
    """Rows x (T, in) rounded as `need` says: (T, Q8_0/Q8_1's xq, xd, xs, Q8_K's xq, xd, sums, cols, vals).

    Both roundings are of the rows with their outliers taken out: vals[m, s] at column cols[m, s] of
    row m (workers.models.outliers.spill). A rounding not needed is left as empty arrays. A flat tuple:
    a parallel loop (rows_parallel) takes no tuple within a tuple.
    """
    rest, cols, vals = spill(x)
    if need & BY_32:
        xq, xd, xs = quantize(rest)
    else:
        xq, xd, xs = np.empty((0, 0), np.int8), np.empty((0, 0), np.float32), np.empty((0, 0), np.float32)
    if need & BY_256:
        kq, kd, ks = quantize_k(rest)
    else:
        kq, kd, ks = np.empty((0, 0), np.int8), np.empty((0, 0), np.float32), np.empty((0, 0), np.int16)
    return x.shape[0], xq, xd, xs, kq, kd, ks, cols, vals


@numba.njit(nogil=True, parallel=True, cache=True)
def activations_parallel(x, need, n_chunks):
    """activations of rows x on n_chunks threads, a chunk of rows each: the same values, bitwise."""
    T = x.shape[0]
    rest = np.empty_like(x)
    cols, vals = np.zeros((T, SPILL_MAX), dtype=np.int32), np.zeros((T, SPILL_MAX), dtype=np.float32)
    w32 = x.shape[1] if need & BY_32 else 0  # a rounding not needed: empty arrays, as activations
    w256 = x.shape[1] if need & BY_256 else 0
    xq = np.empty((T if w32 else 0, w32), dtype=np.int8)
    xd, xs = np.empty((xq.shape[0], w32 // 32), np.float32), np.empty((xq.shape[0], w32 // 32), np.float32)
    kq = np.zeros((T if w256 else 0, w256), dtype=np.int8)
    kd, ks = np.zeros((kq.shape[0], w256 // 256), np.float32), np.zeros((kq.shape[0], w256 // 16), np.int16)
    for c in numba.prange(n_chunks):
        m0, m1 = c * T // n_chunks, (c + 1) * T // n_chunks
        spill_rows(x, rest, cols, vals, m0, m1)
        if w32:
            quantize_rows(rest, xq, xd, xs, m0, m1)
        if w256:
            quantize_k_rows(rest, kq, kd, ks, m0, m1)
    return T, xq, xd, xs, kq, kd, ks, cols, vals


@numba.njit(nogil=True, cache=True)
def rounded(x, need, threads):
    """activations of rows x, on up to `threads` threads for PARALLEL_ROWS rows or more."""
    if threads > 1 and x.shape[0] >= PARALLEL_ROWS:
        return activations_parallel(x, need, min(threads, x.shape[0]))
    return activations(x, need)


@numba.njit(nogil=True, cache=True)
def rows(a, kind, quants, scales, out, g0, g1):
    """out[:, g·ROWS..] for groups g0..g1 of a matrix of `kind`, on the rounded rows a (activations)."""
    spilled = (a[7], a[8])
    if kind in (Q4_0, Q4_1):
        q4_rows(a[1], a[2], a[3], spilled, quants, scales, out, g0, g1)
    elif kind == Q8_0:
        q8_rows(a[1], a[2], a[3], spilled, quants, scales, out, g0, g1)
    elif kind in (Q5_0, Q5_1):
        q5_rows(a[1], a[2], a[3], spilled, quants, scales, out, g0, g1)
    else:
        k_rows(a[4], a[5], a[6], spilled, kind, quants, scales, out, g0, g1)


@numba.njit(nogil=True, parallel=True, cache=True)
def rows_parallel(a, kind, quants, scales, out, n_chunks):
    """rows over the groups cut in n_chunks, one numba thread each."""
    n_groups = quants.shape[0]
    for c in numba.prange(n_chunks):
        rows(a, kind, quants, scales, out, c * n_groups // n_chunks, (c + 1) * n_groups // n_chunks)


@numba.njit(nogil=True, cache=True)
def chunks(n_rows, quants, scales, n_threads, chunk_bytes):
    """Threads a product of n_rows rows takes: at most n_threads, each given chunk_bytes of weights × rows."""
    work = (quants.size + scales.size * 2) * n_rows
    return min(n_threads, quants.shape[0], max(1, work // chunk_bytes))


@numba.njit(nogil=True, cache=True)
def multiply(a, w, n_threads, chunk_bytes):
    """Rounded rows a (activations) times the matrix w = (kind, quants, scales): (T, groups·ROWS) float32.

    On up to n_threads (numba's count on the calling thread must allow them),
    each given at least chunk_bytes of weight bytes times rows. Callable from
    other compiled code (workers.models.decode) as from Python.
    """
    kind, quants, scales = w
    n_groups = quants.shape[0]
    out = np.empty((a[0], n_groups * ROWS), dtype=np.float32)
    n = chunks(a[0], quants, scales, n_threads, chunk_bytes)
    if n == 1:
        rows(a, kind, quants, scales, out, 0, n_groups)
    else:
        rows_parallel(a, kind, quants, scales, out, n)
    return out


def chunk_min_bytes() -> int:
    """CHUNK_MIN_BYTES for the threading layer in use (the workqueue's until a product ran in parallel)."""
    try:
        layer = numba.threading_layer()
    except ValueError:  # no parallel product yet
        layer = "workqueue"
    return CHUNK_MIN_BYTES.get(layer, CHUNK_MIN_BYTES["workqueue"])


def product(x: np.ndarray, w: tuple, n_threads: int, chunk_bytes: int = 0) -> np.ndarray:
    """x (T, in) float32, rounded as w's kind needs, times w = (kind, quants, scales): (T, groups·ROWS).

    On up to n_threads, each given at least chunk_bytes (by default chunk_min_bytes()) of weight bytes
    times rows.
    """
    _, quants, scales = w
    if not (quants.flags.c_contiguous and scales.flags.c_contiguous):
        raise ValueError("the kernels read the regrouped blocks by address: they must be C-contiguous")
    a = activations(x, needs((w,)))
    return multiply(a, w, n_threads, chunk_bytes or chunk_min_bytes())
