"""The architectures a GGUF file may hold, one table entry each, and its hyper-parameters read by the entry.

An entry says which tensors a block has (logical name → name in the file,
which are optional, which fused tensors split into which), its RoPE (pairing,
frequency factors, a base of its own on windowed layers), its activation, its
scales and which layers attend through a sliding window. The code that
computes reads the entry; none of it asks which architecture it runs. What the
table does not know is refused when the file is read, naming it: an
architecture, a RoPE scaling type, a tensor, a per-layer value that varies.
Every entry's head is `output.weight` when the file holds it, else the token
embedding (tied), as llama.cpp reads all five.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from workers.spec import GGUFError

if TYPE_CHECKING:  # only read here: a file is opened by those who hand it in
    from workers.models.gguf_file import GGUFFile

NORM, NEOX = "norm", "neox"  # RoPE pairing: adjacent dims (2i, 2i+1), or halves (i, i + hd/2)
SILU, GELU_TANH = "silu", "gelu_tanh"

# Every block's tensors by logical name (the fields of workers.models.block.BlockWeights).
PLAIN = {
    "attn_norm": "attn_norm.weight",
    "attn_q": "attn_q.weight",
    "attn_k": "attn_k.weight",
    "attn_v": "attn_v.weight",
    "attn_output": "attn_output.weight",
    "ffn_norm": "ffn_norm.weight",
    "ffn_gate": "ffn_gate.weight",
    "ffn_up": "ffn_up.weight",
    "ffn_down": "ffn_down.weight",
}
BIASES = {"q_bias": "attn_q.bias", "k_bias": "attn_k.bias", "v_bias": "attn_v.bias"}
QK_NORMS = {"q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight"}
POST_NORMS = {"post_attn_norm": "post_attention_norm.weight", "post_ffn_norm": "post_ffw_norm.weight"}
HEAD = ("token_embd.weight", "output_norm.weight", "output.weight")
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")
_MISSING = object()


@dataclass(frozen=True)
class Window:
    """Layers attending only to their last `size` positions, `size` read from `<arch>.<key>`.

    Every `period`-th layer (il % period == period - 1) attends to all positions; the others
    use RoPE base `rope_base` without the file's scaling (llama.cpp hard-codes both for gemma3).
    """

    key: str
    period: int
    rope_base: float


@dataclass(frozen=True)
class Arch:
    """One architecture: its block's tensors, RoPE, activation, scales and windows.

    tensors: logical name → name inside `blk.N.`; optional: logical names a block may lack.
    fused: a name inside `blk.N.` → the logical tensors its rows hold, in order (each part as
    many rows as its own shape has). rope_freqs: whether `rope_freqs.weight` (per-pair
    frequency factors, how Llama 3.1+ files carry llama3 scaling) may be present.
    query_scale: the factor on q·k, given (n_layers, hidden, n_heads, head_dim).
    refused: tensor names outside blocks → why they are refused.
    """

    name: str
    tensors: Mapping[str, str]
    rope: str = NORM
    optional: frozenset[str] = frozenset()
    fused: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    rope_freqs: bool = False
    activation: str = SILU
    embed_scale: bool = False  # the embedding × √hidden
    query_scale: Callable[[int, int, int, int], float] = lambda n_layers, hidden, heads, hd: 1 / math.sqrt(hd)
    window: Window | None = None
    refused: Mapping[str, str] = field(default_factory=dict)


def _gemma3_scale(n_layers: int, hidden: int, n_heads: int, head_dim: int) -> float:
    # llama.cpp's load_hparams: Gemma 3 27B (62 layers) scales by hidden / heads, the others by key_length.
    return 1 / math.sqrt(hidden // n_heads if n_layers == 62 else head_dim)


_LONGROPE = "LongRoPE (rope_factors_long/short) is not supported"
ARCHS: dict[str, Arch] = {
    a.name: a
    for a in (
        Arch("llama", PLAIN, rope_freqs=True),
        Arch("qwen2", PLAIN | BIASES, rope=NEOX),
        Arch("qwen3", PLAIN | QK_NORMS, rope=NEOX),
        Arch(
            "gemma3",
            PLAIN | QK_NORMS | POST_NORMS,
            rope=NEOX,
            activation=GELU_TANH,
            embed_scale=True,
            query_scale=_gemma3_scale,
            window=Window("attention.sliding_window", period=6, rope_base=10000.0),
        ),
        # llama.cpp reads phi3's sliding_window and then disables it: every layer attends to all.
        Arch(
            "phi3",
            {k: v for k, v in PLAIN.items() if k not in ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up")},
            rope=NEOX,
            fused={
                "attn_qkv.weight": ("attn_q", "attn_k", "attn_v"),
                "ffn_up.weight": ("ffn_gate", "ffn_up"),
            },
            refused={"rope_factors_long.weight": _LONGROPE, "rope_factors_short.weight": _LONGROPE},
        ),
    )
}


@dataclass(frozen=True)
class LayerRope:
    """A layer's RoPE: angle_i(pos) = pos · scale · base^(-2i/hd) / factors[i] (factors None: all 1)."""

    base: float
    scale: float = 1.0
    factors: tuple[float, ...] | None = None


