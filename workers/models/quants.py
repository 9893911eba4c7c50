"""The GGUF tensor types the house reads: one entry per type, as llama.cpp's `type_traits[]`.

An entry says how a type's blocks are stored (weights and bytes per block),
how a stage holds them and what it computes with:

- `kernel`: kept in its blocks, regrouped ROWS output rows side by side
  (workers.models.kernels); products run on the blocks with the input rows
  rounded to 8 bits as llama.cpp rounds them for the type (`activation`, its
  `vec_dot_type`: Q8_0, Q8_1, or Q8_K's blocks of 256 with sums per 16), and the
  compiled decode path (workers.models.decode) computes on them too; a row's
  few values far above its RMS are taken out before it is rounded and added
  back times their exact weight column (`spilled`, workers.models.outliers);
- `half`: F16, held as stored; its products widen each weight row to float32
  as they read it (workers.models.halves), with no float32 copy of the matrix,
  and take the rows as they are: no rounding of the rows, nothing to spill;
- `float`: F32, and BF16 (numpy has no bfloat16), held as float32 (BF16 upcast
  once at load, exactly);
- `dequantized`: every other type (Q2_K, Q3_K, IQ*, TQ*, MXFP4...), dequantized
  once at load to float32, and named so in the stage's precision string.

A type id the table does not hold is refused at load, naming the tensor.
Numba-free: the coordinator sizes stages from this table.
"""

from __future__ import annotations

from dataclasses import dataclass

ROWS = 32  # output rows a kernel computes side by side: four 8-lane AVX2 vectors
QUAD = 4  # bytes of one row side by side in the regrouped layout, as vpmaddubsw pairs them


@dataclass(frozen=True)
class Quant:
    """One GGUF tensor type.

    name: as the house writes it (lower case, "q4_k").
    type_id: the GGML type number a GGUF file stores.
    block: weights per block; block_bytes: bytes per block as stored.
    use: "kernel", "half", "float" or "dequantized" (see the module's docstring).
    quads: bytes per row and block in the regrouped layout, as QUAD-byte quads (kernel types):
        the quants, then for the K types their sub-block scales unpacked to a byte each.
    halves: float16 scales per row and block beside them (d; d and m or dmin).
    activation: the rounding of the input rows the kernel pairs with: "q8_0", "q8_1" or "q8_k".
    sub_block: weights per sub-block scale (K types), 0 for none.
    dots: the compiled rows kernel products.rows runs for it (module.function), "" for none.
    dequantizer: what turns its blocks into float32: for a kernel type the regrouped layout's
        (prefill tiles, embedding rows), for the others gguf-py's, once at load.
    spilled: what adds a row's values spilled before its rounding (workers.models.outliers) times
        their weight columns, read from this type's regrouped blocks as its dequantizer computes
        them (module.function). Every kernel type needs one (an entry without it is refused); ""
        for the others, whose products take float32 rows unrounded (F16, F32, the dequantized).
    """

    name: str
    type_id: int
    block: int
    block_bytes: int
    use: str
    quads: int = 0
    halves: int = 0
    activation: str = ""
    sub_block: int = 0
    dots: str = ""
    dequantizer: str = "gguf.quants.dequantize"
    spilled: str = ""

    def __post_init__(self) -> None:
        if self.kernel and not (self.dots and self.spilled):
            raise ValueError(f"kernel type {self.name} must name its rows kernel and its spilled values' add")
        if not self.kernel and self.spilled:
            raise ValueError(
                f"{self.name} is not computed on its blocks: its rows are not rounded, none spill"
            )

    @property
    def held_bytes(self) -> int:
        """Bytes one block of one row takes as a stage holds it."""
        if self.use == "kernel":
            return self.quads * QUAD + self.halves * 2
        return self.block * (2 if self.use == "half" else 4)

    @property
    def kernel(self) -> bool:
        """Whether products run on its blocks, and so the compiled decode path, without a float copy."""
        return self.use == "kernel"


def _k(name: str, type_id: int, bytes_: int) -> Quant:
    return Quant(name, type_id, 256, bytes_, "dequantized")


