"""Every type with a kernel computed on its own blocks, against gguf-py's dequantized weights."""

from __future__ import annotations

import importlib

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.kquants import HALVES, random_blocks, rounded_rows
from workers.models import kernels, kernels_k, products
from workers.models.kernels import KERNEL_MAX_ROWS
from workers.models.quants import (
    BY_ID,
    BY_NAME,
    KERNEL_TYPES,
    TYPES,
    Quant,
    UnknownType,
    by_id,
    regrouped_bytes,
)

T = gguf.GGMLQuantizationType
KERNELS = [T[name.upper()] for name in KERNEL_TYPES]
EPS = np.finfo(np.float32).eps
# Besides the exact integer sums, a block's product takes a few float32 roundings (its scales' products,
# the sum into the output), and gguf-py's dequantized weights a few more ((d·sc)·u - dmin·m): each
# relative to the sizes summed, so the bound is a few eps per block times Σ|x̃·w|.
ROUNDINGS = 8


def matrix(
    qtype: T, out: int, n_blocks: int, seed: int
) -> tuple[np.ndarray, kernels.PackedMatrix, np.ndarray]:
    """Random valid blocks, the PackedMatrix of them and gguf-py's float32 weights (out, in)."""
    raw = random_blocks(qtype, out, n_blocks, seed)
    weights = gguf.quants.dequantize(raw, qtype).astype(np.float32)
    return raw, kernels.PackedMatrix(raw, BY_ID[qtype].name, weights.shape), weights


@settings(max_examples=40, deadline=None)
@given(
    qtype=st.sampled_from(KERNELS),
    out=st.sampled_from([1, 31, 33, 70]),  # partial row groups of ROWS = 32
    n_blocks=st.integers(1, 3),
    rows=st.integers(1, 8),
    seed=st.integers(0, 2**32 - 1),
)
def test_every_kernel_is_the_dequantized_weights_times_the_rows_rounded_as_llama_cpp_rounds_them(
    qtype, out, n_blocks, rows, seed
):
    _, packed, w = matrix(qtype, out, n_blocks, seed)
    x = np.random.default_rng(seed + 1).standard_normal((rows, w.shape[1]), dtype=np.float32)
    x[0, : BY_ID[qtype].block] = 0  # a block of zeros has no scale to divide by
    got = x @ packed
    xr = rounded_rows(x, qtype)
    bound = ROUNDINGS * EPS * (n_blocks + 4) * (np.abs(xr) @ np.abs(w.astype(np.float64)).T)
    assert got.shape == (rows, out)
    assert np.all(np.abs(got - xr @ w.astype(np.float64).T) <= bound + 1e-30)


def largest_codes(qtype: T, n_blocks: int) -> np.ndarray:
    """Blocks of every code byte 0xFF (the largest codes, scales and bits), d = 1 and m, dmin = 0."""
    raw = np.full((3, n_blocks, gguf.GGML_QUANT_SIZES[qtype][1]), 0xFF, dtype=np.uint8)
    for i, at in enumerate(HALVES[qtype]):
        raw[:, :, at : at + 2] = np.array([1.0 if i == 0 else 0.0], np.float16).view(np.uint8)
    return raw.reshape(3, -1)


@pytest.mark.parametrize("qtype", KERNELS, ids=lambda q: q.name)
@pytest.mark.parametrize("sign", [1, -1])
def test_the_integer_sums_are_exact_at_the_largest_codes_of_every_type(qtype, sign):
    """The int16 sums of the vector code hold the largest codes times ±127: no wrap, no saturation."""
    raw = largest_codes(qtype, 2)
    w = gguf.quants.dequantize(raw, qtype).astype(np.float64)
    packed = kernels.PackedMatrix(raw, BY_ID[qtype].name, w.shape)
    x = np.full((5, w.shape[1]), 127.0 * sign, dtype=np.float32)  # rounds to codes ±127 (scale ±1)
    exact = x.astype(np.float64) @ w.T  # integers, which the float32 arithmetic rounds a few times
    assert np.all(np.abs(x @ packed - exact) <= 4 * EPS * np.abs(exact))