@dataclass(frozen=True)
class ModelParams:
    """A model's hyper-parameters as its GGUF metadata states them, read through its Arch entry.

    rope, window: one per layer (window 0: the layer attends to every position).
    query_scale: the factor on q·k; embed_scale: on the embedding rows.
    """

    arch: Arch
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    eps: float
    context_length: int
    vocab: int
    rope_base: float
    rope: tuple[LayerRope, ...]
    window: tuple[int, ...]
    query_scale: float
    embed_scale: float


class _Meta:
    """Numbers under `<arch>.` of a file, each checked to be one number (or a list of equal ones)."""

    def __init__(self, file: GGUFFile, arch: str) -> None:
        self.file, self.arch = file, arch

    def number(self, key: str, default: Any = _MISSING) -> Any:
        full = f"{self.arch}.{key}"
        value = self.file.get(full, default)
        if isinstance(value, list) and value and all(v == value[0] for v in value):
            value = value[0]  # a per-layer array holding one value throughout
        if isinstance(value, list):
            raise GGUFError(f"{self.file.path}: {full} = {value!r} varies per layer; that is not supported")
        if isinstance(value, str):
            raise GGUFError(f"{self.file.path}: {full} = {value!r} is not a number")
        return value

    def positive(self, key: str, default: Any = _MISSING) -> int:
        value = self.number(key, default)
        if value is None or int(value) <= 0:
            raise GGUFError(f"{self.file.path}: {self.arch}.{key} = {value!r} is not a positive integer")
        return int(value)


def architecture(file: GGUFFile) -> Arch:
    """The entry of the file's architecture; an error naming it and the known ones if there is none."""
    name = file.architecture
    if name not in ARCHS:
        raise GGUFError(
            f"{file.path}: architecture {name!r} is not supported; known: {', '.join(sorted(ARCHS))}"
        )
    return ARCHS[name]