# Per kernel type, the regrouped quads (a row's bytes of one block):
#   q4_0, q4_1: 4 quads of nibbles (16 bytes), scales d and m (Q4_0's m is -8·d, exact in float16)
#   q5_0, q5_1: those, then 1 quad of fifth bits (byte t holds, at bit 2k, the bit of weight 4k+t and,
#               at bit 2k+1, that of weight 16+4k+t); scales d and m (Q5_0: d alone, its m = -16·d
#               computed by the kernels, exactly: 2 bytes a block less than held)
#   q8_0:       8 quads of int8; scale d
#   q4_k:       32 quads of nibbles as stored, then the 8 six-bit scales and the 8 mins a byte each
#   q5_k:       those nibbles, 8 quads of fifth bits as stored, the 16 bytes of scales and mins
#   q6_k:       32 quads of low nibbles, 16 of high bit pairs (both as stored), the 16 int8 scales
#   (a K type's scale bytes lie a sub-block's ROWS rows side by side: workers.models.regroup); d, dmin
_Q4 = {
    "dots": "kernels_q8.q4_rows",
    "dequantizer": "kernels.dequantize_groups",
    "spilled": "outliers.add_spilled_q4",
}
_Q5 = {
    "dots": "kernels_q5.q5_rows",
    "dequantizer": "unpack.dequantize_groups",
    "spilled": "outliers.add_spilled_q5",
}
_Q8 = {
    "dots": "kernels_q8.q8_rows",
    "dequantizer": "kernels.dequantize_groups",
    "spilled": "outliers.add_spilled_q8",
}
_K = {
    "dots": "kernels_k.k_rows",
    "dequantizer": "unpack.dequantize_groups",
    "spilled": "outliers.add_spilled_k",
}
TYPES: tuple[Quant, ...] = (
    Quant("f32", 0, 1, 4, "float"),
    Quant("f16", 1, 1, 2, "half"),
    Quant("q4_0", 2, 32, 18, "kernel", quads=4, halves=2, activation="q8_0", **_Q4),
    Quant("q4_1", 3, 32, 20, "kernel", quads=4, halves=2, activation="q8_1", **_Q4),
    Quant("q5_0", 6, 32, 22, "kernel", quads=5, halves=1, activation="q8_0", **_Q5),
    Quant("q5_1", 7, 32, 24, "kernel", quads=5, halves=2, activation="q8_1", **_Q5),
    Quant("q8_0", 8, 32, 34, "kernel", quads=8, halves=1, activation="q8_0", **_Q8),
    _k("q2_k", 10, 84),
    _k("q3_k", 11, 110),
    Quant("q4_k", 12, 256, 144, "kernel", quads=36, halves=2, activation="q8_k", sub_block=32, **_K),
    Quant("q5_k", 13, 256, 176, "kernel", quads=44, halves=2, activation="q8_k", sub_block=32, **_K),
    Quant("q6_k", 14, 256, 210, "kernel", quads=52, halves=1, activation="q8_k", sub_block=16, **_K),
    _k("iq2_xxs", 16, 66),
    _k("iq2_xs", 17, 74),
    _k("iq3_xxs", 18, 98),
    _k("iq1_s", 19, 50),
    Quant("iq4_nl", 20, 32, 18, "dequantized"),
    _k("iq3_s", 21, 110),
    _k("iq2_s", 22, 82),
    _k("iq4_xs", 23, 136),
    _k("iq1_m", 29, 56),
    Quant("bf16", 30, 1, 2, "float"),
    _k("tq1_0", 34, 54),
    _k("tq2_0", 35, 66),
    Quant("mxfp4", 39, 32, 17, "dequantized"),
)
# Q8_0 and Q8_1 round a row alike (codes round(x·127/max|x|) per 32); Q8_1 adds each block's sum, which
# Q4_0 and Q5_0 use too here, computed as Q4_1 and Q5_1 with their offset m = -8·d, -16·d.
BY_NAME = {q.name: q for q in TYPES}
BY_ID = {q.type_id: q for q in TYPES}
KERNEL_TYPES = tuple(q.name for q in TYPES if q.kernel)


class UnknownType(ValueError):
    """A tensor type id the table does not hold."""


def by_id(type_id: int, tensor: str = "") -> Quant:
    """The entry of GGML type `type_id`; an UnknownType naming the tensor and the id if there is none."""
    try:
        return BY_ID[type_id]
    except KeyError:
        where = f"tensor {tensor!r} has" if tensor else "a tensor has"
        known = ", ".join(f"{q.name} ({q.type_id})" for q in TYPES)
        raise UnknownType(f"{where} type id {type_id}, which is not supported; known: {known}") from None


def by_name(name: str) -> Quant:
    """The entry named `name`; a ValueError listing the kernel types if there is none."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(f"tensor type {name!r} is unknown; kernels: {', '.join(KERNEL_TYPES)}") from None


def regrouped_bytes(name: str, out: int, inp: int) -> int:
    """Bytes a (out, in) matrix of kernel type `name` takes regrouped (the last group padded to ROWS)."""
    q = by_name(name)
    return -(-out // ROWS) * ROWS * (inp // q.block) * q.held_bytes


HALF_WIDTH = 8  # a float16 matrix's rows are held padded to a multiple of this many weights


def held_name(q: Quant) -> str:
    """A held matrix's part of a stage's precision string: its type, or f32(type) if dequantized at load.

    F16 is held as stored: "f16"; BF16 is upcast as the dequantized types are: "f32(bf16)".
    """
    if q.use in ("kernel", "half") or q.name == "f32":
        return q.name
    return f"f32({q.name})"


def half_bytes(out: int, inp: int) -> int:
    """Bytes a (out, in) float16 matrix is held in (workers.models.halves)."""
    return out * -(-inp // HALF_WIDTH) * HALF_WIDTH * 2