@pytest.mark.parametrize("qtype", KERNELS, ids=lambda q: q.name)
def test_every_type_dequantizes_and_looks_up_rows_as_gguf_py_does(qtype):
    raw, packed, w = matrix(qtype, 70, 2, seed=3)
    assert np.array_equal(packed.dequantize(), w)
    ids = np.array([69, 0, 33, 33, 5])
    assert np.array_equal(packed.rows(ids), w[ids])
    assert packed.nbytes == regrouped_bytes(BY_ID[qtype].name, *w.shape)
    # the layout holds about the file's bytes (70 rows padded to 96): Q4_0 and Q5_0 gain an offset of 2
    # bytes a block (20 of 18 bytes), Q4_K and Q5_K 4 bytes for their unpacked scales (148 of 144)
    assert packed.nbytes <= 1.12 * raw.nbytes * 96 / 70


@pytest.mark.parametrize("qtype", KERNELS, ids=lambda q: q.name)
def test_a_prefill_product_of_every_type_is_the_dequantized_float32_product_within_rounding(qtype):
    _, packed, w = matrix(qtype, 40, 2, seed=5)
    x = np.random.default_rng(6).standard_normal((KERNEL_MAX_ROWS + 3, w.shape[1]), dtype=np.float32)
    w64 = w.astype(np.float64)
    bound = 4 * EPS * w.shape[1] * (np.abs(x).astype(np.float64) @ np.abs(w64).T)
    assert np.all(np.abs(x @ packed - x.astype(np.float64) @ w64.T) <= bound + 1e-30)


def test_the_rows_are_rounded_once_per_kind_a_set_of_matrices_needs():
    q4k, q8 = kernels.tiny("q4_k"), kernels.tiny("q8_0")
    assert products.needs((q4k.blocks,)) == products.BY_256
    assert products.needs((q8.blocks, q8.blocks)) == products.BY_32
    assert products.needs((q4k.blocks, q8.blocks)) == products.BY_32 | products.BY_256
    x = np.random.default_rng(0).standard_normal((2, 512), dtype=np.float32)
    n, xq, _, _, kq, kd, sums, _, _ = products.activations(x, products.BY_256)  # and the spilled values
    assert n == 2 and xq.size == 0 and kq.shape == (2, 512) and kd.shape == (2, 2) and sums.shape == (2, 32)
    assert np.array_equal(sums, kq.reshape(2, 32, 16).sum(axis=2))


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 4), n_blocks=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_q8_k_rounds_each_block_of_256_as_llama_cpp_does(rows, n_blocks, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, 256 * n_blocks)) * 10.0 ** rng.integers(-4, 4)).astype(np.float32)
    codes, dx, _ = kernels_k.quantize_k(x)
    for m in range(rows):
        for b in range(n_blocks):
            block = x[m, 256 * b : 256 * (b + 1)]
            top = block[np.argmax(np.abs(block))]  # the first of largest magnitude, as llama.cpp's loop
            iscale = np.float32(-127) / top
            want = np.minimum(127, np.rint(iscale * block)).astype(np.int8)
            assert np.array_equal(codes[m, 256 * b : 256 * (b + 1)], want)
            assert dx[m, b] == np.float32(1) / iscale


def test_every_type_id_is_one_entry_and_an_unknown_one_is_refused_naming_it():
    assert len(BY_ID) == len(TYPES) and len({q.name for q in TYPES}) == len(TYPES)
    for q in TYPES:  # the table agrees with gguf-py's sizes
        assert gguf.GGML_QUANT_SIZES[T(q.type_id)] == (q.block, q.block_bytes), q.name
    assert by_id(14).name == "q6_k" and BY_NAME["q4_k"].activation == "q8_k"
    for q in TYPES:  # each entry names the code that computes on it and turns it into floats
        for named in filter(None, (q.dots, q.dequantizer, q.spilled)):
            module, _, function = named.rpartition(".")
            package = "" if module.startswith("gguf") else "workers.models."
            assert callable(getattr(importlib.import_module(package + module), function)), named
    assert all(bool(q.dots) == bool(q.spilled) == q.kernel for q in TYPES)
    with pytest.raises(UnknownType, match=r"tensor 'blk\.0\.attn_q\.weight' has type id 15, which is not"):
        by_id(15, "blk.0.attn_q.weight")  # Q8_K: an activation type, not a weight type


