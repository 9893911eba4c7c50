"""A file's types at load: kept in their blocks where a kernel computes on them, else dequantized once."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from tests.support.tiny_gguf import TinyLlama, write_tiny_llama
from workers import models
from workers.models import products
from workers.models.footprint import footprint
from workers.models.gguf_file import GGUFError, open_gguf
from workers.models.kernels import PackedMatrix
from workers.protocol.report import LayerRange, decode_report, encode_report
from workers.server import WorkerServer

T = gguf.GGMLQuantizationType
# Rows of 256 (the K types' blocks); two layers, a head of its own.
TINY_K = TinyLlama(n_layers=2, hidden=256, n_heads=4, n_kv_heads=2, ffn=512, vocab=64)
# As llama.cpp's Q4_K_M mixes them: Q6_K for attn_v and ffn_down, Q4_K for the other block matrices.
Q4_K_M = {".attn_v.": T.Q6_K, ".ffn_down.": T.Q6_K, "blk.": T.Q4_K, "output.weight": T.Q6_K}
# Types without a kernel beside ones with: dequantized once at load, each named in the precision.
NO_KERNEL = {
    ".ffn_down.": T.Q3_K,
    ".ffn_up.": T.Q2_K,
    ".attn_k.": T.IQ4_NL,
    "blk.": T.Q5_K,
    "token_embd": T.F16,
}


def ids(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.int32)


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory):
    path = tmp_path_factory.mktemp("k") / "q4_k_m.gguf"
    return path, write_tiny_llama(path, TINY_K, types=Q4_K_M)


@pytest.fixture(scope="module")
def no_kernel(tmp_path_factory):
    path = tmp_path_factory.mktemp("k") / "no_kernel.gguf"
    return path, write_tiny_llama(path, TINY_K, types=NO_KERNEL)


def test_a_q4_k_m_stage_keeps_its_blocks_and_computes_on_them_in_the_compiled_path(q4_k_m):
    path, weights = q4_k_m
    stage = models.build(str(path), LayerRange(0, 2), "packed")
    assert stage.precision == "q4_k+q6_k" and stage.compiled
    assert stage.n_packed == sum(
        w.size for n, w in weights.items() if w.ndim == 2 and n != "token_embd.weight"
    )
    assert isinstance(stage.blocks[0].attn_v, PackedMatrix) and stage.blocks[0].attn_v.kind == "q6_k"
    # it holds what the file's tensors weigh, the regrouped layout but a few bytes a block more
    file = open_gguf(path)
    held = footprint(str(path), "packed").stage_bytes(LayerRange(0, 2))
    stored = sum(e.n_bytes for e in file.tensors.values() if e.name != "token_embd.weight")
    embedding = weights["token_embd.weight"].size * 4  # float32 in the file
    assert held - embedding <= 1.03 * stored


def test_the_compiled_path_on_mixed_q4_k_and_q6_k_blocks_equals_the_per_product_path(q4_k_m):
    """The same products (exact integer sums); norms and attention differ in float rounding only.

    A rounding to 8 bits may then land a code on the other side in a few places: ~1e-3 of the logits.
    """
    path, _ = q4_k_m
    compiled = models.build(str(path), LayerRange(0, 2), "packed")
    per_product = models.build(str(path), LayerRange(0, 2), "packed")
    per_product._compiled_blocks = None  # the blocks then run product by product (llama.block)
    assert compiled.compiled and not per_product.compiled
    tokens = [3, 17, 5, 39, 0, 22, 9]
    for start, end in [(0, 5), (5, 6), (6, 7)]:
        want = per_product.forward(ids(tokens[start:end]), session="p", start_pos=start, last_only=False)
        got = compiled.forward(ids(tokens[start:end]), session="c", start_pos=start, last_only=False)
        assert np.abs(got - want).max() <= 5e-3 * np.abs(want).max(), f"positions {start}..{end}"


def test_rows_rounded_once_for_a_mixed_set_of_matrices_give_each_matrix_its_own_product(q4_k_m):
    # As the compiled path multiplies a block's q, k and v (or gate and up): the rows rounded once for
    # each kind the set needs, then each product: bitwise each matrix's product alone.
    path, _ = q4_k_m
    w = models.build(str(path), LayerRange(0, 1), "packed").blocks[0]
    x = np.random.default_rng(0).standard_normal((3, TINY_K.hidden), dtype=np.float32)
    mixed = (w.attn_q.blocks, w.attn_k.blocks, w.attn_v.blocks)  # Q4_K, Q4_K, Q6_K
    a = products.activations(x, products.needs(mixed))
    for matrix, blocks in zip((w.attn_q, w.attn_k, w.attn_v), mixed, strict=True):
        got = products.multiply(a, blocks, 1, 1 << 20)[:, : matrix.shape[0]]
        assert np.array_equal(got, x @ matrix), matrix.kind


def test_types_without_a_kernel_are_dequantized_once_at_load_and_the_report_says_so(no_kernel):
    path, weights = no_kernel
    stage = models.build(str(path), LayerRange(0, 2), "packed")
    assert stage.precision == "f16+f32(iq4_nl)+f32(q2_k)+f32(q3_k)+q5_k"  # F16 held as stored
    kept = [
        n
        for n in weights
        if n.endswith(("attn_q.weight", "attn_v.weight", "attn_output.weight", "gate.weight"))
    ]
    assert stage.n_packed == sum(weights[n].size for n in kept)
    block = stage.blocks[1]
    assert isinstance(block.ffn_down, np.ndarray) and block.ffn_down.dtype == np.float32
    assert np.array_equal(block.ffn_down, weights["blk.1.ffn_down.weight"].T)  # as gguf-py dequantizes
    assert not stage.compiled  # the compiled path needs every block matrix in blocks with a kernel
    # the report a worker greets clients with, as a coordinator decodes it
    report = decode_report(encode_report(WorkerServer(stage, "token").describe("127.0.0.1:1", 0, str(path))))
    assert (report.precision, report.n_packed, report.n_params) == (
        stage.precision,
        stage.n_packed,
        stage.n_params,
    )
    f32 = models.build(str(path), LayerRange(0, 2), "f32")
    assert f32.precision == "f32" and f32.n_packed == 0
    x = ids([3, 17, 5])
    got = stage.forward(x, session="s", start_pos=0, last_only=True)
    want = f32.forward(x, session="s", start_pos=0, last_only=True)
    assert 0 < np.abs(got - want).max() <= 0.02 * np.abs(want).max()  # Q5_K's rows rounded to 8 bits


def _retype(path, tensor: str, type_id: int) -> None:
    """Overwrite the type id of `tensor` in the file's tensor table."""
    data = bytearray(path.read_bytes())
    name = tensor.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, type_id)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("type_id", "match"),
    [
        (99, r"tensor 'blk\.0\.ffn_up\.weight' has an unknown type 99"),  # no GGML type at all
        (
            24,
            r"tensor 'blk\.0\.ffn_up\.weight' has type id 24, which is not supported; known: f32 \(0\)",
        ),  # I8
    ],
)
def test_a_tensor_of_an_unknown_type_id_is_refused_at_load_naming_the_tensor_and_the_id(
    tmp_path, type_id, match
):
    path = tmp_path / "retyped.gguf"
    write_tiny_llama(
        path, blocks=True
    )  # ffn_up is Q4_1: as I8, its data takes fewer bytes, still in the file
    _retype(path, "blk.0.ffn_up.weight", type_id)
    with pytest.raises(GGUFError, match=match):
        models.build(str(path), LayerRange(0, 1), "packed")
    with pytest.raises(GGUFError, match=match):  # and by the coordinator sizing stages from the file
        footprint(str(path), "packed")
