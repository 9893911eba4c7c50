"""What a stage holds, known without loading numba: the precisions, and the bytes of packed blocks.

The kernels (workers.models.kernels) regroup a matrix's blocks ROWS output
rows at a time; the coordinator sizes stages from the same arithmetic, with
each type's entry in workers.models.quants.
"""

from __future__ import annotations

from workers.models.quants import KERNEL_TYPES, ROWS, regrouped_bytes

__all__ = ["KINDS", "PRECISIONS", "ROWS", "check_precision", "regrouped_bytes"]

# packed: keep what the file stores in blocks with a kernel as blocks, the rest float32 (other types
# dequantized once at load); f32: everything float32.
PRECISIONS = ("packed", "f32")
KINDS = KERNEL_TYPES  # the types computed on their own blocks


def check_precision(precision: str) -> None:
    """Raise a ValueError naming `precision` and the ones that exist, unless it is one of them."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not supported; accepted: {', '.join(PRECISIONS)}")
