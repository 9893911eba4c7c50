"""Write small GGUF files for tests: tiny random models of every architecture, or one not supported."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import numpy as np

from tests.support.kquants import quantize_k, quantize_like

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


# ---------------------------------------------------------------- every architecture, loadable by llama.cpp

F32, F16 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16
Q4_0, Q5_0, Q5_1 = (
    gguf.GGMLQuantizationType.Q4_0,
    gguf.GGMLQuantizationType.Q5_0,
    gguf.GGMLQuantizationType.Q5_1,
)
Q4_K, Q5_K, Q6_K = (
    gguf.GGMLQuantizationType.Q4_K,
    gguf.GGMLQuantizationType.Q5_K,
    gguf.GGMLQuantizationType.Q6_K,
)
QTYPES = {t.name.lower(): t for t in (F32, F16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1)}
# A byte-level BPE vocabulary: GPT-2's 256 byte stand-ins, the results of a few merges, BOS and EOS.
MERGES = ["Ġ t", "h e", "Ġt he", "i s", "Ġ a"]
BOS, EOS = "<|bos|>", "<|eos|>"


def byte_tokens() -> list[str]:
    """GPT-2's printable stand-in for each byte, in byte order (as its vocabularies start)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: chr(b) for b in printable}
    chars |= {b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in chars)}
    return [chars[b] for b in range(256)]


VOCAB = [*byte_tokens(), *("".join(m.split()) for m in MERGES), BOS, EOS]


@dataclass(frozen=True)
class TinyArch:
    """A tiny model of one architecture: shapes, RoPE and window; every row length whole blocks of 32.

    rope_factor: linear RoPE scaling (rope.scaling.type=linear) by this factor. rope_freqs: write
    per-pair frequency factors (rope_freqs.weight), as Llama 3.1+ files carry llama3 scaling.
    tied: no output.weight, the head is the token embedding. window: gemma3's sliding window.
    out_scale: on the blocks' outputs (W_o, W_down, the post norms), so that they outweigh the
    embedding in the residual: with a tied head, the embedding alone predicts the input token again.
    """

    arch: str
    n_layers: int = 3
    hidden: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    ffn: int = 96
    context_length: int = 64
    eps: float = 1e-6
    rope_base: float = 10000.0
    rope_factor: float = 0.0
    rope_freqs: bool = False
    tied: bool = False
    window: int = 0
    out_scale: float = 1.0

    @property
    def vocab(self) -> int:
        return len(VOCAB)


TINY_ARCHS = {
    "llama": TinyArch("llama", rope_freqs=True),
    "llama_linear": TinyArch("llama", rope_factor=4.0, rope_base=500000.0),
    "qwen2": TinyArch("qwen2", tied=True, rope_base=1e6, out_scale=8.0),
    "qwen3": TinyArch(
        "qwen3", head_dim=32, tied=True, rope_base=1e6, out_scale=4.0
    ),  # q, k, v wider than hidden / heads
    # Six layers, so that layer 5 attends to every position, with the file's base and scaling.
    "gemma3": TinyArch(
        "gemma3", n_layers=6, head_dim=32, tied=True, rope_base=1e6, rope_factor=8.0, window=4, out_scale=16.0
    ),
    "phi3": TinyArch("phi3"),
}
# Tiny variants for the K types, whose blocks are super-blocks of 256: the same models, wider, so that
# every row (hidden, ffn, q and kv widths) is whole super-blocks. Written in K_TYPES ("q4_k_m": a mix
# as llama.cpp's Q4_K_M picks it). The tied heads need blocks' outputs that outweigh the embedding
# more at this width (gemma3 scales its embedding by sqrt(hidden) too): at the 64-wide out_scale,
# qwen3's and gemma3's greedy tokens repeat the input token.
_WIDE = {"hidden": 256, "ffn": 512}
TINY_K_ARCHS = {
    "llama_k": replace(TINY_ARCHS["llama"], head_dim=64, **_WIDE),
    "gemma3_k": replace(TINY_ARCHS["gemma3"], n_layers=3, head_dim=64, out_scale=64.0, **_WIDE),
    "phi3_k": replace(TINY_ARCHS["phi3"], head_dim=64, **_WIDE),
}
K_TYPES = ("q4_k", "q5_k", "q6_k", "q4_k_m")
HEAD_SCALE = 8.0  # logits of about this spread: random weights would otherwise give near ties


