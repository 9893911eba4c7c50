"""Reading GGUF files: metadata, tensors, and clear errors for files we cannot use."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_gguf import TinyLlama, write_other_architecture, write_tiny_llama

from workers import models
from workers.models import ModelSpecError
from workers.models.gguf_file import GGUFError, open_gguf
from workers.report import LayerRange


def test_smollm2s_hyper_parameters_are_read_from_its_metadata(smollm2):
    p = open_gguf(smollm2).llama_params()
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
    assert f.llama_params().n_kv_heads == TinyLlama().n_kv_heads


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
    with pytest.raises(GGUFError, match=f"{path}: architecture 'gpt2' is not supported; only 'llama'"):
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
