"""Products with matrices of every type with a kernel (workers.models.quants), computed on the blocks.

At load, a matrix's blocks (out, in/block) are regrouped so that ROWS output
rows lie side by side (workers.models.regroup): quants[g, b, k, r] is quad k
(4 bytes, as vpmaddubsw pairs them) of block b of row g·ROWS + r, and the
block scales sit in scales[g, b, i, r] as float16 bits. The inner loops then
run across the ROWS rows of a group, as wide vector instructions, and every
weight byte is read once per product, whatever the number of input rows.
The regrouped tensor holds about the file's bytes.

A few input rows (decode) are rounded to 8 bits per block as llama.cpp rounds
them for the type and multiplied in integers (workers.models.products):
deterministic, and within ~1e-3 of the float32 product, as llama.cpp
computes. Many rows (prefill) go to BLAS on float32 tiles of dequantized
groups, exact to float32 rounding. `PackedMatrix.__rmatmul__` chooses by the
number of rows.
"""

from __future__ import annotations

import functools
import os

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from workers.models import (
    jit,  # noqa: F401  (the kernels' cache directory, before any cache=True)
    products,
    unpack,
)
from workers.models.kernels_q8 import AVX2, BLOCK, BYTES, FLOATS, HALF, Vectors, half_to_float, splat
from workers.models.quants import BY_NAME, KERNEL_TYPES, QUAD, ROWS
from workers.models.regroup import regroup

# A product split between threads pays for waking them each time: ~4 µs with OpenMP's pool, whose
# threads spin a while after each product, ~45 µs with the workqueue's, whose threads sleep. A decode
# token runs hundreds of products, so OpenMP's, where the system has it (libgomp). Its spinning is
# harmless as the threads are sized: a worker has more than one only when it has the cores to itself.
if "NUMBA_THREADING_LAYER" not in os.environ and "NUMBA_THREADING_LAYER_PRIORITY" not in os.environ:
    numba.config.THREADING_LAYER_PRIORITY = ["omp", "workqueue", "tbb"]

# Input rows up to which a product runs on the blocks (the rows rounded to 8 bits, kernels_q8) rather
# than on float32 tiles dequantized for BLAS. A SmolLM2 prompt through the whole model, measured here
# (Zen 1): the blocks are faster at every length up to 512 rows, at 1 thread (128 rows: 680 ms vs 947)
# and at 2 (452 vs 640): dequantizing every matrix costs ~0.25 s a forward whatever its rows, and by
# 512 rows the two cost about as much per further row.
KERNEL_MAX_ROWS = 512
TILE_BYTES = 8 << 20  # float32 bytes dequantized at once for BLAS (bounds the transient memory)
Q4_0, Q4_1, Q8_0 = "q4_0", "q4_1", "q8_0"


# ---------------------------------------------------------------- threads


# Numba's own thread count is per thread: a thread started later (a worker's serving
# thread) would compute with every thread numba started, whatever the building
# thread was given. So the count is kept here, for the process, and each product
# that runs in parallel applies it on the thread that calls it (`parallel`).
_threads = 1
POOL_SPIN = "3000"


