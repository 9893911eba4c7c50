"""A file's blocks regrouped for the kernels: ROWS output rows side by side, four bytes of a row at a time.

For every type with a kernel (workers.models.quants), a matrix (out, in) of nb
blocks a row becomes quants (groups, nb, quads, ROWS, QUAD), where quants[g,
b, k, r] is quad k of block b of row g·ROWS + r, and scales (groups, nb,
halves, ROWS), the float16 bits of the block's d (and m or dmin). A row's
quads are the file's codes in the file's order, but for what the vector code
would otherwise unpack for every product: Q5_0's and Q5_1's fifth bits are
rearranged per quad (workers.models.quants says how), and Q4_0 gains an offset
m = -8·d (exact in float16) to be computed as Q4_1 (Q5_0 holds its d alone,
and the kernels compute its m = -16·d: workers.models.kernels_q5). The K
types' sub-block scales (Q4_K's and Q5_K's six-bit scales and mins unpacked to
a byte each, Q6_K's int8 ones) follow the codes, not as quads but a
sub-block's ROWS bytes side by side (block bytes codes + j·ROWS + r: sub-block
j of row r), so that 8 rows' scales are one load.
"""

from __future__ import annotations

import numpy as np

from workers.models.quants import QUAD, ROWS, Quant

# Bytes of the file's blocks regrouped at a time: the copies a regrouping makes on its way (two or three
# of its size) stay this small, beside the one it leaves, even for a 178 MB token table.
CHUNK_BYTES = 4 << 20


def regroup(raw: np.ndarray, q: Quant, out: int, nb: int) -> tuple[np.ndarray, np.ndarray]:
    """The file's blocks (out, nb·block bytes) as (quants, scales) in the ROWS-row layout."""
    if raw.shape != (out, nb * q.block_bytes):
        raise ValueError(f"{q.name} data of shape {raw.shape} does not hold ({out}, {nb * q.block}) weights")
    groups, step = -(-out // ROWS), max(1, CHUNK_BYTES // max(1, ROWS * raw.shape[1]))
    if groups <= step:
        quads, scales = _regroup(raw, q, nb)
    else:
        quads = np.empty((groups, nb, q.quads, ROWS, QUAD), dtype=np.uint8)
        scales = np.empty((groups, nb, q.halves, ROWS), dtype=np.uint16)
        for g0 in range(0, groups, step):
            chunk = raw[g0 * ROWS : (g0 + step) * ROWS]
            quads[g0 : g0 + step], scales[g0 : g0 + step] = _regroup(chunk, q, nb)
    return quads.view(np.int8) if q.name == "q8_0" else quads, scales


def _regroup(raw: np.ndarray, q: Quant, nb: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of the file's blocks as regroup lays them, quants as bytes; new arrays, none a view of raw."""
    out = raw.shape[0]
    blocks = raw.reshape(out, nb, q.block_bytes)
    codes, subs, halves = SPLIT[q.name](blocks)
    pad = -out % ROWS
    if pad:  # zero rows fill the last group; products drop their columns
        codes, subs, halves = (
            np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]) for a in (codes, subs, halves)
        )
    groups = (out + pad) // ROWS
    parts = [
        codes.reshape(groups, ROWS, nb, -1, QUAD).transpose(0, 2, 3, 1, 4).reshape(groups, nb, -1),
        subs.reshape(groups, ROWS, nb, -1).transpose(0, 2, 3, 1).reshape(groups, nb, -1),
    ]
    quads = np.concatenate(parts, axis=2).reshape(groups, nb, q.quads, ROWS, QUAD)
    scales = halves.view(np.uint16).reshape(groups, ROWS, nb, q.halves).transpose(0, 2, 3, 1)
    return quads, np.ascontiguousarray(scales)


def _halves(blocks: np.ndarray, start: int, count: int) -> np.ndarray:
    """float16 values at byte `start` of each block: (out, nb, count)."""
    return blocks[:, :, start : start + 2 * count].copy().view(np.float16)


