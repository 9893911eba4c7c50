"""Reading GGUF files: metadata, tensors, and clear errors for files we cannot use."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from tests.support.tiny_gguf import TinyLlama, write_other_architecture, write_tiny_llama
from workers import models
from workers.models import ModelSpecError
from workers.models.arch import read_params
from workers.models.gguf_file import SMALL_ARRAY, GGUFError, open_gguf, read_arrays
from workers.protocol.report import LayerRange


def test_smollm2s_hyper_parameters_are_read_from_its_metadata(smollm2):
    p = read_params(open_gguf(smollm2))
    assert (p.n_layers, p.hidden, p.n_heads, p.n_kv_heads, p.head_dim, p.ffn) == (30, 576, 9, 3, 64, 1536)
    assert (p.rope_base, p.context_length, p.vocab) == (100000.0, 8192, 49152)
    assert p.eps == pytest.approx(1e-5)


def test_tensors_are_listed_in_numpy_order_with_their_types(smollm2):
    f = open_gguf(smollm2)
    assert f.entry("blk.0.ffn_gate.weight").shape == (1536, 576)  # (out, in)
    assert f.entry("token_embd.weight").qtype.name == "Q8_0"
    assert "output.weight" not in f.tensors  # the head is tied to token_embd
    assert f.dequantize("blk.0.ffn_down.weight").shape == (576, 1536)
    assert f.dequantize("blk.0.attn_norm.weight").dtype == np.float32


def test_a_tiny_file_reads_back_the_tensors_written(tmp_path):
    weights = write_tiny_llama(tmp_path / "t.gguf")
    f = open_gguf(tmp_path / "t.gguf")
    for name in ("blk.2.attn_k.weight", "output.weight", "blk.0.ffn_norm.weight"):
        assert np.array_equal(f.dequantize(name), weights[name])
    assert read_params(f).n_kv_heads == TinyLlama().n_kv_heads


def test_a_missing_file_is_a_clear_error(tmp_path):
    path = tmp_path / "nowhere" / "model.gguf"
    with pytest.raises(ModelSpecError, match=f"{path}: cannot read model file"):
        models.describe(str(path))


def test_a_directory_is_a_clear_error(tmp_path):
    (tmp_path / "dir.gguf").mkdir()
    with pytest.raises(GGUFError, match="not a regular file"):
        open_gguf(tmp_path / "dir.gguf")


def test_a_file_that_is_not_gguf_is_a_clear_error(tmp_path):
    path = tmp_path / "text.gguf"
    path.write_text("this is not a model\n" * 10)
    with pytest.raises(GGUFError, match=f"{path}: not a GGUF file"):
        models.describe(str(path))


@pytest.mark.parametrize("keep", [0, 3, 200, 2_000_000, -10])
def test_a_truncated_copy_is_a_clear_error(smollm2, tmp_path, keep):
    path = tmp_path / "cut.gguf"
    path.write_bytes(smollm2.read_bytes()[:keep])  # keep < 0: all but the last bytes
    with pytest.raises(GGUFError, match=f"{path}: (not a GGUF file|not a readable GGUF file|truncated)"):
        models.build(str(path), LayerRange(0, 1), "f32")


def test_a_truncated_tiny_file_is_caught_before_tensors_are_used(tmp_path):
    path = tmp_path / "t.gguf"
    write_tiny_llama(path)
    with open(path, "r+b") as f:
        f.truncate(f.seek(0, 2) - 1)
    with pytest.raises(GGUFError, match="truncated"):
        models.describe(str(path))


def test_a_non_llama_architecture_is_a_clear_error(tmp_path):
    path = tmp_path / "gpt2.gguf"
    write_other_architecture(path, "gpt2")
    with pytest.raises(
        GGUFError,
        match=f"{path}: architecture 'gpt2' is not supported; known: gemma3, llama, phi3, qwen2, qwen3",
    ):
        models.describe(str(path))


def test_a_missing_tensor_is_named(tmp_path):
    path = tmp_path / "holey.gguf"
    write_tiny_llama(path, omit="blk.1.ffn_up.weight")
    models.build(str(path), LayerRange(2, 3), "f32")  # a stage without block 1 does not need it
    with pytest.raises(GGUFError, match=f"{path}: tensor 'blk.1.ffn_up.weight' is missing"):
        models.build(str(path), LayerRange(0, 2), "f32")


def test_a_changed_file_is_read_again(tmp_path):
    path = tmp_path / "m.gguf"
    write_tiny_llama(path, TinyLlama(n_layers=2))
    assert models.describe(str(path)).n_layers == 2
    write_tiny_llama(path, TinyLlama(n_layers=4))
    assert models.describe(str(path)).n_layers == 4


# Every Q8_0 block holds ±127, so its scale is 1 and the values survive quantization exactly.
Q8_EXACT = np.where(np.arange(256) % 2, 127.0, -127.0).astype(np.float32).reshape(4, 64)


def write_every_kind(path: Path) -> None:
    """Write a GGUF holding a value of every type, short and long arrays, nested arrays, two tensors."""
    w = gguf.GGUFWriter(path, arch="llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60_000)
    w.add_int16("t.i16", -30_000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**60)
    w.add_int64("t.i64", -(2**60))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.string", "héllo")
    w.add_array("t.short", [1, 2, 3])
    w.add_array("t.words", [f"wörd {i}" for i in range(SMALL_ARRAY + 36)])
    w.add_array("t.numbers", list(range(SMALL_ARRAY + 36)))
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_array("t.long_nested", [[i, -i] for i in range(SMALL_ARRAY + 6)])
    w.add_tensor("a.weight", np.arange(64, dtype=np.float32).reshape(2, 32))
    q8 = gguf.GGMLQuantizationType.Q8_0
    w.add_tensor("b.weight", gguf.quants.quantize(Q8_EXACT, q8), raw_dtype=q8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def as_the_gguf_package_reads_it(path: Path) -> tuple[dict, dict]:
    """Metadata and tensor table as `gguf.GGUFReader` gives them (nested arrays come out flattened)."""
    reader = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = {
        t.name: (t.tensor_type, tuple(reversed(t.shape.tolist())), int(t.data_offset), int(t.n_bytes))
        for t in reader.tensors
    }
    return fields, tensors


def as_we_read_it(path: Path) -> tuple[dict, dict]:
    """Metadata (long arrays read on demand) and tensor table as `open_gguf` gives them."""
    f = open_gguf(path)
    fields = f.fields | read_arrays(path, list(f.arrays))
    tensors = {e.name: (e.qtype, e.shape, e.offset, e.n_bytes) for e in f.tensors.values()}
    return fields, tensors


def test_smollm2s_header_reads_as_the_gguf_package_reads_it(smollm2):
    fields, tensors = as_we_read_it(smollm2)
    assert (fields, tensors) == as_the_gguf_package_reads_it(smollm2)
    assert len(tensors) == 272 and len(fields["tokenizer.ggml.tokens"]) == 49152


def test_every_value_type_reads_as_the_gguf_package_reads_it(tmp_path):
    path = tmp_path / "kinds.gguf"
    write_every_kind(path)
    fields, tensors = as_we_read_it(path)
    theirs, their_tensors = as_the_gguf_package_reads_it(path)
    assert tensors == their_tensors
    assert fields.pop("t.nested") == [[1, 2], [3]]
    assert fields.pop("t.long_nested")[-1] == [SMALL_ARRAY + 5, -(SMALL_ARRAY + 5)]
    assert fields == {k: v for k, v in theirs.items() if "nested" not in k}
    assert fields["t.f32"] == np.float32(0.1) and fields["t.f64"] == 0.1 and fields["t.bool"] is True
    assert np.array_equal(open_gguf(path).dequantize("b.weight"), Q8_EXACT)


def test_long_arrays_are_only_located_when_a_file_is_opened(smollm2, tmp_path):
    f = open_gguf(smollm2)
    assert {"tokenizer.ggml.tokens", "tokenizer.ggml.merges"} <= f.arrays.keys()
    assert "tokenizer.ggml.tokens" not in f.fields and f.fields["tokenizer.ggml.model"] == "gpt2"
    write_every_kind(tmp_path / "kinds.gguf")
    kinds = open_gguf(tmp_path / "kinds.gguf")
    assert set(kinds.arrays) == {"t.words", "t.numbers", "t.long_nested"}
    assert kinds.fields["t.short"] == [1, 2, 3]


def test_reading_a_single_value_as_an_array_is_a_clear_error(tmp_path):
    path = tmp_path / "kinds.gguf"
    write_every_kind(path)
    assert read_arrays(path, ["t.short", "t.absent"]) == {"t.short": [1, 2, 3]}
    with pytest.raises(GGUFError, match=f"{path}: metadata 't.string' = 'héllo' is not an array"):
        read_arrays(path, ["t.string"])


def test_a_file_cut_at_any_byte_is_a_clear_error(tmp_path):
    whole = tmp_path / "kinds.gguf"
    write_every_kind(whole)
    data = whole.read_bytes()
    end = max(e.offset + e.n_bytes for e in open_gguf(whole).tensors.values())
    cut = tmp_path / "cut.gguf"
    # Every byte of the first values, then a stride that still lands in every field and string.
    for n in [*range(64), *range(64, end, 5)]:
        cut.write_bytes(data[:n])
        with pytest.raises(GGUFError, match=f"{cut}: (not a GGUF file|truncated file)"):
            open_gguf(cut)
    cut.write_bytes(data[: data.index(b"t.words") + 40])
    with pytest.raises(GGUFError, match=f"{cut}: truncated file, it ends inside metadata 't.words'"):
        open_gguf(cut)


def patch(data: bytes, after: bytes, skip: int, value: bytes) -> bytes:
    """`data` with the bytes `skip` past the end of the first `after` replaced by `value`."""
    at = data.index(after) + len(after) + skip
    return data[:at] + value + data[at + len(value) :]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: patch(d, b"GGUF", 0, struct.pack("<I", 99)), "GGUF version 99 is not supported"),
        (lambda d: patch(d, b"GGUF", 0, struct.pack(">I", 3)), "byte order differs"),
        (
            lambda d: patch(d, b"t.u8", 0, struct.pack("<I", 77)),
            "metadata 't.u8' has an unknown value type 77",
        ),
        (
            lambda d: patch(d, b"t.string", 4, struct.pack("<Q", 2**62)),
            "truncated file, it ends inside metadata 't.string'",
        ),
        (lambda d: patch(d, b"t.string", 12, b"\xff"), "metadata 't.string' is not UTF-8 text"),
        (lambda d: d.replace(b"t.i8", b"t.u8"), "metadata key 't.u8' appears twice"),
        (
            lambda d: patch(d, b"a.weight", 20, struct.pack("<I", 999)),
            "tensor 'a.weight' has an unknown type 999",
        ),
        (
            lambda d: patch(d, b"b.weight", 4, struct.pack("<Q", 33)),
            "tensor 'b.weight' has rows of 33, not whole Q8_0 blocks of 32",
        ),
    ],
)
def test_a_damaged_header_is_an_error_naming_what_is_wrong(tmp_path, damage, message):
    whole, path = tmp_path / "whole.gguf", tmp_path / "damaged.gguf"
    write_every_kind(whole)
    path.write_bytes(damage(whole.read_bytes()))
    with pytest.raises(GGUFError, match=f"{path}: {message}"):
        open_gguf(path)