def set_threads(n: int) -> None:
    """Use n threads for the kernels (at most the ones numba started), on every thread of the process."""
    global _threads
    if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
        # Read once, as numba starts its threads (below, the first time): libgomp's threads spin this
        # many rounds at the end of a product before they sleep. Its default, 300,000 rounds of ~30 ns
        # here (Zen 3's pause), keeps them spinning ~10 ms after a decode token, through the gap in
        # which the coordinator samples and sends the next one, on the cores it needs; and when another
        # process holds a core, a thread spins out its time slice waiting for its partner. 3,000
        # (~0.1 ms) still outlasts the compiled code between one product of a token and the next.
        os.environ["GOMP_SPINCOUNT"] = POOL_SPIN
    _threads = max(1, min(n, numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(_threads)


def threads() -> int:
    """Threads the kernels use, on any thread."""
    return _threads


def parallel(n: int) -> int:
    """Threads for a product of n independent chunks, made numba's count on the calling thread."""
    n = max(1, min(n, _threads))
    if n > 1:
        numba.set_num_threads(n)
    return n


def threads_from_env() -> int:
    """RLX_THREADS if set, else every core this process may run on."""
    value = os.environ.get("RLX_THREADS", "")
    if value:
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"RLX_THREADS must be a whole number of threads ≥ 1, got {value!r}")
        return int(value)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def tiny(kind: str) -> PackedMatrix:
    """A (2·ROWS, 2·block) matrix of `kind` blocks with random bytes and finite scales, to compile on."""
    q = BY_NAME[kind]
    raw = np.random.default_rng(0).integers(0, 256, (2 * ROWS, 2, q.block_bytes), dtype=np.uint8)
    at = 208 if kind == "q6_k" else 0  # where the float16 scales lie in a stored block
    raw[:, :, at : at + 4] = np.array([0.5, 0.25], np.float16).view(np.uint8)[: min(4, q.block_bytes - at)]
    return PackedMatrix(raw.reshape(2 * ROWS, -1), kind, (2 * ROWS, 2 * q.block))


@functools.cache
def warm_up(kinds: tuple[str, ...] = (Q4_1, Q8_0, "q4_k")) -> None:
    """Size the threads from the environment and compile every kernel on a tiny matrix of each type.

    kinds: by default types that reach both dequantizers (the vector one of Q4_0, Q4_1, Q8_0, the
    unpacking one of the Q5 and K types; one compiled product serves every type); a stage names its
    own matrices' (decode.warm_up); make kernels' build for a CPU without AVX2 names every type, as
    the test of that build computes on each.
    """
    set_threads(threads_from_env())
    for kind in kinds:
        w = tiny(kind)
        x = np.ones((1, w.shape[1]), dtype=np.float32)
        w.kernel(x)  # on one thread, as every small product
        if threads() > 1:  # and split between the threads, as a big one
            products.product(x, w.blocks, parallel(threads()), chunk_bytes=1)
        w.blas(np.ones((KERNEL_MAX_ROWS + 1, w.shape[1]), dtype=np.float32))
        w.dequantize()


# ---------------------------------------------------------------- dequantizing, for BLAS


def _emit_dequantize(v: Vectors, q4: bool, q, sc, o, stride) -> None:
    """The ROWS rows of the block at q as float32: weight j of the ROWS rows at o + j·stride, side by side.

    sc holds the block's scales as float32: d for the ROWS rows, then m (Q4). Eight rows at a time: a
    vector of their quads is split into one vector per weight, converted and scaled as the file says,
    d·q + m (Q4_1) or d·q (Q8_0), with the same two roundings as the scalar arithmetic.
    """
    row_addr = [v.b.add(o, v.b.mul(stride, ir.Constant(stride.type, j))) for j in range(BLOCK)]
    convert = v.b.uitofp if q4 else v.b.sitofp
    for s in range(ROWS // 8):
        d = v.load(sc, 4 * 8 * s, FLOATS)
        m = v.load(sc, 4 * (ROWS + 8 * s), FLOATS) if q4 else None
        for k in range((HALF if q4 else BLOCK) // QUAD):
            w = v.load(q, (k * ROWS + 8 * s) * QUAD, BYTES)
            if q4:  # a byte's low nibble is weight j, its high one weight j + 16
                parts = [
                    (v.b.and_(w, splat(BYTES, 15)), QUAD * k),
                    (v.b.lshr(w, splat(BYTES, 4)), HALF + QUAD * k),
                ]
            else:
                parts = [(w, QUAD * k)]
            for quads, j0 in parts:
                for t in range(QUAD):  # weight j0 + t of each of the 8 rows
                    weights = v.b.fmul(
                        d, convert(v.shuffle(quads, quads, [QUAD * r + t for r in range(8)]), FLOATS)
                    )
                    v.store(v.b.fadd(weights, m) if q4 else weights, row_addr[j0 + t], 4 * 8 * s)


def _block_dequantize(q4: bool):
    """An intrinsic (q, sc, o, stride): _emit_dequantize for a Q4 or a Q8_0 block."""

    def dequantize(typingctx, q, sc, o, stride):
        def codegen(context, builder, signature, args):
            _emit_dequantize(Vectors(builder, AVX2), q4, *args)
            return context.get_dummy_value()

        return types.void(types.intp, types.intp, types.intp, types.intp), codegen

    dequantize.__name__ = dequantize.__qualname__ = "q4_dequantize" if q4 else "q8_dequantize"
    return intrinsic(dequantize)


q4_dequantize, q8_dequantize = _block_dequantize(True), _block_dequantize(False)


@numba.njit(nogil=True, cache=True)
def dequantize_groups(q4, quants, scales, g0, g1, out, first):
    """Groups g0..g1 of a Q4 (q4) or Q8_0 layout (quants as bytes) as float32 in columns (g - first)·ROWS..
    of out (in, ·).

    out's rows must be contiguous; its row stride may be anything.
    """
    nb, per_block = quants.shape[1], scales.shape[2] * ROWS
    block_bytes = quants.shape[2] * ROWS * QUAD
    f = np.empty(nb * per_block, dtype=np.float32)
    q0, o0, f0, stride = (
        np.intp(quants.ctypes.data),
        np.intp(out.ctypes.data),
        np.intp(f.ctypes.data),
        np.intp(out.strides[0]),
    )
    for g in range(g0, g1):
        half_to_float(scales[g], f)
        for b in range(nb):
            q, sc = q0 + (g * nb + b) * block_bytes, f0 + b * per_block * 4
            o = o0 + b * BLOCK * stride + (g - first) * ROWS * 4
            if q4:
                q4_dequantize(q, sc, o, stride)
            else:
                q8_dequantize(q, sc, o, stride)


# ---------------------------------------------------------------- the layout


class PackedMatrix:
    """A matrix (out, in) of blocks of a type with a kernel, regrouped ROWS rows at a time; `x @ w` works.

    kind: the type's name (workers.models.quants); quant: its entry.
    quants: (groups, blocks, quads, ROWS, QUAD) uint8 (int8 for Q8_0), as workers.models.regroup lays it.
    scales: (groups, blocks, halves, ROWS) float16 bits: d, and m or dmin where the type has one.
    """

    __array_ufunc__ = None  # so that `x @ w` calls __rmatmul__

    def __init__(self, raw: np.ndarray, kind: str, shape: tuple[int, int]) -> None:
        q = BY_NAME.get(kind)
        if q is None or not q.kernel:
            raise ValueError(f"block type {kind!r} has no kernel; accepted: {', '.join(KERNEL_TYPES)}")
        out, inp = shape
        if inp % q.block:
            raise ValueError(f"a {kind} matrix's rows must hold whole blocks of {q.block}, got {inp}")
        self.kind, self.quant, self.shape = kind, q, shape
        self.quants, self.scales = regroup(raw, q, out, inp // q.block)
        self.nbytes = self.quants.nbytes + self.scales.nbytes

    def __rmatmul__(self, x: np.ndarray) -> np.ndarray:
        """x (T, in) float32 times the matrix: (T, out)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.shape[1]:
            raise ValueError(f"cannot multiply {x.shape} by a packed ({self.shape[1]}, {self.shape[0]})")
        if x.shape[0] <= KERNEL_MAX_ROWS:
            return self.kernel(x)
        return self.blas(x)

    @property
    def blocks(self) -> tuple[int, np.ndarray, np.ndarray]:
        """(kind, quants as bytes, scales), as the compiled code takes a matrix (products.multiply).

        kind is the GGML type id. Q8_0's int8 quants are passed as bytes too: the kernels read them by
        address, and one compiled version serves every type.
        """
        return self.quant.type_id, self.quants.view(np.uint8), self.scales

    def kernel(self, x: np.ndarray) -> np.ndarray:
        """The product on the blocks, x rounded to 8 bits per block as the type needs: each byte read once."""
        return products.product(x, self.blocks, parallel(self.quants.shape[0]))[:, : self.shape[0]]

    def blas(self, x: np.ndarray) -> np.ndarray:
        """The product through BLAS on float32 tiles of ROWS-row groups, dequantized one tile at a time."""
        n_groups, inp = self.quants.shape[0], self.shape[1]
        step = max(1, TILE_BYTES // (inp * ROWS * 4))
        out = np.empty((x.shape[0], n_groups * ROWS), dtype=np.float32)
        tile = np.empty((inp, min(step, n_groups) * ROWS), dtype=np.float32)
        for g0 in range(0, n_groups, step):
            g1 = min(g0 + step, n_groups)
            self._dequantize(g0, g1, tile)
            np.matmul(x, tile[:, : (g1 - g0) * ROWS], out=out[:, g0 * ROWS : g1 * ROWS])
        return out[:, : self.shape[0]]

    def dequantize(self) -> np.ndarray:
        """The whole matrix as float32 (out, in), as the file's blocks give it."""
        w = np.empty((self.shape[1], self.quants.shape[0] * ROWS), dtype=np.float32)
        self._dequantize(0, self.quants.shape[0], w)
        return np.ascontiguousarray(w[:, : self.shape[0]].T)

    def _dequantize(self, g0: int, g1: int, out: np.ndarray) -> None:
        """Groups g0..g1 as float32 in out (in, ≥ (g1-g0)·ROWS) from column 0.

        On one thread, whatever the count: between BLAS products (prefill), numba's threads and
        OpenBLAS's would take turns spinning on each other's cores (measured, 2 cores: the prefill
        2.5× slower).
        """
        kind, quants, scales = self.blocks
        if self.kind in (Q4_0, Q4_1, Q8_0):  # vector code
            dequantize_groups(self.kind != Q8_0, quants, scales, g0, g1, out, g0)
        else:
            unpack.dequantize_groups(kind, quants, scales, g0, g1, out, g0)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` (T,) of the matrix as float32 (T, in): a table's embedding lookup."""
        if self.kind not in (Q4_0, Q4_1, Q8_0):  # the groups holding them dequantized
            groups, where = np.unique(ids // ROWS, return_inverse=True)
            tile = np.empty((self.shape[1], ROWS), dtype=np.float32)
            out = np.empty((len(ids), self.shape[1]), dtype=np.float32)
            for i, g in enumerate(groups):
                self._dequantize(int(g), int(g) + 1, tile)
                picked = where == i
                out[picked] = tile[:, ids[picked] % ROWS].T
            return out
        g, r = np.divmod(ids, ROWS)
        q = self.quants[g, :, :, r].reshape(len(ids), self.quants.shape[1], -1)  # (T, blocks, 16 or 32)
        sc = self.scales[g, :, :, r].view(np.float16).astype(np.float32)  # (T, blocks, 2 or 1)
        if self.kind == Q8_0:
            w = sc[:, :, :1] * q.astype(np.float32)
        else:
            both = np.concatenate([q & 15, q >> 4], axis=2).astype(np.float32)  # (T, blocks, 32)
            w = sc[:, :, :1] * both + sc[:, :, 1:]
        return w.reshape(len(ids), self.shape[1])