def read_params(file: GGUFFile) -> ModelParams:
    """The model's hyper-parameters, its tensors' names checked against its entry."""
    arch = architecture(file)
    m = _Meta(file, arch.name)
    hidden, n_heads = m.positive("embedding_length"), m.positive("attention.head_count")
    n_kv_heads = m.positive("attention.head_count_kv", n_heads)
    if n_heads % n_kv_heads:
        raise GGUFError(f"{file.path}: head_count {n_heads} is not a multiple of head_count_kv {n_kv_heads}")
    if hidden % n_heads and f"{arch.name}.attention.key_length" not in file.fields:
        raise GGUFError(
            f"{file.path}: embedding_length {hidden} is not a multiple of head_count {n_heads} "
            "and attention.key_length is not given"
        )
    head_dim = m.positive("attention.key_length", hidden // n_heads)
    # llama.cpp's default value_length is hidden / heads, not key_length: a file giving only key_length
    # then has heads of two sizes, which no block here computes.
    if (value := m.positive("attention.value_length", hidden // n_heads)) != head_dim:
        raise GGUFError(
            f"{file.path}: attention.value_length {value} differs from attention.key_length {head_dim}"
        )
    if int(m.number("rope.dimension_count", head_dim)) != head_dim:
        raise GGUFError(f"{file.path}: partial RoPE (rope.dimension_count != head dim) is not supported")
    n_layers = m.positive("block_count")
    _check_tensors(file, arch, n_layers)
    rope_base = float(m.number("rope.freq_base", 10000.0))
    rope, window = _layers(arch, m, n_layers, LayerRope(rope_base, *_scaling(file, arch, m, head_dim)))
    vocab = m.number("vocab_size", None)
    return ModelParams(
        arch=arch,
        n_layers=n_layers,
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        ffn=m.positive("feed_forward_length"),
        eps=float(m.number("attention.layer_norm_rms_epsilon")),
        context_length=m.positive("context_length"),
        vocab=int(vocab if vocab is not None else file.entry("token_embd.weight").shape[0]),
        rope_base=rope_base,
        rope=rope,
        window=window,
        query_scale=arch.query_scale(n_layers, hidden, n_heads, head_dim),
        embed_scale=math.sqrt(hidden) if arch.embed_scale else 1.0,
    )


def _scaling(file: GGUFFile, arch: Arch, m: _Meta, head_dim: int) -> tuple[float, tuple[float, ...] | None]:
    """The file's RoPE scale (1 / the linear factor) and per-pair frequency factors (rope_freqs)."""
    kind = file.get(f"{arch.name}.rope.scaling.type", "linear")  # llama.cpp's default, as the factor alone
    if kind not in ("none", "linear"):
        raise GGUFError(f"{file.path}: RoPE scaling type {kind!r} is not supported (only none and linear)")
    factor = float(m.number("rope.scaling.factor", 0.0) or m.number("rope.scale_linear", 0.0) or 1.0)
    factors = None
    if "rope_freqs.weight" in file.tensors:
        e = file.entry("rope_freqs.weight")
        if e.shape != (head_dim // 2,):
            raise GGUFError(
                f"{file.path}: rope_freqs.weight has shape {e.shape}, expected ({head_dim // 2},)"
            )
        factors = tuple(float(f) for f in file.dequantize("rope_freqs.weight"))
    return 1.0 / factor, factors


def _layers(
    arch: Arch, m: _Meta, n_layers: int, full: LayerRope
) -> tuple[tuple[LayerRope, ...], tuple[int, ...]]:
    """Each layer's RoPE and window: the file's RoPE on full layers, the entry's on windowed ones."""
    if arch.window is None:
        return (full,) * n_layers, (0,) * n_layers
    size = m.positive(arch.window.key)
    windowed = [il % arch.window.period != arch.window.period - 1 for il in range(n_layers)]
    rope = tuple(LayerRope(arch.window.rope_base) if w else full for w in windowed)
    return rope, tuple(size if w else 0 for w in windowed)


def _check_tensors(file: GGUFFile, arch: Arch, n_layers: int) -> None:
    """Refuse a tensor the entry does not name (in a block of the model, or outside blocks)."""
    in_block = set(arch.tensors.values()) | set(arch.fused)
    outside = set(HEAD) | ({"rope_freqs.weight"} if arch.rope_freqs else set())
    for name in file.tensors:
        if name in arch.refused:
            raise GGUFError(f"{file.path}: tensor {name!r}: {arch.refused[name]}")
        match = _BLOCK.fullmatch(name)
        if (match and int(match[1]) < n_layers and match[2] in in_block) or (not match and name in outside):
            continue
        raise GGUFError(f"{file.path}: tensor {name!r} is not one a {arch.name!r} model holds")


def block_tensors(arch: Arch) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Logical name → (name inside `blk.N.`, the logical tensors its rows hold): where each is read."""
    where = {logical: (name, (logical,)) for logical, name in arch.tensors.items()}
    for name, parts in arch.fused.items():
        where |= dict.fromkeys(parts, (name, parts))
    return where
