"""Products with a float16 matrix as the file stores it, its weights widened to float32 as they are read.

A decode step's few rows stream each weight row once: widened (vcvtph2ps,
exactly) into a row of float32 that every input row is multiplied into, so no
float32 copy of the matrix is made, per product or at load. Many rows (a
prefill) go to BLAS on float32 tiles of a few rows of the matrix at a time.
The sums run in float32, as a float32 matrix's would.
"""

from __future__ import annotations

import functools

import numba
import numpy as np

from workers.models import kernels
from workers.models.kernels_q8 import half_to_float
from workers.models.quants import HALF_WIDTH as WIDTH  # weights widened at once (vcvtph2ps's)

FEW_MAX_ROWS = 8  # input rows up to which the weight rows are streamed; more go to BLAS on tiles
TILE_BYTES = 8 << 20  # float32 bytes widened at once for BLAS (bounds the transient memory)


@numba.njit(nogil=True, fastmath=True, cache=True)
def _rows(x, bits, out, c0, c1):
    """out[:, c] = x · w[c] for the outputs c0..c1 of w (out, in): its rows float16 bits, padded."""
    n_in, inp = x.shape
    row = np.empty(bits.shape[1], dtype=np.float32)
    for c in range(c0, c1):
        half_to_float(bits[c], row)
        for m in range(n_in):
            s = np.float32(0)
            for k in range(inp):
                s += x[m, k] * row[k]
            out[m, c] = s


@numba.njit(nogil=True, parallel=True, cache=True)
def _parallel(x, bits, out, n_chunks):
    """_rows over the outputs cut in n_chunks, one numba thread each."""
    n = bits.shape[0]
    for i in numba.prange(n_chunks):
        _rows(x, bits, out, i * n // n_chunks, (i + 1) * n // n_chunks)


class HalfMatrix:
    """A matrix (out, in) of float16 weights as stored; `x @ w` works, as a PackedMatrix's does.

    stored: the weights (out, in) float16, each row padded with zeros to a multiple of WIDTH.
    """

    __array_ufunc__ = None  # so that `x @ w` calls __rmatmul__

    def __init__(self, weights: np.ndarray) -> None:
        out, inp = weights.shape
        self.shape = (out, inp)
        self.stored = np.zeros((out, -(-inp // WIDTH) * WIDTH), dtype=np.float16)
        self.stored[:, :inp] = weights
        self.nbytes = self.stored.nbytes

    def __rmatmul__(self, x: np.ndarray) -> np.ndarray:
        """x (T, in) float32 times the matrix: (T, out)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.shape[1]:
            raise ValueError(f"cannot multiply {x.shape} by a float16 ({self.shape[1]}, {self.shape[0]})")
        if x.shape[0] > FEW_MAX_ROWS:
            return self._blas(x)
        out = np.empty((x.shape[0], self.shape[0]), dtype=np.float32)
        bits = self.stored.view(np.uint16)
        n = kernels.parallel(-(-self.shape[0] // 64))  # a thread per 64 outputs at least
        if n == 1:
            _rows(x, bits, out, 0, self.shape[0])
        else:
            _parallel(x, bits, out, n)
        return out

    def _blas(self, x: np.ndarray) -> np.ndarray:
        """The product through BLAS on float32 tiles of a few of the matrix's rows at a time."""
        out = np.empty((x.shape[0], self.shape[0]), dtype=np.float32)
        step = max(1, TILE_BYTES // (self.stored.shape[1] * 4))
        for r0 in range(0, self.shape[0], step):
            tile = self.stored[r0 : r0 + step, : self.shape[1]].astype(np.float32)  # (rows, in)
            np.matmul(x, tile.T, out=out[:, r0 : r0 + step])
        return out

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` (T,) of the matrix as float32 (T, in): a table's embedding lookup."""
        return self.stored[ids, : self.shape[1]].astype(np.float32)

    def dequantize(self) -> np.ndarray:
        """The whole matrix as float32 (out, in)."""
        return self.stored[:, : self.shape[1]].astype(np.float32)


@functools.cache
def warm_up() -> None:
    """Compile (or load compiled) the kernels on a tiny matrix."""
    w = HalfMatrix(np.ones((2, 3), dtype=np.float16))
    x = np.ones((2, 3), dtype=np.float32)
    _rows(x, w.stored.view(np.uint16), np.empty((2, 2), dtype=np.float32), 0, 2)
    if kernels.threads() > 1:
        _parallel(x, w.stored.view(np.uint16), np.empty((2, 2), dtype=np.float32), 2)
