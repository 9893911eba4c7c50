"""The few-row float32 kernels of batched decode steps: the product BLAS gives, in one fixed order."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from workers.models import dense, kernels


@pytest.fixture
def rng():
    return np.random.default_rng(7)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("order", ["C", "F"])
def test_few_rows_gives_the_blas_product_for_either_layout_and_ragged_sizes(rng, rows, order):
    w = np.asarray(rng.standard_normal((577, 3 * dense.TILE + 5), dtype=np.float32), order=order)
    x = rng.standard_normal((rows, 577), dtype=np.float32)
    got = dense.few_rows(x, w)
    assert got.shape == (rows, w.shape[1]) and got.dtype == np.float32
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.astype(np.float64), rtol=1e-4, atol=1e-4)


def test_few_rows_sums_in_the_same_order_whatever_the_thread_count(rng):
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.fail("numba started a single thread; this test needs two (NUMBA_NUM_THREADS)")
    w = rng.standard_normal((640, 4 * dense.TILE + 3), dtype=np.float32)
    x = rng.standard_normal((3, 640), dtype=np.float32)
    before = kernels.threads()
    try:
        kernels.set_threads(1)
        one = [dense.few_rows(x, w), dense.few_rows(x, np.asfortranarray(w))]
        kernels.set_threads(2)
        two = [dense.few_rows(x, w), dense.few_rows(x, np.asfortranarray(w))]
    finally:
        kernels.set_threads(before)
    for a, b in zip(one, two, strict=True):
        assert np.array_equal(a, b)


def test_product_takes_a_few_rows_to_the_kernels_and_everything_else_to_numpy(rng):
    w = rng.standard_normal((64, 48), dtype=np.float32)
    for rows in (1, 2, dense.FEW_MAX_ROWS, dense.FEW_MAX_ROWS + 1, 16):
        x = rng.standard_normal((rows, 64), dtype=np.float32)
        expected = dense.few_rows(x, w) if 2 <= rows <= dense.FEW_MAX_ROWS else x @ w
        assert np.array_equal(dense.product(x, w), expected)
