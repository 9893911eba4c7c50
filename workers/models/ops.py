"""Pure numpy pieces of the reference forward: norms, activations, RoPE, masks, attention."""

from __future__ import annotations

import numpy as np

from workers.models.arch import NEOX, LayerRope


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: np.float32) -> np.ndarray:
    """Scale each row of x (..., D) to unit root-mean-square, then by `weight` (D,)."""
    return x * (1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)) * weight


def silu(x: np.ndarray) -> np.ndarray:
    """x · sigmoid(x)."""
    with np.errstate(over="ignore"):  # exp(-x) → inf for x < -88 gives the right limit, 0
        return x / (1.0 + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU in its tanh form, as ggml_gelu computes it: x/2 · (1 + tanh(√(2/π) (x + 0.044715 x³)))."""
    c = np.float32(np.sqrt(2.0 / np.pi))
    return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(c * (x + np.float32(0.044715) * x * x * x)))


ACTIVATIONS = {"silu": silu, "gelu_tanh": gelu_tanh}


def rope_tables(positions: np.ndarray, head_dim: int, rope: LayerRope) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of each position's rotation angles, each (T, 1, head_dim/2).

    Pair i turns by pos · scale · base^(-2i/hd) / factors[i], as ggml_rope_ext with freq factors.
    """
    inv_freq = rope.base ** (-np.arange(0, head_dim, 2) / head_dim)  # (hd/2,)
    if rope.factors is not None:
        inv_freq = inv_freq / np.asarray(rope.factors)
    angles = (positions[:, None] * rope.scale) * inv_freq[None, :]  # (T, hd/2), in float64
    return (
        np.cos(angles).astype(np.float32)[:, None, :],
        np.sin(angles).astype(np.float32)[:, None, :],
    )


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, pairing: str) -> np.ndarray:
    """Rotate the pairs of each head of x (T, H, hd): (2i, 2i+1) ("norm"), or (i, i + hd/2) ("neox").

    GGUF llama files store Q and K rows permuted so that the adjacent pairing
    (ggml's "normal" RoPE) matches the original model's rotate-half; the
    others keep rotate-half (NEOX) as trained.
    """
    half = x.shape[-1] // 2
    out = np.empty_like(x)
    if pairing == NEOX:
        first, second = x[..., :half], x[..., half:]  # (T, H, hd/2) each
        out[..., :half] = first * cos - second * sin
        out[..., half:] = first * sin + second * cos
    else:
        even, odd = x[..., 0::2], x[..., 1::2]  # (T, H, hd/2) each
        out[..., 0::2] = even * cos - odd * sin
        out[..., 1::2] = even * sin + odd * cos
    return out


def causal_mask(T: int, start_pos: int, window: int = 0, first: int = 0) -> np.ndarray | None:
    """Additive mask (T, start_pos + T - first) over keys at first..start_pos + T: row i sees keys up
    to position start_pos + i.

    window > 0: only the last `window` of them, itself included (llama.cpp's standard sliding window,
    llama_hparams::is_masked_swa: key p0 is hidden from query p1 when p1 - p0 >= window).
    """
    pos = start_pos + np.arange(T)[:, None]  # (T, 1) each row's position
    if T == 1 and (window == 0 or start_pos - first < window):
        return None  # one new row sees every key given
    keys = np.arange(first, start_pos + T)[None, :]  # (1, L)
    hidden = (keys > pos) | ((pos - keys >= window) if window else False)
    return np.where(hidden, np.float32(-np.inf), np.float32(0))


def softmax(x: np.ndarray) -> np.ndarray:
    """Softmax along the last axis, in place on a fresh array."""
    x = x - x.max(axis=-1, keepdims=True)
    np.exp(x, out=x)
    x /= x.sum(axis=-1, keepdims=True)
    return x


def attention(
    q: np.ndarray, keys: np.ndarray, values: np.ndarray, mask: np.ndarray | None, scale: float
) -> np.ndarray:
    """Grouped-query attention of q (T, H, hd) over keys, values (KV, L, hd); (T, H·hd) out.

    Query head h reads KV head h // (H / KV). Rather than repeating K and V
    (repeat_kv), the query heads of a group are stacked as extra rows.
    """
    T, H, hd = q.shape
    n_kv, L = keys.shape[0], keys.shape[1]
    group = H // n_kv
    q = q * np.float32(scale)
    q = q.reshape(T, n_kv, group, hd).transpose(1, 2, 0, 3).reshape(n_kv, group * T, hd)  # (KV, G·T, hd)
    scores = (q @ keys.transpose(0, 2, 1)).reshape(n_kv, group, T, L)  # (KV, G, T, L)
    if mask is not None:
        scores += mask
    probs = softmax(scores).reshape(n_kv, group * T, L)  # (KV, G·T, L)
    out = (probs @ values).reshape(n_kv, group, T, hd)  # (KV, G, T, hd)
    return out.transpose(2, 0, 1, 3).reshape(T, H * hd)  # (T, H·hd)
