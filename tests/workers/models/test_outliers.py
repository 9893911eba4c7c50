"""The values a row spills before it is rounded to 8 bits: which, how many, what is left, their products."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tests.support.kquants import random_blocks, rounded_rows
from workers.models import kernels, kernels_k, kernels_q8, products
from workers.models.outliers import MEMO, SPILL_MAX, SPILL_RATIO, spill
from workers.models.quants import BY_NAME, KERNEL_TYPES

T = gguf.GGMLQuantizationType
KERNELS = [T[name.upper()] for name in KERNEL_TYPES]
WIDTH = 768  # 24 blocks of 32, 3 of 256: SmolLM2's rows are 576 and 1536 wide
EPS = np.finfo(np.float32).eps
# As test_quants' bound: besides the exact integer sums, a few float32 roundings per block (the
# scales' products, the sums into the output), each relative to the sizes summed; a spilled value's
# product with its weight column and its sum into the output are two more, relative to |v·w|.
ROUNDINGS = 8
FAR = {(0, 40): 3000.0, (1, 5): -2000.0, (1, 300): 2500.0, (1, 301): 1800.0}  # row 2 has none


@settings(max_examples=50, deadline=None)
@given(
    rows=st.integers(1, 4),
    width=st.sampled_from([160, 576, 1536]),
    n_far=st.integers(0, 2 * SPILL_MAX),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_row_spills_its_largest_values_above_the_ratio_times_its_rms_and_no_more_than_the_most(
    rows, width, n_far, seed
):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, width), dtype=np.float32)
    for m in range(rows):  # values far above the rest, some of them perhaps not far enough
        at = rng.choice(width, n_far, replace=False)
        x[m, at] = rng.choice([-1, 1], n_far) * 10.0 ** rng.uniform(0.5, 3, n_far)
    rest, cols, vals = spill(x)
    assert cols.shape == vals.shape == (rows, SPILL_MAX) and cols.dtype == np.int32
    for m in range(rows):
        limit = SPILL_RATIO * np.sqrt(np.mean(x[m].astype(np.float64) ** 2))
        assume(np.all(np.abs(np.abs(x[m]) / limit - 1) > 1e-5))  # float32's sum may round either way
        above = np.flatnonzero(np.abs(x[m]) > limit)
        n = min(len(above), SPILL_MAX)
        assert np.count_nonzero(vals[m]) == n and not vals[m, n:].any() and not cols[m, n:].any()
        taken = cols[m, :n]
        assert np.array_equal(vals[m, :n], x[m, taken])  # each value as it was, at its column
        magnitudes = np.abs(vals[m, :n])
        assert np.all(magnitudes[:-1] >= magnitudes[1:])  # the largest first
        left = np.setdiff1d(above, taken)
        assert np.all(np.abs(x[m, left]) <= magnitudes.min(initial=np.inf))  # no larger one left behind
        assert np.all(rest[m, taken] == 0)
        kept = np.setdiff1d(np.arange(width), taken)
        assert np.array_equal(rest[m, kept], x[m, kept])


def test_a_row_of_fewer_values_than_the_ratio_squared_never_spills():
    """One value of n can be at most √n times the row's RMS: below SPILL_RATIO² values, none spills."""
    width = int(SPILL_RATIO) ** 2 - 16  # whole blocks of 32, just below the ratio squared
    x = np.zeros((2, width), dtype=np.float32)
    x[0, 3] = 1e3  # a row that is all one value
    x[1] = 1.0
    rest, cols, vals = spill(x)
    assert not vals.any() and not cols.any() and np.array_equal(rest, x)


