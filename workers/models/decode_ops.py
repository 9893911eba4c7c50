"""The compiled pieces of a block on a few rows that are not products: norms, RoPE, attention, the gate.

Each is what workers.models.ops computes in numpy, row by row in one fixed
order; workers.models.decode puts them between the products.
"""

from __future__ import annotations

import numba
import numpy as np

from workers.models import jit  # noqa: F401  (the kernels' cache directory, before any cache=True)


@numba.njit(nogil=True, fastmath=True, cache=True)
def rms_norm(x, weight, eps):
    """Each row of x (T, D) scaled to unit root-mean-square, then by weight (D,): a new array."""
    out = np.empty_like(x)
    for t in range(x.shape[0]):
        total = np.float32(0)
        for v in x[t]:
            total += v * v
        scale = np.float32(1) / np.sqrt(total / np.float32(x.shape[1]) + eps)
        for j in range(x.shape[1]):
            out[t, j] = x[t, j] * scale * weight[j]
    return out


@numba.njit(nogil=True, fastmath=True, cache=True)
def prepare(y, heads, head_dim, bias, norm, eps):
    """In place on y (T, heads·hd): + bias, then each head's rms_norm by norm (either skipped if empty)."""
    for t in range(y.shape[0]):
        if bias.size:
            for j in range(heads * head_dim):
                y[t, j] += bias[j]
        if norm.size:
            for h in range(heads):
                row = y[t, h * head_dim : (h + 1) * head_dim]
                total = np.float32(0)
                for v in row:
                    total += v * v
                scale = np.float32(1) / np.sqrt(total / np.float32(head_dim) + eps)
                for j in range(head_dim):
                    row[j] = row[j] * scale * norm[j]


@numba.njit(nogil=True, fastmath=True, cache=True)
def rotate(y, heads, head_dim, neox, cos, sin, out):
    """out (T, heads, hd) = y[:, :heads·hd], each head's pairs rotated by row t's angles.

    The pairs are (2i, 2i+1), or (i, i + hd/2) when neox (workers.models.ops.apply_rope).
    """
    half = head_dim // 2
    for t in range(out.shape[0]):
        for h in range(heads):
            base = h * head_dim
            for i in range(half):
                a, b = (i, i + half) if neox else (2 * i, 2 * i + 1)
                first, second = y[t, base + a], y[t, base + b]
                c, s = cos[t, i], sin[t, i]
                out[t, h, a] = first * c - second * s
                out[t, h, b] = first * s + second * c


@numba.njit(nogil=True, fastmath=True, cache=True)
def attend_row(q, keys, values, t, here, out, scale, window, scores, acc):
    """Row t of q (T, H, hd), at position `here`, attending over keys, values (KV, capacity, hd): out[t].

    It sees positions 0..here, only the last `window` of them when window > 0 (keys, values a ring,
    position p at p mod window); scores (≥ the positions seen) and acc (hd) are room to work in.
    """
    n_heads, head_dim = q.shape[1], q.shape[2]
    group = n_heads // keys.shape[0]
    first = max(0, here + 1 - window) if window > 0 else 0
    for h in range(n_heads):
        g = h // group
        qh = q[t, h]
        top = np.float32(-np.inf)
        for pos in range(first, here + 1):
            key = keys[g, pos % window if window > 0 else pos]
            s = np.float32(0)
            for j in range(head_dim):
                s += qh[j] * key[j]
            s *= scale
            scores[pos - first] = s
            top = max(top, s)
        total = np.float32(0)
        for i in range(here + 1 - first):
            e = np.exp(scores[i] - top)
            scores[i] = e
            total += e
        acc[:] = 0
        for pos in range(first, here + 1):
            p, value = scores[pos - first], values[g, pos % window if window > 0 else pos]
            for j in range(head_dim):
                acc[j] += p * value[j]
        for j in range(head_dim):
            out[t, h * head_dim + j] = acc[j] / total


@numba.njit(nogil=True, fastmath=True, cache=True)
def store(k, v, keys, values, start, t, window):
    """Row t's keys and values (T, KV, hd) at position start + t of the cache (a ring if window > 0)."""
    here = start + t
    slot = here % window if window > 0 else here
    for g in range(keys.shape[0]):
        keys[g, slot] = k[t, g]
        values[g, slot] = v[t, g]


