"""A packed block on a few rows (decode steps, short prompts) in three compiled calls.

For a few rows the products with packed weights take ~70 µs each, and the
numpy work around them (norms, RoPE, attention, SwiGLU: some thirty calls of
~10 µs a block) cost as much again. Here a forward's blocks are one compiled
call (`run_blocks`: numba's dispatch of each call costs ~5 µs), a block three
compiled functions, with nothing in Python between its products:

- `qkv`: rms_norm, the rows quantized once for the three products, q, k, v, RoPE on q and k;
- `attend`, once per session: the session's new keys and values stored in its cache, then each row's
  attention over the positions up to its own;
- `feed_forward`: x + attention · W_o, rms_norm, the rows quantized once for gate and up,
  silu(gate) ⊙ up · W_down, + x.

Each row is computed alone, in one fixed order (the products' sums are
integers, workers.models.kernels_q8), so a row's result does not depend on
the other rows of a batch, the thread count or the split: a batched decode
step gives each session bitwise what its own step would.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numba
import numpy as np
from numba.typed import List

from workers.models import kernels
from workers.models.kernels_q8 import chunk_min_bytes, multiply, quantize_spilled
from workers.models.layout import BLOCK


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
def _rotate(y, heads, head_dim, cos, sin, out):
    """out (T, heads, hd) = y[:, :heads·hd], each head's pairs (2i, 2i+1) rotated by row t's angles."""
    for t in range(out.shape[0]):
        for h in range(heads):
            base = h * head_dim
            for i in range(head_dim // 2):
                even, odd = y[t, base + 2 * i], y[t, base + 2 * i + 1]
                c, s = cos[t, i], sin[t, i]
                out[t, h, 2 * i] = even * c - odd * s
                out[t, h, 2 * i + 1] = even * s + odd * c


@numba.njit(nogil=True, cache=True)
def qkv(x, norm, eps, weights, cos, sin, shape, threads, chunk):
    """q (T, H, hd) and k, v (T, KV, hd) of rows x (T, D); q and k rotated by row t's cos, sin (T, hd/2).

    weights: W_q, W_k, W_v, each a packed matrix's (quants, scales) (PackedMatrix.blocks);
    shape: (H, KV, hd).
    """
    q_w, k_w, v_w = weights
    n_heads, n_kv, head_dim = shape
    xq, xd, xs, spilled = quantize_spilled(rms_norm(x, norm, eps))
    T = x.shape[0]
    q = np.empty((T, n_heads, head_dim), dtype=np.float32)
    k = np.empty((T, n_kv, head_dim), dtype=np.float32)
    v = np.empty((T, n_kv, head_dim), dtype=np.float32)
    _rotate(multiply(xq, xd, xs, spilled, q_w[0], q_w[1], threads, chunk), n_heads, head_dim, cos, sin, q)
    _rotate(multiply(xq, xd, xs, spilled, k_w[0], k_w[1], threads, chunk), n_kv, head_dim, cos, sin, k)
    values = multiply(xq, xd, xs, spilled, v_w[0], v_w[1], threads, chunk)
    for t in range(T):
        for g in range(n_kv):
            for j in range(head_dim):
                v[t, g, j] = values[t, g * head_dim + j]
    return q, k, v


@numba.njit(nogil=True, fastmath=True, cache=True)
def attend(q, k, v, keys, values, start, out):
    """Store k, v (T, KV, hd) at start.. of keys, values (KV, capacity, hd); then q's (T, H, hd) attention.

    Row t sees positions 0..start + t (causal); query head h reads KV head
    h // (H / KV). out (T, H·hd) receives the heads side by side.
    """
    T, n_heads, head_dim = q.shape
    n_kv = keys.shape[0]
    group = n_heads // n_kv
    for t in range(T):
        for g in range(n_kv):
            keys[g, start + t] = k[t, g]
            values[g, start + t] = v[t, g]
    scale = np.float32(1) / np.sqrt(np.float32(head_dim))
    scores = np.empty(start + T, dtype=np.float32)
    acc = np.empty(head_dim, dtype=np.float32)
    for t in range(T):
        length = start + t + 1
        for h in range(n_heads):
            g = h // group
            qh = q[t, h]
            top = np.float32(-np.inf)
            for pos in range(length):
                key = keys[g, pos]
                s = np.float32(0)
                for j in range(head_dim):
                    s += qh[j] * key[j]
                s *= scale
                scores[pos] = s
                top = max(top, s)
            total = np.float32(0)
            for pos in range(length):
                e = np.exp(scores[pos] - top)
                scores[pos] = e
                total += e
            acc[:] = 0
            for pos in range(length):
                p, value = scores[pos], values[g, pos]
                for j in range(head_dim):
                    acc[j] += p * value[j]
            for j in range(head_dim):
                out[t, h * head_dim + j] = acc[j] / total


@numba.njit(nogil=True, fastmath=True, cache=True)
def _swiglu(gate, up, n):
    """silu(gate[:, :n]) ⊙ up[:, :n], a new (T, n) array."""
    out = np.empty((gate.shape[0], n), dtype=np.float32)
    for t in range(gate.shape[0]):
        for j in range(n):
            a = gate[t, j]
            out[t, j] = a / (np.float32(1) + np.exp(-a)) * up[t, j]
    return out


@numba.njit(nogil=True, cache=True)
def feed_forward(x, att, o_w, norm, eps, weights, ffn, threads, chunk):
    """The rest of a block on rows x (T, D) given their attention att (T, H·hd): the block's output rows.

    y = x + att·W_o, then y + swiglu(rms_norm(y))·W_down; weights: W_gate, W_up, W_down,
    each with o_w as qkv's weights; ffn: the hidden width of the SwiGLU.
    """
    gate_w, up_w, down_w = weights
    T, D = x.shape
    xq, xd, xs, spilled = quantize_spilled(att)
    o = multiply(xq, xd, xs, spilled, o_w[0], o_w[1], threads, chunk)
    y = np.empty_like(x)
    for t in range(T):
        for j in range(D):
            y[t, j] = x[t, j] + o[t, j]
    xq, xd, xs, spilled = quantize_spilled(rms_norm(y, norm, eps))
    gate = multiply(xq, xd, xs, spilled, gate_w[0], gate_w[1], threads, chunk)
    up = multiply(xq, xd, xs, spilled, up_w[0], up_w[1], threads, chunk)
    xq, xd, xs, spilled = quantize_spilled(_swiglu(gate, up, ffn))
    down = multiply(xq, xd, xs, spilled, down_w[0], down_w[1], threads, chunk)
    for t in range(T):
        for j in range(D):
            y[t, j] += down[t, j]
    return y


# A block's matrices, all of which must be packed with a kernel for the compiled path (BlockWeights.packed).
MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@numba.njit(nogil=True, cache=True)
def run_blocks(x, stack, keys, values, starts, bounds, eps, shape, ffn, cos, sin, threads, chunk):
    """The blocks of `stack` one after the other on rows x (T, D): one compiled call a forward.

    Rows bounds[r, 0]..bounds[r, 1] of x are session r's positions starts[r]..; keys[r], values[r]
    (blocks, KV, capacity, hd) are its cache, block i of the stack storing in its block i.
    """
    for index in range(len(stack)):
        attn_norm, attention, output, ffn_norm, swiglu = stack[index]
        q, k, v = qkv(x, attn_norm, eps, attention, cos, sin, shape, threads, chunk)
        att = np.empty((x.shape[0], shape[0] * shape[2]), dtype=np.float32)
        for r in range(len(keys)):
            t0, t1 = bounds[r, 0], bounds[r, 1]
            attend(q[t0:t1], k[t0:t1], v[t0:t1], keys[r][index], values[r][index], starts[r], att[t0:t1])
        x = feed_forward(x, att, output, ffn_norm, eps, swiglu, ffn, threads, chunk)
    return x


def stack(weights: list) -> List:
    """Blocks of packed matrices (llama.BlockWeights, at least one) as run_blocks takes them, gathered once.

    Each block is (attn_norm, (W_q, W_k, W_v), W_o, ffn_norm, (W_gate, W_up, W_down)), each matrix
    its (quants, scales) (PackedMatrix.blocks): one numba type for every block, whatever its types.
    The typed List is made and filled in compiled code (cached on disk): from Python, numba would
    compile its list methods in every process, ~1.2 s and ~15 MB of a worker's build.
    """
    gathered = None
    for w in weights:
        block = (
            np.array(w.attn_norm, dtype=np.float32),  # writable and contiguous, as every block's
            (w.attn_q.blocks, w.attn_k.blocks, w.attn_v.blocks),
            w.attn_output.blocks,
            np.array(w.ffn_norm, dtype=np.float32),
            (w.ffn_gate.blocks, w.ffn_up.blocks, w.ffn_down.blocks),
        )
        if gathered is None:
            gathered = _list_of(block)
        else:
            _append(gathered, block)
    return gathered


@numba.njit(nogil=True, cache=True)
def _list_of(item):
    items = List()
    items.append(item)
    return items


@numba.njit(nogil=True, cache=True)
def _append(items, item):
    items.append(item)


_CACHE = numba.types.float32[:, :, :, ::1]  # a session's keys or values (blocks, KV, capacity, hd)


@numba.njit(nogil=True, cache=True)
def _no_caches():
    return List.empty_list(_CACHE)


@numba.njit(nogil=True, cache=True)
def _clear(keys, values):
    keys.clear()
    values.clear()


@numba.njit(nogil=True, cache=True)
def _push(keys, values, k, v):
    keys.append(k)
    values.append(v)


def cache_lists() -> tuple[List, List]:
    """Empty typed Lists of the sessions' keys and values, to be refilled by each forward (`blocks`).

    Refilled in compiled code they cost ~10 µs a forward; built anew from Python, ~130 µs.
    """
    return _no_caches(), _no_caches()


def blocks(x, gathered: List, p, runs, cos, sin, lists: tuple[List, List]):
    """The blocks (`stack`) one after the other on rows x (T, D) float32; p: the model's LlamaParams.

    runs: (cache, start, t0, t1) for each session: rows t0..t1 of x are its
    positions start.., and cache (a llama.KVCache) receives their keys and
    values (block i of the stack in its block i). cos, sin (T, hd/2): each row's RoPE angles.
    lists (cache_lists) are refilled with the sessions' caches: one forward at a time may use them.
    """
    threads, chunk = kernels.parallel(kernels.threads()), chunk_min_bytes()
    keys, values = lists
    _clear(keys, values)
    for cache, *_ in runs:
        _push(keys, values, cache.k, cache.v)
    starts = np.array([start for _, start, _, _ in runs], dtype=np.int64)
    bounds = np.array([(t0, t1) for _, _, t0, t1 in runs], dtype=np.int64).reshape(len(runs), 2)
    shape = (p.n_heads, p.n_kv_heads, p.head_dim)
    return run_blocks(
        x, gathered, keys, values, starts, bounds, np.float32(p.eps), shape, p.ffn, cos, sin, threads, chunk
    )


@functools.cache
def warm_up() -> None:
    """Compile (or load compiled) the calls above, on a tiny block of Q4 and one of Q8_0 matrices."""
    kernels.warm_up()
    norm = np.ones(2 * BLOCK, dtype=np.float32)
    tiny = []
    for kind in (kernels.Q4_1, kernels.Q8_0):  # the same compiled code (PackedMatrix.blocks), run on both
        w = kernels.tiny(kind)  # (64, 64): two heads of 32, as every matrix of the tiny block
        tiny.append(SimpleNamespace(attn_norm=norm, ffn_norm=norm, **dict.fromkeys(MATRICES, w)))
    p = SimpleNamespace(n_heads=2, n_kv_heads=2, head_dim=BLOCK, eps=1e-5, ffn=2 * BLOCK)
    cache = SimpleNamespace(k=np.zeros((2, 2, 4, BLOCK), dtype=np.float32))
    cache.v = cache.k.copy()
    x, angles = np.ones((1, 2 * BLOCK), dtype=np.float32), np.zeros((1, BLOCK // 2), dtype=np.float32)
    blocks(x, stack(tiny), p, [(cache, 0, 0, 1)], angles, angles + 1, cache_lists())
