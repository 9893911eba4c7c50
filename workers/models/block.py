"""One transformer block, the reference every faster path is tested against.

A block is two residual lines: x + attention(norm(x)), then x + ffn(norm(x)).
What varies between architectures is data (workers.models.arch): biases on
q, k, v, RMS norms of q and k over each head, norms after attention and after
the feed-forward, the activation of the gate, the RoPE pairing and angles, the
query scale and a sliding window. A weight the architecture does not have is
None, and its line is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from workers.models.arch import ModelParams, block_tensors
from workers.models.dense import product
from workers.models.kvcache import KVCache
from workers.models.ops import ACTIVATIONS, apply_rope, attention, causal_mask, rms_norm
from workers.models.weights import Loader, Matrix


@dataclass(frozen=True)
class BlockWeights:
    """One block's tensors, named as in the checkpoint (`blk.N.<name>`); None where the model has none."""

    attn_norm: np.ndarray
    attn_q: Matrix
    attn_k: Matrix
    attn_v: Matrix
    attn_output: Matrix
    ffn_norm: np.ndarray
    ffn_gate: Matrix
    ffn_up: Matrix
    ffn_down: Matrix
    q_bias: np.ndarray | None = None
    k_bias: np.ndarray | None = None
    v_bias: np.ndarray | None = None
    q_norm: np.ndarray | None = None  # over each head's head_dim, before RoPE
    k_norm: np.ndarray | None = None
    post_attn_norm: np.ndarray | None = None  # on the attention's output, before the residual add
    post_ffn_norm: np.ndarray | None = None  # on the feed-forward's output, likewise


def shapes(p: ModelParams) -> dict[str, tuple[int, ...]]:
    """Each logical tensor's shape (numpy order, a matrix (out, in)) under hyper-parameters p."""
    q_dim, kv_dim = p.n_heads * p.head_dim, p.n_kv_heads * p.head_dim
    return {
        "attn_norm": (p.hidden,),
        "attn_q": (q_dim, p.hidden),
        "attn_k": (kv_dim, p.hidden),
        "attn_v": (kv_dim, p.hidden),
        "attn_output": (p.hidden, q_dim),
        "ffn_norm": (p.hidden,),
        "ffn_gate": (p.ffn, p.hidden),
        "ffn_up": (p.ffn, p.hidden),
        "ffn_down": (p.hidden, p.ffn),
        "q_bias": (q_dim,),
        "k_bias": (kv_dim,),
        "v_bias": (kv_dim,),
        "q_norm": (p.head_dim,),
        "k_norm": (p.head_dim,),
        "post_attn_norm": (p.hidden,),
        "post_ffn_norm": (p.hidden,),
    }


def load_block(load: Loader, p: ModelParams, i: int) -> BlockWeights:
    """Read block i's tensors as its architecture names them, shapes checked; fused ones cut by rows."""
    shape = shapes(p)
    found = {}
    for logical, (name, parts) in block_tensors(p.arch).items():
        full = f"blk.{i}.{name}"
        if logical in p.arch.optional and full not in load.file.tensors:
            continue
        if len(shape[logical]) == 1:
            found[logical] = load.vector(full, shape[logical][0])
            continue
        out, inp = shape[logical]
        if len(parts) == 1:
            found[logical] = load.matrix(full, out, inp)
            continue
        rows = [shape[part][0] for part in parts]  # a fused tensor: its parts' rows one after the other
        start = sum(rows[: parts.index(logical)])
        found[logical] = load.matrix(full, sum(rows), inp, rows=(start, start + out))
    return BlockWeights(**found)


# A session's rows in a forward: (its cache, its first position, its rows t0..t1 of x).
Run = tuple[KVCache, int, int, int]


def project(h: np.ndarray, w: Matrix, bias: np.ndarray | None) -> np.ndarray:
    """h @ w (+ bias)."""
    out = product(h, w)
    return out if bias is None else out + bias


def block(
    x: np.ndarray,
    w: BlockWeights,
    p: ModelParams,
    layer: int,
    index: int,
    runs: list[Run],
    rope: tuple[np.ndarray, np.ndarray],
) -> np.ndarray:
    """Block `layer` of the model (the stage's block `index`) on rows x (T, hidden).

    runs: each session's rows and cache (one session for a forward, one row per session for a
    batched decode step: the products take every row at once, attention is each session's own).
    rope: cos, sin (T, 1, hd/2), row t's angles at its own position under this layer's RoPE.
    """
    T, eps = x.shape[0], np.float32(p.eps)
    h = rms_norm(x, w.attn_norm, eps)
    q = project(h, w.attn_q, w.q_bias).reshape(T, p.n_heads, p.head_dim)  # (T, H, hd)
    k = project(h, w.attn_k, w.k_bias).reshape(T, p.n_kv_heads, p.head_dim)  # (T, KV, hd)
    v = project(h, w.attn_v, w.v_bias).reshape(T, p.n_kv_heads, p.head_dim)  # (T, KV, hd)
    if w.q_norm is not None:
        q = rms_norm(q, w.q_norm, eps)
    if w.k_norm is not None:
        k = rms_norm(k, w.k_norm, eps)
    q, k = apply_rope(q, *rope, p.arch.rope), apply_rope(k, *rope, p.arch.rope)
    heads = []
    for cache, start, t0, t1 in runs:
        keys, values, first = cache.extend(index, start, k[t0:t1], v[t0:t1])  # (KV, L, hd) each
        mask = causal_mask(t1 - t0, start, p.window[layer], first)
        heads.append(attention(q[t0:t1], keys, values, mask, p.query_scale))  # (t1-t0, H·hd)
    a = product(np.concatenate(heads) if len(heads) > 1 else heads[0], w.attn_output)  # (T, hidden)
    if w.post_attn_norm is not None:
        a = rms_norm(a, w.post_attn_norm, eps)
    x = x + a
    h = rms_norm(x, w.ffn_norm, eps)
    f = product(ACTIVATIONS[p.arch.activation](product(h, w.ffn_gate)) * product(h, w.ffn_up), w.ffn_down)
    if w.post_ffn_norm is not None:
        f = rms_norm(f, w.post_ffn_norm, eps)
    return x + f
