"""The architecture table: each tiny file's hyper-parameters as its entry reads them, and what is refused."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from tests.support.naive_forward import naive_logits
from tests.support.tiny_gguf import TINY_ARCHS, TinyArch, write_other_architecture, write_tiny_arch
from workers import models
from workers.models import arch, decode
from workers.models.arch import NEOX, NORM, LayerRope, read_params
from workers.models.gguf_file import GGUFError, open_gguf
from workers.protocol.report import LayerRange


def params(tmp_path, name: str, **kwargs) -> arch.ModelParams:
    path = tmp_path / f"{name}.gguf"
    write_tiny_arch(path, TINY_ARCHS[name], **kwargs)
    return read_params(open_gguf(path))


@pytest.mark.parametrize("name", sorted(TINY_ARCHS))
def test_every_tiny_file_is_read_through_its_architectures_entry(tmp_path, name):
    t, p = TINY_ARCHS[name], params(tmp_path, name)
    assert p.arch is arch.ARCHS[t.arch]
    assert (p.n_layers, p.hidden, p.n_heads, p.n_kv_heads, p.head_dim, p.ffn) == (
        t.n_layers, t.hidden, t.n_heads, t.n_kv_heads, t.head_dim, t.ffn,
    )  # fmt: skip
    assert (p.vocab, p.context_length, p.rope_base) == (t.vocab, t.context_length, t.rope_base)
    assert p.arch.rope == (NORM if t.arch == "llama" else NEOX)


def test_qwen3_heads_are_as_wide_as_key_length_says_not_hidden_over_heads(tmp_path):
    p = params(tmp_path, "qwen3")
    assert p.head_dim == 32 != p.hidden // p.n_heads
    assert p.query_scale == 1 / math.sqrt(32)


def test_llama3_frequency_factors_and_linear_scaling_are_read(tmp_path):
    factors = params(tmp_path, "llama").rope[0].factors
    np.testing.assert_allclose(factors, np.geomspace(1, 8, 8), rtol=1e-6)
    linear = params(tmp_path, "llama_linear")
    assert linear.rope == (LayerRope(500000.0, 0.25, None),) * 3


def test_gemma3s_windowed_layers_have_their_own_rope_and_every_sixth_sees_all(tmp_path):
    p = params(tmp_path, "gemma3")
    assert p.window == (4, 4, 4, 4, 4, 0)
    assert p.rope[:5] == (LayerRope(10000.0),) * 5  # llama.cpp hard-codes base 10000, scale 1 there
    assert p.rope[5] == LayerRope(1e6, 1 / 8.0)  # the file's base and linear factor
    assert p.embed_scale == math.sqrt(64) and p.query_scale == 1 / math.sqrt(32)
    assert p.arch.activation == "gelu_tanh"


def test_phi3s_sliding_window_key_is_ignored_as_llama_cpp_does(tmp_path):
    p = params(tmp_path, "phi3", metadata={"phi3.attention.sliding_window": 2})
    assert p.window == (0, 0, 0)


@pytest.mark.parametrize("name", sorted(TINY_ARCHS))
def test_the_compiled_path_computes_every_architecture_of_the_table(tmp_path, name):
    p = params(tmp_path, name)
    assert decode.supports(p, range(p.n_layers)) is None


def test_the_compiled_path_names_what_it_does_not_compute(tmp_path):
    p = params(tmp_path, "gemma3")
    relu = dataclasses.replace(p.arch, activation="relu", tensors=p.arch.tensors | {"attn_bias": "attn.bias"})
    why = decode.supports(dataclasses.replace(p, arch=relu), range(6))
    assert why == "the compiled path does not compute the tensor attn_bias, the relu activation (gemma3)"


# ---------------------------------------------------------------- refusals, each naming what it refuses


def test_an_unknown_architecture_is_refused_naming_it_and_the_known_ones(tmp_path):
    path = tmp_path / "gpt2.gguf"
    write_other_architecture(path, "gpt2")
    with pytest.raises(
        GGUFError, match=f"{path}: architecture 'gpt2' is not supported; known: gemma3, llama, phi3"
    ):
        models.describe(str(path))


@pytest.mark.parametrize("kind", ["yarn", "longrope"])
def test_a_rope_scaling_type_the_table_does_not_know_is_refused(tmp_path, kind):
    path = tmp_path / "scaled.gguf"
    write_tiny_arch(path, TINY_ARCHS["llama_linear"], metadata={"llama.rope.scaling.type": kind})
    with pytest.raises(GGUFError, match=f"{path}: RoPE scaling type '{kind}' is not supported"):
        models.describe(str(path))


@pytest.mark.parametrize("name", ["blk.0.attn_q.bias", "blk.0.foo.weight", "blk.3.attn_q.weight", "mystery"])
def test_a_tensor_the_entry_does_not_name_is_refused(tmp_path, name):
    path = tmp_path / "foreign.gguf"
    write_tiny_arch(path, TINY_ARCHS["llama"], extra={name: np.zeros(64, dtype=np.float32)})
    with pytest.raises(GGUFError, match=f"{path}: tensor '{name}' is not one a 'llama' model holds"):
        models.describe(str(path))


def test_rope_freqs_is_refused_where_the_architecture_has_none(tmp_path):
    path = tmp_path / "qwen2.gguf"
    write_tiny_arch(path, TINY_ARCHS["qwen2"], extra={"rope_freqs.weight": np.ones(8, dtype=np.float32)})
    with pytest.raises(GGUFError, match=r"tensor 'rope_freqs\.weight' is not one a 'qwen2' model holds"):
        models.describe(str(path))


def test_a_missing_required_tensor_is_named_when_a_stage_holding_it_is_built(tmp_path):
    path = tmp_path / "holey.gguf"
    write_tiny_arch(path, TINY_ARCHS["qwen3"], omit="blk.1.attn_k_norm.weight")
    models.build(str(path), LayerRange(2, 3), "f32")  # a stage without block 1 does not need it
    with pytest.raises(GGUFError, match=f"{path}: tensor 'blk.1.attn_k_norm.weight' is missing"):
        models.build(str(path), LayerRange(0, 2), "f32")


def test_a_value_length_other_than_key_length_is_refused(tmp_path):
    path = tmp_path / "values.gguf"
    write_tiny_arch(path, TINY_ARCHS["qwen3"], metadata={"qwen3.attention.value_length": 16})
    with pytest.raises(
        GGUFError, match=f"{path}: attention.value_length 16 differs from attention.key_length 32"
    ):
        models.describe(str(path))


def test_key_length_alone_leaves_values_at_hidden_over_heads_and_is_refused(tmp_path):
    # llama.cpp's default value_length is hidden / heads (16 here), not key_length (32).
    path = tmp_path / "keys.gguf"
    write_tiny_arch(path, TINY_ARCHS["qwen3"], metadata={"qwen3.attention.value_length": None})
    with pytest.raises(GGUFError, match=r"value_length 16 differs from attention\.key_length 32"):
        models.describe(str(path))


@pytest.mark.parametrize("name", ["rope_factors_long.weight", "rope_factors_short.weight"])
def test_phi3_longrope_factors_are_refused_naming_longrope(tmp_path, name):
    path = tmp_path / "long.gguf"
    write_tiny_arch(path, TINY_ARCHS["phi3"], extra={name: np.ones(8, dtype=np.float32)})
    with pytest.raises(GGUFError, match=f"{path}: tensor '{name}': LongRoPE .* is not supported"):
        models.describe(str(path))


def test_a_per_layer_value_that_varies_is_refused_and_one_that_does_not_is_read(tmp_path):
    path = tmp_path / "varies.gguf"
    write_tiny_arch(path, TINY_ARCHS["llama"], metadata={"llama.attention.head_count_kv": [2, 1, 2]})
    with pytest.raises(GGUFError, match=r"llama.attention.head_count_kv = \[2, 1, 2\] varies per layer"):
        models.describe(str(path))
    same = tmp_path / "same.gguf"
    write_tiny_arch(same, TINY_ARCHS["llama"], metadata={"llama.attention.head_count_kv": [2, 2, 2]})
    assert read_params(open_gguf(same)).n_kv_heads == 2


def test_a_partial_rope_is_refused(tmp_path):
    path = tmp_path / "partial.gguf"
    write_tiny_arch(path, TinyArch("llama"), metadata={"llama.rope.dimension_count": 8})
    with pytest.raises(GGUFError, match="partial RoPE"):
        models.describe(str(path))


def test_an_optional_tensor_a_block_lacks_is_none_and_its_line_is_skipped(tmp_path, monkeypatch):
    # No entry of the table has one today (llama.cpp requires qwen2's biases): an entry that says so.
    path = tmp_path / "unbiased.gguf"
    t = TINY_ARCHS["qwen2"]
    monkeypatch.setitem(
        arch.ARCHS, "qwen2", dataclasses.replace(arch.ARCHS["qwen2"], optional=frozenset({"k_bias"}))
    )
    weights = write_tiny_arch(path, t, omit="blk.1.attn_k.bias")
    stage = models.build(str(path), LayerRange(0, 3), "f32")
    assert stage.blocks[1].k_bias is None and stage.blocks[0].k_bias is not None
    tokens = [5, 6, 7, 8]
    logits = stage.forward(np.array(tokens, dtype=np.int32), session="s", start_pos=0, last_only=False)
    want = naive_logits(weights, t, tokens)  # it adds a bias only where the file holds one
    np.testing.assert_allclose(logits, want, rtol=0, atol=2e-5 * np.abs(want).max())  # as test_block.py
