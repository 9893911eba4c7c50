"""What a stage holds, known without loading numba: the precisions, and the bytes of packed blocks.

The kernels (workers.models.kernels) regroup a matrix's blocks ROWS output
rows at a time; the coordinator sizes stages from the same arithmetic.
"""

from __future__ import annotations

# packed: keep what the file stores in blocks as blocks, the rest float32; f32: everything float32.
# No f16: upcasting whole matrices on every product made it slower than both of these.
PRECISIONS = ("packed", "f32")

ROWS = 32  # output rows computed side by side: four 8-lane AVX2 vectors
BLOCK = 32  # weights per block in every type with a kernel
# Bytes of one regrouped block: Q4_0 gains an offset (-8·d) to be computed as Q4_1.
BLOCK_BYTES = {"q4_0": 20, "q4_1": 20, "q8_0": 34}
KINDS = tuple(BLOCK_BYTES)


def check_precision(precision: str) -> None:
    """Raise a ValueError naming `precision` and the ones that exist, unless it is one of them."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not supported; accepted: {', '.join(PRECISIONS)}")


def regrouped_bytes(kind: str, out: int, inp: int) -> int:
    """Bytes a (out, in) matrix of `kind` blocks takes once regrouped (the last group padded to ROWS)."""
    return -(-out // ROWS) * ROWS * (inp // BLOCK) * BLOCK_BYTES[kind]