@numba.njit(nogil=True, fastmath=True, cache=True)
def attend(q, k, v, keys, values, start, out, scale, window):
    """Store k, v (T, KV, hd) at start.. of keys, values (KV, capacity, hd); then q's (T, H, hd) attention.

    Row t sees positions 0..start + t (causal), only the last `window` of them when window > 0:
    then keys, values are a ring (workers.models.kvcache), position q at q mod window, and row t's
    key is stored just before its attention, over the one position no row from t on sees any more.
    Query head h reads KV head h // (H / KV); q·k is scaled by `scale`. out (T, H·hd) receives
    the heads side by side.
    """
    T = q.shape[0]
    scores = np.empty(min(start + T, window) if window > 0 else start + T, dtype=np.float32)
    acc = np.empty(q.shape[2], dtype=np.float32)
    for t in range(T):
        store(k, v, keys, values, start, t, window)
        attend_row(q, keys, values, t, start + t, out, scale, window, scores, acc)


@numba.njit(nogil=True, cache=True)
def stores_ahead(start, T, window) -> bool:
    """Whether rows start..start + T may all be stored before any attends: no key takes a seen one's place."""
    return window == 0 or start + T <= window


@numba.njit(nogil=True, fastmath=True, parallel=True, cache=True)
def attend_parallel(q, k, v, keys, values, start, out, scale, window, n_chunks):
    """attend on n_chunks threads, row t on chunk t mod n_chunks (later rows see more), where
    stores_ahead: every row's keys stored first. Each row computes as attend computes it, bitwise."""
    T = q.shape[0]
    for t in range(T):
        store(k, v, keys, values, start, t, window)
    for c in numba.prange(n_chunks):
        scores = np.empty(min(start + T, window) if window > 0 else start + T, dtype=np.float32)
        acc = np.empty(q.shape[2], dtype=np.float32)
        for t in range(c, T, n_chunks):
            attend_row(q, keys, values, t, start + t, out, scale, window, scores, acc)


# tanh(z) as a ratio of odd and even polynomials in z (the minimax fit Eigen's ptanh_float uses),
# z clamped where float32's tanh is ±1: only multiplies, adds, a division and min/max, which run in
# vector lanes, where a call of tanh per value does not (110 rows of Gemma 3's 2048-wide FFN, 18
# layers: ~135 ms by tanh, ~8 ms so). Measured against float64's tanh over -12..12: within 3.4e-7
# (6 float32 steps), where float32's own tanh is within 1.4 steps; llama.cpp reads GELU from a
# table of float16 values, ~1e-3 off.
TANH_CLAMP = np.float32(7.90531110763549805)
TANH_P = tuple(
    np.float32(c)
    for c in (
        4.89352455891786e-03,
        6.37261928875436e-04,
        1.48572235717979e-05,
        5.12229709037114e-08,
        -8.60467152213735e-11,
        2.00018790482477e-13,
        -2.76076847742355e-16,
    )
)
TANH_Q = tuple(
    np.float32(c)
    for c in (4.89352518554385e-03, 2.26843463243900e-03, 1.18534705686654e-04, 1.19825839466702e-06)
)


@numba.njit(nogil=True, fastmath=True, error_model="numpy", cache=True, inline="always")
def tanh(z):
    """tanh of a float32 z to within 3.4e-7, in arithmetic that vectorizes (see TANH_P)."""
    z = min(max(z, -TANH_CLAMP), TANH_CLAMP)
    z2 = z * z
    p0, p1, p2, p3, p4, p5, p6 = TANH_P
    q0, q1, q2, q3 = TANH_Q
    p = z * (p0 + z2 * (p1 + z2 * (p2 + z2 * (p3 + z2 * (p4 + z2 * (p5 + z2 * p6))))))
    return p / (q0 + z2 * (q1 + z2 * (q2 + z2 * q3)))


# error_model="numpy": a division by zero is inf, not a raised error whose check keeps the loop scalar.
@numba.njit(nogil=True, fastmath=True, error_model="numpy", cache=True)
def gated(gate, up, n, gelu):
    """act(gate[:, :n]) ⊙ up[:, :n], a new (T, n) array; act: GELU's tanh form if gelu, else silu."""
    out = np.empty((gate.shape[0], n), dtype=np.float32)
    c, k, half, one = np.float32(np.sqrt(2.0 / np.pi)), np.float32(0.044715), np.float32(0.5), np.float32(1)
    for t in range(gate.shape[0]):
        g, u, o = gate[t], up[t], out[t]
        if gelu:  # the branch outside the loop over the row, which then runs in vector lanes
            for j in range(n):
                a = g[j]
                o[j] = half * a * (one + tanh(c * (a + k * a * a * a))) * u[j]
        else:
            for j in range(n):
                a = g[j]
                o[j] = a / (one + np.exp(-a)) * u[j]
    return out
