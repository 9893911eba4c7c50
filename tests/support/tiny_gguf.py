"""Write small GGUF files for tests: a tiny random llama model, or another architecture."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from tests.support.kquants import quantize_like

Q4_1 = gguf.GGMLQuantizationType.Q4_1
Q8_0 = gguf.GGMLQuantizationType.Q8_0


@dataclass(frozen=True)
class TinyLlama:
    """Hyper-parameters of the tiny model; shapes unlike SmolLM2's on purpose."""

    n_layers: int = 3
    hidden: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn: int = 96
    vocab: int = 40
    context_length: int = 32
    eps: float = 1e-6
    rope_base: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads


def tiny_weights(t: TinyLlama, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 tensors in numpy order (out, in), named as in a llama GGUF."""
    rng = np.random.default_rng(seed)

    def matrix(out: int, inp: int) -> np.ndarray:
        return (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(t.hidden)).astype(np.float32)

    q_dim, kv_dim = t.n_heads * t.head_dim, t.n_kv_heads * t.head_dim
    w = {"token_embd.weight": rng.standard_normal((t.vocab, t.hidden)).astype(np.float32)}
    for i in range(t.n_layers):
        n = f"blk.{i}."
        w |= {
            n + "attn_norm.weight": norm(),
            n + "attn_q.weight": matrix(q_dim, t.hidden),
            n + "attn_k.weight": matrix(kv_dim, t.hidden),
            n + "attn_v.weight": matrix(kv_dim, t.hidden),
            n + "attn_output.weight": matrix(t.hidden, q_dim),
            n + "ffn_norm.weight": norm(),
            n + "ffn_gate.weight": matrix(t.ffn, t.hidden),
            n + "ffn_up.weight": matrix(t.ffn, t.hidden),
            n + "ffn_down.weight": matrix(t.hidden, t.ffn),
        }
    w |= {"output_norm.weight": norm(), "output.weight": matrix(t.vocab, t.hidden)}
    return w


def write_tiny_llama(
    path: Path,
    t: TinyLlama = TinyLlama(),
    *,
    omit: str = "",
    mixed_types: bool = False,
    blocks: bool = False,
    types: dict[str, gguf.GGMLQuantizationType] | None = None,
) -> dict[str, np.ndarray]:
    """Write a tiny llama GGUF (untied head) and return the float32 weights it holds.

    omit: a tensor name to leave out. mixed_types: store the FFN matrices as
    Q4_1, attn_v as Q8_0 and token_embd as F16 (returned as their dequantized values).
    blocks: store every matrix of every block in blocks with a kernel, attn_v and
    the head as Q8_0, the others as Q4_1 (the embedding stays float32).
    types: a matrix's type by a part of its name (".ffn_down.", "token_embd"), the first
    that matches; its blocks are random valid ones of the weights' size (tests.support.kquants),
    an F16 matrix the weights rounded.
    """
    weights = tiny_weights(t)
    w = _llama_writer(path, t)
    w.add_rope_freq_base(t.rope_base)
    w.add_vocab_size(t.vocab)
    held = {}
    for name, value in weights.items():
        if name == omit:
            continue
        in_block, matrix = name.startswith("blk."), value.ndim == 2
        qtype = None
        chosen = next((q for part, q in (types or {}).items() if part in name and matrix), None)
        if chosen == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, value.astype(np.float16))
            held[name] = value.astype(np.float16).astype(np.float32)
            continue
        if chosen is not None:
            raw, held[name] = quantize_like(value, chosen, seed=len(held))
            w.add_tensor(name, raw, raw_dtype=chosen)
            continue
        if mixed_types and ".attn_v." in name:
            qtype = Q8_0
        elif mixed_types and ".ffn_" in name and matrix:
            qtype = Q4_1
        elif blocks and (".attn_v." in name or name == "output.weight"):
            qtype = Q8_0
        elif blocks and in_block and matrix:
            qtype = Q4_1
        if qtype is not None:
            packed = gguf.quants.quantize(value, qtype)
            w.add_tensor(name, packed, raw_dtype=qtype)
            held[name] = gguf.quants.dequantize(packed, qtype)
        elif mixed_types and name == "token_embd.weight":
            w.add_tensor(name, value.astype(np.float16))
            held[name] = value.astype(np.float16).astype(np.float32)
        else:
            w.add_tensor(name, value)
            held[name] = value
    _finish(w)
    return held


def write_tiny_tokenized(
    path: Path, t: TinyLlama, tokens: list[str], n_normal: int, eos_id: int, chat_template: str | None = None
) -> None:
    """Write a tiny llama GGUF with a byte-level BPE tokenizer over `tokens` (one merge, "a b").

    n_normal: how many leading tokens are normal text; the rest are control tokens.
    """
    w = _llama_writer(path, t)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges(["a b"])
    w.add_token_types([1] * n_normal + [3] * (len(tokens) - n_normal))
    w.add_eos_token_id(eos_id)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    for name, value in tiny_weights(t).items():
        w.add_tensor(name, value)
    _finish(w)


def _llama_writer(path: Path, t: TinyLlama) -> gguf.GGUFWriter:
    """A GGUF writer holding the llama hyper-parameters of `t`."""
    w = gguf.GGUFWriter(path, arch="llama")
    w.add_block_count(t.n_layers)
    w.add_context_length(t.context_length)
    w.add_embedding_length(t.hidden)
    w.add_feed_forward_length(t.ffn)
    w.add_head_count(t.n_heads)
    w.add_head_count_kv(t.n_kv_heads)
    w.add_layer_norm_rms_eps(t.eps)
    return w


def write_other_architecture(path: Path, arch: str = "gpt2") -> None:
    """Write a small valid GGUF whose architecture is not llama."""
    w = gguf.GGUFWriter(path, arch=arch)
    w.add_block_count(2)
    w.add_context_length(16)
    w.add_embedding_length(8)
    w.add_head_count(2)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    _finish(w)


def _finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
