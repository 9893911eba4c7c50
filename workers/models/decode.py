"""A packed block on a few rows (decode steps, short prompts) in three compiled calls.

For a few rows the products with packed weights take ~70 µs each, and the
numpy work around them (norms, RoPE, attention, SwiGLU: some thirty calls of
~10 µs a block) cost as much again. Here a forward's blocks are one compiled
call (`run_blocks`: numba's dispatch of each call costs ~5 µs), a block three
compiled functions, with nothing in Python between its products:

- `qkv`: rms_norm, the rows rounded once per kind the three products take, q, k, v (+ their biases),
  the norms of q and k heads, RoPE on q and k (either pairing; the angles come from outside);
- `attend`, once per session: the session's new keys and values stored in its cache, then each row's
  attention over the positions up to its own (or its sliding window's), scaled as the model says;
- `feed_forward`: x + attention · W_o (normed after, where the model does), rms_norm, the rows
  quantized once for gate and up, act(gate) ⊙ up · W_down (normed after, likewise), + x.

The pieces that are not products live in workers.models.decode_ops. Numba's
cache stamps a function by its own file only: after changing decode_ops (or
kernels_q8), change this file too, or the cached run_blocks keeps the old code.

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
from workers.models.arch import ARCHS, GELU_TANH, NEOX, LayerRope
from workers.models.decode_ops import attend, attend_parallel, gated, prepare, rms_norm, rotate, stores_ahead
from workers.models.kvcache import KVCache
from workers.models.products import PARALLEL_ROWS, chunk_min_bytes, multiply, needs, rounded

BLOCK = 32  # weights of a block of the tiny matrices warm_up compiles on


@numba.njit(nogil=True, cache=True)
def qkv(x, norm, eps, weights, extras, cos, sin, shape, threads, chunk):
    """q (T, H, hd) and k, v (T, KV, hd) of rows x (T, D); q and k rotated by row t's cos, sin (T, hd/2).

    weights: W_q, W_k, W_v, each a packed matrix's (kind, quants, scales) (PackedMatrix.blocks), of any
    types: the rows are rounded once for each rounding they take;
    extras: the biases of q, k, v and the norms of q and k heads, each empty where the model has none;
    shape: (H, KV, hd, neox, gelu), neox 1 for RoPE on halves, 0 on adjacent pairs.
    """
    q_w, k_w, v_w = weights
    q_bias, k_bias, v_bias, q_norm, k_norm = extras
    n_heads, n_kv, head_dim, neox, _ = shape
    a = rounded(rms_norm(x, norm, eps), needs(weights), threads)
    T = x.shape[0]
    q = np.empty((T, n_heads, head_dim), dtype=np.float32)
    k = np.empty((T, n_kv, head_dim), dtype=np.float32)
    v = np.empty((T, n_kv, head_dim), dtype=np.float32)
    queries = multiply(a, q_w, threads, chunk)
    prepare(queries, n_heads, head_dim, q_bias, q_norm, eps)
    rotate(queries, n_heads, head_dim, neox, cos, sin, q)
    keys = multiply(a, k_w, threads, chunk)
    prepare(keys, n_kv, head_dim, k_bias, k_norm, eps)
    rotate(keys, n_kv, head_dim, neox, cos, sin, k)
    values = multiply(a, v_w, threads, chunk)
    prepare(values, n_kv, head_dim, v_bias, v_bias[:0], eps)
    for t in range(T):
        for g in range(n_kv):
            for j in range(head_dim):
                v[t, g, j] = values[t, g * head_dim + j]
    return q, k, v


@numba.njit(nogil=True, cache=True)
def feed_forward(x, att, o_w, norm, eps, weights, post, ffn, gelu, threads, chunk):
    """The rest of a block on rows x (T, D) given their attention att (T, H·hd): the block's output rows.

    y = x + post_attn(att·W_o), then y + post_ffn(act(gate) ⊙ up · W_down) of rms_norm(y), with
    weights: W_gate, W_up, W_down, each with o_w as qkv's weights; post: the norms after attention
    and after the FFN, each empty where the model has none; ffn: the hidden width of the FFN.
    """
    gate_w, up_w, down_w = weights
    post_attn, post_ffn = post
    T, D = x.shape
    o = multiply(rounded(att, needs((o_w,)), threads), o_w, threads, chunk)
    if post_attn.size:
        o = rms_norm(o[:, :D], post_attn, eps)
    y = np.empty_like(x)
    for t in range(T):
        for j in range(D):
            y[t, j] = x[t, j] + o[t, j]
    a = rounded(rms_norm(y, norm, eps), needs((gate_w, up_w)), threads)
    gate = multiply(a, gate_w, threads, chunk)
    up = multiply(a, up_w, threads, chunk)
    down = multiply(rounded(gated(gate, up, ffn, gelu), needs((down_w,)), threads), down_w, threads, chunk)
    if post_ffn.size:
        down = rms_norm(down[:, :D], post_ffn, eps)
    for t in range(T):
        for j in range(D):
            y[t, j] += down[t, j]
    return y


# The matrices of a block, each packed with a kernel on the compiled path (transformer.all_packed).
MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def supports(p, layers: range) -> str | None:
    """Why the blocks `layers` of a model of ModelParams p cannot run here, or None when they can.

    Here a block is: rms_norm, q k v with or without biases, q and k heads with or without their
    norms, RoPE of either pairing at angles given from outside (per layer), attention scaled by
    any factor over every position or a window, W_o, a norm after it or not, then rms_norm and a
    gated FFN (silu or GELU's tanh form), a norm after it or not. Anything else runs on the
    reference (workers.models.block).
    """
    arch = p.arch
    known = {
        "attn_norm",
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "ffn_norm",
        "ffn_gate",
        "ffn_up",
        "ffn_down",
    }
    known |= set(OPTIONAL)
    reasons = [f"the tensor {name}" for name in sorted(set(arch.tensors) | _fused(arch)) if name not in known]
    if arch.activation not in ("silu", GELU_TANH):
        reasons.append(f"the {arch.activation} activation")
    if p.head_dim % 2:
        reasons.append(f"RoPE on an odd head_dim {p.head_dim}")
    return f"the compiled path does not compute {', '.join(reasons)} ({arch.name})" if reasons else None


def _fused(arch) -> set[str]:
    return {logical for parts in arch.fused.values() for logical in parts}


# A block's vectors besides its two norms, in the order run_blocks takes them; empty where absent.
OPTIONAL = ("q_bias", "k_bias", "v_bias", "q_norm", "k_norm", "post_attn_norm", "post_ffn_norm")


@numba.njit(nogil=True, cache=True)
def run_blocks(x, stack, keys, values, starts, bounds, eps, shape, ffn, rope, where, scale, threads, chunk):
    """The blocks of `stack` one after the other on rows x (T, D): one compiled call a forward.

    Rows bounds[r, 0]..bounds[r, 1] of x are session r's positions starts[r]..; keys[2r], values[2r]
    (global blocks, KV, capacity, hd) and keys[2r + 1], values[2r + 1] (windowed blocks, KV, ring, hd)
    are its cache (workers.models.kvcache), block i of the stack storing in block slots[i] of its kind's.
    rope: (which, cos, sin): block i's angles are cos[which[i]], sin[which[i]] (T, hd/2);
    where: (windows, slots): windows[i] block i's sliding window (0: none); scale: the factor on q·k.
    """
    which, cos, sin = rope
    windows, slots = where
    for index in range(len(stack)):
        attn_norm, attention, output, ffn_norm, ffn_w, extras, post = stack[index]
        c, s = cos[which[index]], sin[which[index]]
        q, k, v = qkv(x, attn_norm, eps, attention, extras, c, s, shape, threads, chunk)
        att = np.empty((x.shape[0], shape[0] * shape[2]), dtype=np.float32)
        kind = 1 if windows[index] > 0 else 0
        for r in range(len(starts)):
            t0, t1 = bounds[r, 0], bounds[r, 1]
            cache_k, cache_v = keys[2 * r + kind][slots[index]], values[2 * r + kind][slots[index]]
            w = windows[index]
            if threads > 1 and t1 - t0 >= PARALLEL_ROWS and stores_ahead(starts[r], t1 - t0, w):
                attend_parallel(
                    q[t0:t1], k[t0:t1], v[t0:t1], cache_k, cache_v, starts[r], att[t0:t1], scale, w, threads
                )
            else:
                attend(q[t0:t1], k[t0:t1], v[t0:t1], cache_k, cache_v, starts[r], att[t0:t1], scale, w)
        x = feed_forward(x, att, output, ffn_norm, eps, ffn_w, post, ffn, shape[4], threads, chunk)
    return x


def _vector(w, name: str) -> np.ndarray:
    """A block's vector as compiled code takes it (writable, contiguous float32), empty if it has none."""
    value = getattr(w, name)
    return np.zeros(0, dtype=np.float32) if value is None else np.array(value, dtype=np.float32)


def stack(weights: list) -> List:
    """Blocks of packed matrices (block.BlockWeights, at least one) as run_blocks takes them, gathered once.

    Each block is (attn_norm, (W_q, W_k, W_v), W_o, ffn_norm, (W_gate, W_up, W_down), (q_bias,
    k_bias, v_bias, q_norm, k_norm), (post_attn_norm, post_ffn_norm)), each matrix its (kind,
    quants, scales) (PackedMatrix.blocks), an absent vector empty: one numba type for every block,
    whatever its matrices' types.
    The typed List is made and filled in compiled code (cached on disk): from Python, numba would
    compile its list methods in every process, ~1.2 s and ~15 MB of a worker's build.
    """
    gathered = None
    for w in weights:
        extras = tuple(_vector(w, name) for name in OPTIONAL)
        block = (
            _vector(w, "attn_norm"),
            (w.attn_q.blocks, w.attn_k.blocks, w.attn_v.blocks),
            w.attn_output.blocks,
            _vector(w, "ffn_norm"),
            (w.ffn_gate.blocks, w.ffn_up.blocks, w.ffn_down.blocks),
            extras[:5],
            extras[5:],
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
def _push(keys, values, k, v, ring_k, ring_v):
    keys.append(k)
    values.append(v)
    keys.append(ring_k)
    values.append(ring_v)


def cache_lists() -> tuple[List, List]:
    """Empty typed Lists of the sessions' keys and values, to be refilled by each forward (`blocks`).

    Refilled in compiled code they cost ~10 µs a forward; built anew from Python, ~130 µs.
    """
    return _no_caches(), _no_caches()


def blocks(x, gathered: List, p, layers: range, runs, tables: dict, lists: tuple[List, List]):
    """The blocks (`stack`) of `layers` one after the other on rows x (T, D) float32; p: ModelParams.

    runs: (cache, start, t0, t1) for each session: rows t0..t1 of x are its
    positions start.., and cache (a kvcache.KVCache, made for these layers' windows) receives their
    keys and values. tables: each LayerRope of the layers → cos, sin
    (T, 1, hd/2), workers.models.ops.rope_tables: any base, scale and frequency factors come in there.
    lists (cache_lists) are refilled with the sessions' caches: one forward at a time may use them.
    """
    threads, chunk = kernels.parallel(kernels.threads()), chunk_min_bytes()
    keys, values = lists
    _clear(keys, values)
    for cache, *_ in runs:
        _push(keys, values, cache.k, cache.v, cache.ring_k, cache.ring_v)
    starts = np.array([start for _, start, _, _ in runs], dtype=np.int64)
    bounds = np.array([(t0, t1) for _, _, t0, t1 in runs], dtype=np.int64).reshape(len(runs), 2)
    ropes = list(tables)
    which = np.array([ropes.index(p.rope[i]) for i in layers], dtype=np.int64)
    cos = np.ascontiguousarray(np.stack([tables[r][0][:, 0] for r in ropes]))  # (R, T, hd/2)
    sin = np.ascontiguousarray(np.stack([tables[r][1][:, 0] for r in ropes]))
    windows = np.array([p.window[i] for i in layers], dtype=np.int64)
    slots = np.array(runs[0][0].slots, dtype=np.int64)  # the same for every session of the stage
    shape = (
        p.n_heads,
        p.n_kv_heads,
        p.head_dim,
        int(p.arch.rope == NEOX),
        int(p.arch.activation == GELU_TANH),
    )
    eps, scale = np.float32(p.eps), np.float32(p.query_scale)
    rope, where = (which, cos, sin), (windows, slots)
    return run_blocks(
        x, gathered, keys, values, starts, bounds, eps, shape, p.ffn, rope, where, scale, threads, chunk
    )


@functools.cache
def warm_up(kinds: tuple[str, ...] = (kernels.Q4_1, kernels.Q8_0, "q4_k")) -> None:
    """Compile (or load compiled) the calls above, and the products and dequantizing of the types `kinds`.

    The calls above, one compiled path for every type, on a tiny block of Q4_1 and one of Q8_0 matrices
    whatever `kinds` are; by default kinds reach every dequantizer (kernels.warm_up), and a stage names
    its own matrices' types (workers.models.weights), so that it loads none its file does not take.
    """
    kernels.warm_up(kinds)
    norm = np.ones(2 * BLOCK, dtype=np.float32)
    tiny = []
    for kind in (kernels.Q4_1, kernels.Q8_0):  # the same compiled code (PackedMatrix.blocks), run on both
        w = kernels.tiny(kind)  # (64, 64): two heads of 32, as every matrix of the tiny block
        vectors = dict.fromkeys(OPTIONAL) | {"attn_norm": norm, "ffn_norm": norm}
        tiny.append(SimpleNamespace(**vectors, **dict.fromkeys(MATRICES, w)))
    rope = LayerRope(10000.0)
    p = SimpleNamespace(
        n_heads=2, n_kv_heads=2, head_dim=BLOCK, eps=1e-5, ffn=2 * BLOCK, arch=ARCHS["llama"],
        rope=(rope, rope), window=(0, 0), query_scale=1 / np.sqrt(BLOCK),
    )  # fmt: skip
    cache = KVCache(p.window, 2, BLOCK, 4)
    cache.reserve(1)
    x, angles = np.ones((1, 2 * BLOCK), dtype=np.float32), np.zeros((1, 1, BLOCK // 2), dtype=np.float32)
    blocks(x, stack(tiny), p, range(2), [(cache, 0, 0, 1)], {rope: (angles, angles + 1)}, cache_lists())