def tiny_names(qtype: str) -> dict[str, TinyArch]:
    """The tiny architectures written in `qtype`, by name: the K variants for a K type."""
    return TINY_K_ARCHS if qtype in K_TYPES else TINY_ARCHS


def tiny_arch(name: str) -> TinyArch:
    """The tiny architecture called `name`, of either table."""
    return (TINY_ARCHS | TINY_K_ARCHS)[name]


def tiny_arch_weights(t: TinyArch, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 tensors in numpy order (out, in), named as a GGUF of architecture t.arch names them."""
    rng = np.random.default_rng(seed)

    def matrix(out: int, inp: int, scale: float = 1.0) -> np.ndarray:
        return (scale * rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)

    def norm(n: int = t.hidden, scale: float = 1.0) -> np.ndarray:
        return (scale * (1.0 + 0.1 * rng.standard_normal(n))).astype(np.float32)

    def bias(n: int) -> np.ndarray:
        return (0.5 * rng.standard_normal(n)).astype(np.float32)

    q_dim, kv_dim = t.n_heads * t.head_dim, t.n_kv_heads * t.head_dim
    w = {"token_embd.weight": rng.standard_normal((t.vocab, t.hidden)).astype(np.float32)}
    if t.rope_freqs:  # llama3's shape: high frequencies kept, the lowest slowed eightfold
        w["rope_freqs.weight"] = np.geomspace(1.0, 8.0, t.head_dim // 2).astype(np.float32)
    for i in range(t.n_layers):
        n = f"blk.{i}."
        q, k, v = matrix(q_dim, t.hidden), matrix(kv_dim, t.hidden), matrix(kv_dim, t.hidden)
        gate, up = matrix(t.ffn, t.hidden), matrix(t.ffn, t.hidden)
        w[n + "attn_norm.weight"] = norm()
        if t.arch == "phi3":
            w[n + "attn_qkv.weight"] = np.concatenate([q, k, v])
        else:
            w |= {n + "attn_q.weight": q, n + "attn_k.weight": k, n + "attn_v.weight": v}
        if t.arch == "qwen2":
            w |= {
                n + "attn_q.bias": bias(q_dim),
                n + "attn_k.bias": bias(kv_dim),
                n + "attn_v.bias": bias(kv_dim),
            }
        if t.arch in ("qwen3", "gemma3"):
            w |= {n + "attn_q_norm.weight": norm(t.head_dim), n + "attn_k_norm.weight": norm(t.head_dim)}
        w[n + "attn_output.weight"] = matrix(t.hidden, q_dim, t.out_scale)
        if t.arch == "gemma3":
            w[n + "post_attention_norm.weight"] = norm(scale=t.out_scale)
        w[n + "ffn_norm.weight"] = norm()
        if t.arch == "phi3":
            w[n + "ffn_up.weight"] = np.concatenate([gate, up])  # gate ‖ up, as phi3 fuses them
        else:
            w |= {n + "ffn_gate.weight": gate, n + "ffn_up.weight": up}
        w[n + "ffn_down.weight"] = matrix(t.hidden, t.ffn, t.out_scale)
        if t.arch == "gemma3":
            w[n + "post_ffw_norm.weight"] = norm(scale=t.out_scale)
    w["output_norm.weight"] = norm()
    if not t.tied:
        w["output.weight"] = matrix(t.vocab, t.hidden, HEAD_SCALE)
    return w


def write_tiny_arch(
    path: Path,
    t: TinyArch,
    qtype: str = "f32",
    seed: int = 0,
    *,
    omit: str = "",
    extra: dict[str, np.ndarray] | None = None,
    metadata: dict[str, int | str | list[int] | None] | None = None,
) -> dict[str, np.ndarray]:
    """Write a tiny GGUF of t's architecture, its matrices in `qtype`; the float32 weights it holds.

    The same arguments give the same bytes. Vectors and the embedding stay float32 (as llama.cpp's
    converter keeps norms), but in "q4_k_m", which quantizes the embedding as llama.cpp does; a
    byte-level BPE tokenizer, so that llama.cpp loads it. The K types need t of TINY_K_ARCHS.
    omit: a tensor to leave out; extra: float32 tensors to add; metadata: keys to set, replace or drop.
    """
    if qtype not in QTYPES and qtype not in K_TYPES:
        raise ValueError(f"tiny files are written in {', '.join([*QTYPES, *K_TYPES])}, not {qtype!r}")
    w = gguf.GGUFWriter(path, arch=t.arch)
    _arch_metadata(w, t)
    for key, value in (metadata or {}).items():
        w.kv_data[0].pop(key, None)  # replaced, rather than written twice; None: left out
        if value is None:
            continue
        if isinstance(value, list):
            w.add_array(key, value)
        else:
            (w.add_string if isinstance(value, str) else w.add_uint32)(key, value)
    _tokenizer(w)
    held = {}
    for name, value in (tiny_arch_weights(t, seed) | (extra or {})).items():
        if name == omit:
            continue
        stored = _stored(name, value, t, qtype)
        if stored == F32:
            w.add_tensor(name, value)
            held[name] = value
        elif stored == F16:
            w.add_tensor(name, value.astype(np.float16))
            held[name] = value.astype(np.float16).astype(np.float32)
        else:
            k = stored in (Q4_K, Q5_K, Q6_K)
            packed = quantize_k(value, stored) if k else gguf.quants.quantize(value, stored)
            w.add_tensor(name, packed, raw_dtype=stored)
            held[name] = gguf.quants.dequantize(packed, stored)
    _finish(w)
    return held


def _stored(name: str, value: np.ndarray, t: TinyArch, qtype: str) -> gguf.GGMLQuantizationType:
    """The type tensor `name` is written in: vectors float32, and the embedding but in the Q4_K_M mix."""
    if value.ndim == 1:
        return F32
    if qtype == "q4_k_m":
        return q4_k_m_type(name, t)
    if name == "token_embd.weight":
        return F32
    return QTYPES.get(qtype) or gguf.GGMLQuantizationType[qtype.upper()]


def q4_k_m_type(name: str, t: TinyArch) -> gguf.GGMLQuantizationType:
    """A matrix's type in llama.cpp's Q4_K_M mix: Q4_K, but Q6_K for the head (the embedding, if tied) and
    for attn_v and ffn_down of the layers that get more bits (the first and last eighths, and every
    third between), and Q5_K for a fused attn_qkv."""
    if name == "output.weight" or (name == "token_embd.weight" and t.tied):
        return Q6_K
    if name.startswith("blk."):
        i, n = int(name.split(".")[1]), t.n_layers
        more_bits = i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2
        if more_bits and (".attn_v." in name or ".ffn_down." in name):
            return Q6_K
        if ".attn_qkv." in name:
            return Q5_K
    return Q4_K


def _arch_metadata(w: gguf.GGUFWriter, t: TinyArch) -> None:
    """Every hyper-parameter llama.cpp's load_hparams reads for t.arch (and this house does)."""
    w.add_block_count(t.n_layers)
    w.add_context_length(t.context_length)
    w.add_embedding_length(t.hidden)
    w.add_feed_forward_length(t.ffn)
    w.add_head_count(t.n_heads)
    w.add_head_count_kv(t.n_kv_heads)
    w.add_key_length(t.head_dim)
    w.add_value_length(t.head_dim)
    w.add_rope_dimension_count(t.head_dim)
    w.add_layer_norm_rms_eps(t.eps)
    w.add_rope_freq_base(t.rope_base)
    if t.rope_factor:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(t.rope_factor)
    if t.window:
        w.add_sliding_window(t.window)
    w.add_vocab_size(t.vocab)


def _tokenizer(w: gguf.GGUFWriter) -> None:
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(VOCAB)
    w.add_token_merges(MERGES)
    w.add_token_types([1] * (len(VOCAB) - 2) + [3, 3])  # BOS and EOS are control tokens
    w.add_bos_token_id(VOCAB.index(BOS))
    w.add_eos_token_id(VOCAB.index(EOS))
    w.add_add_bos_token(False)