def matrix(qtype: T, seed: int) -> tuple[kernels.PackedMatrix, np.ndarray]:
    """3·32 + 5 rows (a partial last group) of random valid blocks of `qtype`, packed; gguf-py's weights."""
    raw = random_blocks(qtype, 3 * 32 + 5, WIDTH // BY_NAME[qtype.name.lower()].block, seed)
    w = gguf.quants.dequantize(raw, qtype).astype(np.float64)  # (out, in)
    return kernels.PackedMatrix(raw, qtype.name.lower(), w.shape), w


@pytest.mark.parametrize("qtype", KERNELS, ids=lambda q: q.name)
def test_every_kernel_type_multiplies_a_value_far_above_its_row_exactly_not_rounded_with_its_block(qtype):
    """Rounded with its block, a value 2000 × the others would make that block's step 2000/127.

    For the K types' Q8_K rows one step serves 256 values, so one large value coarsens 255 others.
    Taken out, it is multiplied by its exact weight column, read from the type's own blocks.
    """
    packed, w = matrix(qtype, seed=3)
    x = np.random.default_rng(4).standard_normal((3, WIDTH), dtype=np.float32)
    rest = x.copy()
    for at, value in FAR.items():
        x[at], rest[at] = value, 0
    assert [np.count_nonzero(v) for v in spill(x)[2]] == [1, 3, 0]  # each far value is above the ratio
    xr = rounded_rows(rest, qtype)  # the rest of each row, rounded as the type's kernel rounds it
    want = xr @ w.T
    scale = np.abs(xr) @ np.abs(w).T
    for (row, col), value in FAR.items():
        want[row] += value * w[:, col]
        scale[row] += np.abs(value * w[:, col])
    bound = ROUNDINGS * EPS * (WIDTH // 32 + 4) * scale + 1e-30
    one = x @ packed
    before = kernels.threads()
    try:
        kernels.set_threads(2)
        split = products.product(x, packed.blocks, 2, chunk_bytes=1)[:, : w.shape[0]]
    finally:
        kernels.set_threads(before)
    for got in (one, split):
        assert np.all(np.abs(got - want) <= bound), qtype.name
    # each row alone as beside the others: the spilled values of one row never reach another
    assert np.array_equal((x[[2]] @ packed)[0], one[2]) and np.array_equal((x[[1, 0]] @ packed)[0], one[1])


@pytest.mark.parametrize("qtype", KERNELS, ids=lambda q: q.name)
def test_rows_without_outliers_give_bitwise_what_they_gave_before_spilling_for_every_kernel_type(qtype):
    """A row with no value above the ratio is rounded and multiplied exactly as before: nothing added."""
    packed, w = matrix(qtype, seed=5)
    x = np.random.default_rng(6).standard_normal((5, WIDTH), dtype=np.float32)
    assert not spill(x)[2].any()  # normal rows: 12 RMS is far beyond their largest value
    empty = (np.zeros((5, SPILL_MAX), np.int32), np.zeros((5, SPILL_MAX), np.float32))
    unspilled = (5, *kernels_q8.quantize(x), *kernels_k.quantize_k(x), *empty)  # rounded as they were
    want = products.multiply(unspilled, packed.blocks, 1, 1 << 20)[:, : w.shape[0]]
    assert np.array_equal(x @ packed, want)


@pytest.mark.parametrize("qtype", KERNELS, ids=lambda q: q.name)
def test_a_column_many_rows_spill_in_is_gathered_once_and_each_row_gets_what_it_gets_alone(qtype):
    """A prompt's rows spill in the same few channels: a group keeps each column it gathered (MEMO) for
    the next rows, and columns that share its place in the memo (MEMO apart) replace each other."""
    packed, w = matrix(qtype, seed=9)
    x = np.random.default_rng(10).standard_normal((11, WIDTH), dtype=np.float32)
    for row in range(11):  # every row in column 40; some in 40 + MEMO, 40 + 2·MEMO, which take its slot
        x[row, 40] = 3000.0 + row
        if row % 3 == 1:
            x[row, 40 + MEMO] = -2000.0
        if row % 4 == 2:
            x[row, 40 + 2 * MEMO] = 2500.0
    assert all(spill(x)[2][:, 0] != 0)
    both = x @ packed
    for row in range(11):
        assert np.array_equal((x[[row]] @ packed)[0], both[row]), (qtype.name, row)
    rest, cols, vals = spill(x)
    xr = rounded_rows(rest, qtype)
    want, scale = xr @ w.T, np.abs(xr) @ np.abs(w).T
    for (row, s), value in np.ndenumerate(vals):
        want[row] += value * w[:, cols[row, s]]  # a slot unused (0) adds nothing
        scale[row] += np.abs(value * w[:, cols[row, s]])
    assert np.all(np.abs(both - want) <= ROUNDINGS * EPS * (WIDTH // 32 + 4) * scale + 1e-30)
