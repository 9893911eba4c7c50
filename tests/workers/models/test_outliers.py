"""The values a row spills before it is rounded to 8 bits: which, how many, and what is left."""

from __future__ import annotations

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from workers.models.outliers import SPILL_MAX, SPILL_RATIO, spill


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