def test_an_entry_with_a_kernel_but_no_add_for_its_spilled_values_is_refused():
    """A row's outliers are zero in the rounded row: a kernel that did not add them back would drop them."""
    with pytest.raises(
        ValueError, match="kernel type q9_0 must name its rows kernel and its spilled values' add"
    ):
        Quant("q9_0", 99, 32, 34, "kernel", quads=8, halves=1, activation="q8_0", dots="kernels_q8.q8_rows")
    with pytest.raises(ValueError, match="f16 is not computed on its blocks: its rows are not rounded"):
        Quant("f16", 1, 1, 2, "half", spilled="outliers.add_spilled_q8")


def test_a_matrix_of_a_k_type_needs_whole_blocks_of_256():
    with pytest.raises(ValueError, match="a q4_k matrix's rows must hold whole blocks of 256, got 288"):
        kernels.PackedMatrix(np.zeros((4, 162), np.uint8), "q4_k", (4, 288))


@pytest.mark.parametrize(("qtype", "d"), [(T.Q4_0, 8192.0)])
def test_a_scale_whose_offset_overflows_float16_is_refused(qtype, d):
    """Q4_0 is computed with an offset m = -8·d, kept in float16 beside d."""
    raw = random_blocks(qtype, 4, 1, seed=0)
    raw[1, 0:2] = np.array([d], np.float16).view(np.uint8)
    with pytest.raises(ValueError, match=f"a block scale d of {d} is too large to be computed with"):
        kernels.PackedMatrix(raw, BY_ID[qtype].name, (4, 32))


def test_q5_0_is_held_as_d_alone_and_computes_its_offset_exactly_even_past_float16():
    """Q5_0's m = -16·d is computed in float32 by the kernels, not held: 22 bytes a block and row, as
    the file's; a d of 4096, whose m would overflow float16, is computed with (it was refused when m
    was held in float16)."""
    raw = random_blocks(T.Q5_0, 40, 3, seed=3)
    raw.reshape(40, 3, 22)[1, 2, 0:2] = np.array([4096.0], np.float16).view(np.uint8)
    w = gguf.quants.dequantize(raw, T.Q5_0).astype(np.float32)
    packed = kernels.PackedMatrix(raw, "q5_0", w.shape)
    _, quants, scales = packed.blocks
    assert scales.shape == (2, 3, 1, 32)  # groups, blocks, d alone, ROWS
    assert quants.nbytes + scales.nbytes == regrouped_bytes("q5_0", 40, 96) == 64 * 3 * 22
    np.testing.assert_array_equal(packed.dequantize(), w)
    x = np.random.default_rng(4).standard_normal((3, 96), dtype=np.float32)
    xr = rounded_rows(x, T.Q5_0)
    bound = ROUNDINGS * EPS * 7 * (np.abs(xr) @ np.abs(w.astype(np.float64)).T)
    assert np.all(np.abs(x @ packed - xr @ w.astype(np.float64).T) <= bound)


@pytest.mark.parametrize("qtype", KERNELS, ids=lambda q: q.name)
def test_a_row_of_any_type_s_product_does_not_depend_on_the_other_rows_or_the_threads(qtype):
    _, packed, w = matrix(qtype, 3 * 32, 2, seed=7)
    x = np.random.default_rng(8).standard_normal((9, w.shape[1]), dtype=np.float32)
    batch = x @ packed
    for i in range(1, len(x)):  # the same row beside another, first or later in the batch
        assert np.array_equal((x[[i, 0]] @ packed)[0], batch[i])
    before = kernels.threads()
    try:
        kernels.set_threads(2)
        split = products.product(x, packed.blocks, 2, chunk_bytes=1)  # split however small
    finally:
        kernels.set_threads(before)
    assert np.array_equal(split[:, : w.shape[0]], batch)


@pytest.mark.parametrize("need", [products.BY_32, products.BY_256, products.BY_32 | products.BY_256])
def test_rows_rounded_in_chunks_on_several_threads_are_bitwise_the_rows_rounded_at_once(need):
    x = np.random.default_rng(12).standard_normal((21, 512), dtype=np.float32)
    x[3, 17], x[8, 300], x[8, 301] = 500.0, -400.0, 300.0  # values that spill
    x[5, :256] = 0  # a block of zeros
    whole = products.activations(x, need)
    for chunks in (2, 3):
        split = products.activations_parallel(x, need, chunks)
        assert split[0] == whole[0]
        for got, want in zip(split[1:], whole[1:], strict=True):
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got, want)
    assert products.rounded(x, need, 2)[7].shape == whole[7].shape