def _none(blocks: np.ndarray) -> np.ndarray:
    """No sub-block scales: (out, nb, 0)."""
    return np.zeros((*blocks.shape[:2], 0), dtype=np.uint8)


def _offset(d: np.ndarray, codes: int) -> np.ndarray:
    """m = -codes·d, exact in float16 unless it overflows: refused then, rather than computed as inf."""
    with np.errstate(over="ignore"):
        m = d * np.float16(-codes)
    if not np.isfinite(m).all():
        raise ValueError(f"a block scale d of {float(np.abs(d).max())} is too large to be computed with")
    return m


def _q4_0(blocks):
    d = _halves(blocks, 0, 1)
    return blocks[:, :, 2:], _none(blocks), np.concatenate([d, _offset(d, 8)], axis=2)


def _q4_1(blocks):
    return blocks[:, :, 4:], _none(blocks), _halves(blocks, 0, 2)


def _q8_0(blocks):
    return blocks[:, :, 2:], _none(blocks), _halves(blocks, 0, 1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5's 32 fifth bits (bit j: weight j; the file's little-endian uint32) as 4 bytes per block.

    Byte t holds at bit 2k the bit of weight 4k + t (quad k's low nibbles) and at bit 2k + 1 that of
    weight 16 + 4k + t (its high nibbles): the kernel moves bit 2k or 2k + 1 to bit 4 with one shift.
    """
    bits = np.unpackbits(qh, axis=2, bitorder="little").reshape(*qh.shape[:2], 2, 4, 4)  # (.., half, k, t)
    weight = np.array([1, 2], dtype=np.uint8).reshape(2, 1, 1) << (2 * np.arange(4, dtype=np.uint8)).reshape(
        4, 1
    )
    return (bits * weight).sum(axis=(2, 3), dtype=np.uint8)  # (out, nb, 4)


def _q5_0(blocks):
    codes = np.concatenate([blocks[:, :, 6:22], _fifth_bits(blocks[:, :, 2:6])], axis=2)
    return codes, _none(blocks), _halves(blocks, 0, 1)  # d alone: its m = -16·d is computed with


def _q5_1(blocks):
    codes = np.concatenate([blocks[:, :, 8:24], _fifth_bits(blocks[:, :, 4:8])], axis=2)
    return codes, _none(blocks), _halves(blocks, 0, 2)


def _scales_and_mins(packed: np.ndarray) -> np.ndarray:
    """Q4_K's and Q5_K's 12 bytes of eight 6-bit scales and mins as 16 bytes: the scales, then the mins."""
    s = packed.astype(np.uint8)
    low, high, mixed = s[:, :, 0:4], s[:, :, 4:8], s[:, :, 8:12]
    scales = np.concatenate([low & 63, (mixed & 15) | ((low >> 6) << 4)], axis=2)
    mins = np.concatenate([high & 63, (mixed >> 4) | ((high >> 6) << 4)], axis=2)
    return np.concatenate([scales, mins], axis=2)


def _q4_k(blocks):
    return blocks[:, :, 16:144], _scales_and_mins(blocks[:, :, 4:16]), _halves(blocks, 0, 2)


def _q5_k(blocks):
    codes = np.concatenate([blocks[:, :, 48:176], blocks[:, :, 16:48]], axis=2)  # nibbles, then fifth bits
    return codes, _scales_and_mins(blocks[:, :, 4:16]), _halves(blocks, 0, 2)


def _q6_k(blocks):
    return blocks[:, :, 0:192], blocks[:, :, 192:208], _halves(blocks, 208, 1)


SPLIT = {
    "q4_0": _q4_0,
    "q4_1": _q4_1,
    "q8_0": _q8_0,
    "q5_0": _q5_0,
    "q5_1": _q5_1,
    "q4_k": _q4_k,
    "q5_k": _q5_k,
    "q6_k": _q6_k,
}
