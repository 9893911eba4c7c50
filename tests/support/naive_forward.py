"""Every architecture's forward written plainly in float64, for tests to hold the reference block to."""

from __future__ import annotations

import numpy as np

from tests.support.tiny_gguf import TinyArch


def naive_logits(w: dict[str, np.ndarray], t: TinyArch, tokens: list[int]) -> np.ndarray:
    """The forward written plainly in float64: no cache, K and V repeated, a loop over heads and pairs."""
    T, H, KV, hd = len(tokens), t.n_heads, t.n_kv_heads, t.head_dim
    w = {k: v.astype(np.float64) for k, v in w.items()}
    gemma, phi3 = t.arch == "gemma3", t.arch == "phi3"

    def norm(x, weight):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + t.eps) * weight

    def rope(x, base, scale):  # pair (2i, 2i+1) for llama, (i, i + hd/2) for the others
        factors = w.get("rope_freqs.weight", np.ones(hd // 2))
        out = x.copy()
        for i in range(hd // 2):
            angle = np.arange(T)[:, None] * scale * base ** (-2 * i / hd) / factors[i]
            a, b = (2 * i, 2 * i + 1) if t.arch == "llama" else (i, i + hd // 2)
            out[..., a] = x[..., a] * np.cos(angle) - x[..., b] * np.sin(angle)
            out[..., b] = x[..., a] * np.sin(angle) + x[..., b] * np.cos(angle)
        return out

    def gelu(x):
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))

    x = w["token_embd.weight"][tokens] * (np.sqrt(t.hidden) if gemma else 1.0)
    for layer in range(t.n_layers):
        n = f"blk.{layer}."
        windowed = gemma and layer % 6 != 5
        base, scale = (
            (10000.0, 1.0) if windowed else (t.rope_base, 1 / t.rope_factor if t.rope_factor else 1.0)
        )
        h = norm(x, w[n + "attn_norm.weight"])
        if phi3:
            q, k, v = np.split(h @ w[n + "attn_qkv.weight"].T, [H * hd, H * hd + KV * hd], axis=-1)
        else:
            q, k, v = (h @ w[n + f"attn_{m}.weight"].T + w.get(n + f"attn_{m}.bias", 0.0) for m in "qkv")
        q, k, v = q.reshape(T, H, hd), k.reshape(T, KV, hd), v.reshape(T, KV, hd)
        if n + "attn_q_norm.weight" in w:
            q, k = norm(q, w[n + "attn_q_norm.weight"]), norm(k, w[n + "attn_k_norm.weight"])
        q, k = rope(q, base, scale), np.repeat(rope(k, base, scale), H // KV, axis=1)
        v = np.repeat(v, H // KV, axis=1)
        heads = []
        for j in range(H):
            scores = q[:, j] @ k[:, j].T / np.sqrt(hd)
            i_pos, k_pos = np.arange(T)[:, None], np.arange(T)[None, :]
            scores[(k_pos > i_pos) | (windowed & (i_pos - k_pos >= t.window))] = -np.inf
            p = np.exp(scores - scores.max(-1, keepdims=True))
            heads.append(p / p.sum(-1, keepdims=True) @ v[:, j])
        o = np.concatenate(heads, axis=-1) @ w[n + "attn_output.weight"].T
        x = x + (norm(o, w[n + "post_attention_norm.weight"]) if gemma else o)
        h = norm(x, w[n + "ffn_norm.weight"])
        if phi3:
            gate, up = np.split(h @ w[n + "ffn_up.weight"].T, 2, axis=-1)
        else:
            gate, up = h @ w[n + "ffn_gate.weight"].T, h @ w[n + "ffn_up.weight"].T
        f = ((gelu(gate) if gemma else gate / (1 + np.exp(-gate))) * up) @ w[n + "ffn_down.weight"].T
        x = x + (norm(f, w[n + "post_ffw_norm.weight"]) if gemma else f)
    return norm(x, w["output_norm.weight"]) @ w.get("output.weight", w["token_embd.weight"]).T
