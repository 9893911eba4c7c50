"""A float16 matrix held as the file stores it: products widen its rows as they read them."""

from __future__ import annotations

import numpy as np
import pytest

from workers.models import kernels
from workers.models.halves import FEW_MAX_ROWS, HalfMatrix
from workers.models.quants import half_bytes

EPS = np.finfo(np.float32).eps


@pytest.mark.parametrize("rows", [1, 3, FEW_MAX_ROWS, FEW_MAX_ROWS + 5])
@pytest.mark.parametrize("inp", [64, 37])  # a row of a multiple of 8 weights, and one padded to it
def test_a_float16_product_is_the_float32_product_of_its_weights_to_rounding(rows, inp):
    rng = np.random.default_rng(rows * inp)
    w16 = rng.standard_normal((70, inp)).astype(np.float16)
    w = HalfMatrix(w16)
    x = rng.standard_normal((rows, inp)).astype(np.float32)
    want = x.astype(np.float64) @ w16.astype(np.float64).T  # the widened weights are exact
    # float32 sums of inp products, in another order than float64's: inp·eps of Σ|x·w| at most
    bound = inp * EPS * (np.abs(x).astype(np.float64) @ np.abs(w16.astype(np.float64)).T)
    assert np.all(np.abs(x @ w - want) <= bound)
    assert np.array_equal(w.rows(np.array([69, 0, 5])), w16[[69, 0, 5]].astype(np.float32))
    assert np.array_equal(w.dequantize(), w16.astype(np.float32))
    assert w.nbytes == half_bytes(70, inp) <= 70 * (inp + 7) * 2  # as stored, rows padded to 8


def test_a_float16_product_does_not_depend_on_the_threads():
    rng = np.random.default_rng(0)
    w = HalfMatrix(rng.standard_normal((300, 64)).astype(np.float16))
    x = rng.standard_normal((2, 64)).astype(np.float32)
    before = kernels.threads()
    try:
        kernels.set_threads(1)
        alone = x @ w
        kernels.set_threads(2)
        assert np.array_equal(x @ w, alone)
    finally:
        kernels.set_threads(before)
