"""Regrouped Q5_0/Q5_1/Q4_K/Q5_K/Q6_K blocks back to float32, as gguf-py dequantizes the file's.

Plain compiled loops, for what needs the weights as floats rather than a
product on the blocks: a prefill's BLAS tiles, an embedding's rows, a test.
Each weight is computed in float32 as gguf-py does it, (d·sc)·u - dmin·m
for Q4_K/Q5_K, (d·sc)·(u - 32) for Q6_K, d·u + m for Q5 (exact, as gguf-py's
d·(u - 16)), so the values agree bitwise.
"""

from __future__ import annotations

import numba
import numpy as np

from workers.models.kernels_k import Q4_K, Q5_K, Q6_K, QK
from workers.models.kernels_q5 import q5_scales
from workers.models.kernels_q8 import BLOCK, half_to_float
from workers.models.quants import QUAD, ROWS


@numba.njit(nogil=True, cache=True)
def _q5(raw, d, m, w):
    for k in range(4):
        for t in range(QUAD):
            byte, fifth = np.int64(raw[QUAD * k + t]), np.int64(raw[16 + t])
            w[QUAD * k + t] = d * np.float32((byte & 15) | (((fifth >> (2 * k)) & 1) << 4)) + m
            w[16 + QUAD * k + t] = d * np.float32((byte >> 4) | (((fifth >> (2 * k + 1)) & 1) << 4)) + m


@numba.njit(nogil=True, cache=True)
def _k45(raw, d, dmin, w, five):
    at = 160 if five else 128  # the scales' bytes, after the nibbles (and the fifth bits)
    for c in range(4):
        for half in range(2):
            s = 2 * c + half
            scale, low = d * np.float32(raw[at + s]), dmin * np.float32(raw[at + 8 + s])
            for i in range(32):
                u = (np.int64(raw[32 * c + i]) >> (4 * half)) & 15
                if five:
                    u |= ((np.int64(raw[128 + i]) >> s) & 1) << 4
                w[64 * c + 32 * half + i] = scale * np.float32(u) - low


@numba.njit(nogil=True, cache=True)
def _k6(raw, d, w):
    for half in range(2):
        for i in range(4):
            for ll in range(32):
                low = np.int64(raw[64 * half + 32 * (i % 2) + ll])
                u = (low & 15) if i < 2 else (low >> 4)
                u |= ((np.int64(raw[128 + 32 * half + ll]) >> (2 * i)) & 3) << 4
                j = 128 * half + 32 * i + ll
                scale = d * np.float32(np.int8(raw[192 + j // 16]))
                w[j] = scale * np.float32(u - 32)


@numba.njit(nogil=True, cache=True)
def dequantize_groups(kind, quants, scales, g0, g1, out, first):
    """Groups g0..g1 of a layout of `kind` as float32 in columns (g - first)·ROWS.. of out (in, ·)."""
    nb, n_quads = quants.shape[1], quants.shape[2]
    k_type = kind in (Q4_K, Q5_K, Q6_K)
    block = QK if k_type else BLOCK
    n_halves = scales.shape[2] if k_type else 2  # Q5's d and m, m computed where only d is held
    f, held = np.empty(nb * n_halves * ROWS, dtype=np.float32), np.empty(nb * ROWS, dtype=np.float32)
    raw = np.empty(n_quads * QUAD, dtype=np.uint8)
    w = np.empty(block, dtype=np.float32)
    n_codes = 48 if kind == Q6_K else 40 if kind == Q5_K else 32 if kind == Q4_K else n_quads
    for g in range(g0, g1):
        if k_type:
            half_to_float(scales[g], f)
        else:
            q5_scales(scales[g], f, held)
        sc = f.reshape(nb, n_halves, ROWS)
        for b in range(nb):
            flat = quants[g, b].reshape(-1)
            for r in range(ROWS):  # a row's codes, then its sub-block scales (workers.models.regroup)
                for k in range(n_codes):
                    for t in range(QUAD):
                        raw[QUAD * k + t] = flat[(k * ROWS + r) * QUAD + t]
                for j in range((n_quads - n_codes) * QUAD):
                    raw[n_codes * QUAD + j] = flat[n_codes * QUAD * ROWS + j * ROWS + r]
                if kind == Q6_K:
                    _k6(raw, sc[b, 0, r], w)
                elif kind in (Q4_K, Q5_K):
                    _k45(raw, sc[b, 0, r], sc[b, 1, r], w, kind == Q5_K)
                else:
                    _q5(raw, sc[b, 0, r], sc[b, 1, r], w)
                for j in range(block):
                    out[b * block + j, (g - first) * ROWS + r] = w[j]
