"""Every architecture's tiny file through the reference block, against the same math written plainly."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools

import gguf
import numpy as np
import pytest

from tests.support.naive_forward import naive_logits
from tests.support.tiny_gguf import K_TYPES, QTYPES, TINY_ARCHS, TINY_K_ARCHS, TinyArch, write_tiny_arch
from workers import models
from workers.models import decode
from workers.models.tokenizer import load_tokenizer
from workers.protocol.info import BatchItem
from workers.protocol.report import LayerRange

TOKENS = [104, 261, 32, 99, 97, 116, 258, 97, 259, 46, 10, 84]  # a few bytes and merged tokens
SPLITS = {"one stage": 1, "three stages": 3}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Each architecture's tiny file in f32 (and its weights), written once."""
    d = tmp_path_factory.mktemp("archs")
    return {
        name: (d / f"{name}.gguf", write_tiny_arch(d / f"{name}.gguf", t)) for name, t in TINY_ARCHS.items()
    }


def stages_of(path, t: TinyArch, n: int, precision: str = "f32") -> list:
    bounds = [round(i * t.n_layers / n) for i in range(n + 1)]
    return [models.build(str(path), LayerRange(a, b), precision) for a, b in itertools.pairwise(bounds)]


def run(stages, steps: list[tuple[int, int]], tokens=TOKENS, session: str = "s") -> np.ndarray:
    """Every position's logits, forwarded in chunks (start, end) through the stages."""
    out = []
    for start, end in steps:
        x = np.asarray(tokens[start:end], dtype=np.int32)
        for stage in stages:
            x = stage.forward(x, session=session, start_pos=start, last_only=False)
        out.append(x)
    return np.concatenate(out)


# A prompt of 7 rows, then decode steps one row at a time: past gemma3's window of 4 both ways.
STEPS = [(0, 7)] + [(p, p + 1) for p in range(7, len(TOKENS))]


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("name", sorted(TINY_ARCHS))
def test_each_architecture_matches_its_plain_forward_through_one_and_three_stages(files, name, split):
    path, weights = files[name]
    t = TINY_ARCHS[name]
    got = run(stages_of(path, t, SPLITS[split]), STEPS)
    want = naive_logits(weights, t, TOKENS)
    # float32 against float64 through up to six blocks, logits of up to ~40: ~1e-5 of the largest.
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("name", sorted(TINY_ARCHS))
def test_one_and_three_stages_give_bitwise_the_same_logits(files, name):
    path, _ = files[name]
    t = TINY_ARCHS[name]
    np.testing.assert_array_equal(run(stages_of(path, t, 3), STEPS), run(stages_of(path, t, 1), STEPS))


@pytest.mark.parametrize("name", sorted(TINY_ARCHS))
def test_a_batch_of_decode_rows_is_each_sessions_own_block(files, name):
    path, _ = files[name]
    t = TINY_ARCHS[name]
    (stage,) = stages_of(path, t, 1)
    prompts = {"a": TOKENS[:6], "b": TOKENS[3:5], "c": TOKENS[1:9]}
    for s, p in prompts.items():
        stage.forward(np.asarray(p, dtype=np.int32), session=s, start_pos=0, last_only=True)
    items = [BatchItem(np.asarray([TOKENS[-1]], np.int32), s, len(p), True) for s, p in prompts.items()]
    together = stage.forward_batch(items)
    for item, got in zip(items, together, strict=True):
        want = naive_logits(files[name][1], t, [*prompts[item.session], TOKENS[-1]])[-1:]
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())  # as above


# ---------------------------------------------------------------- the compiled path against the reference


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("name", sorted(TINY_ARCHS))
def test_the_compiled_path_equals_the_reference_where_it_claims_support(tmp_path, monkeypatch, name, qtype):
    path, t = tmp_path / "m.gguf", TINY_ARCHS[name]
    write_tiny_arch(path, t, qtype)
    compiled = stages_of(path, t, 2, "packed")
    assert all(stage.compiled for stage in compiled)
    monkeypatch.setattr(decode, "supports", lambda p, layers: "turned off by this test")
    reference = stages_of(path, t, 2, "packed")
    assert [stage.not_compiled for stage in reference] == ["turned off by this test"] * 2
    got, want = run(compiled, STEPS), run(reference, STEPS)
    # Both round each row to 8 bits per block before a product (kernels_q8), from float32 inputs
    # summed in other orders (numpy's attention and norms against the compiled loops): rows agree
    # to float32 rounding (measured 4e-7 of the largest logit) until a value at a rounding step's
    # edge gets another 8-bit code, which moves its row, and through the cache later ones, by up to
    # 1.4% (measured); the greedy tokens stay the same but where two nearly tie.
    assert np.abs(got - want).max() <= 0.02 * np.abs(want).max()
    assert np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.9


@pytest.mark.parametrize("name", sorted(TINY_ARCHS))
def test_blocks_in_a_type_without_kernels_run_the_reference(tmp_path, name):
    path, t = tmp_path / "m.gguf", TINY_ARCHS[name]
    weights = write_tiny_arch(path, t, "f16")  # not in blocks (Q5_0, used before, has a kernel now)
    stages = stages_of(path, t, 2, "packed")
    assert [stage.not_compiled for stage in stages] == [
        "not every block matrix is packed in a type with a kernel"
    ] * 2
    want = naive_logits(weights, t, TOKENS)
    # F16 matrices widened to float32 as read, float32 rows: to float32 rounding of the float64 math.
    np.testing.assert_allclose(run(stages, STEPS), want, rtol=0, atol=2e-5 * np.abs(want).max())


# ---------------------------------------------------------------- the tiny files themselves


def test_a_tiny_file_is_the_same_bytes_for_the_same_seed_and_other_bytes_for_another(tmp_path):
    # Every file of every type is checked against the bytes llama.cpp's fixture was made from
    # (test_llamacpp_fixtures): here, that a seed is what makes them, on one architecture in each type.
    def digests(name: str, seed: int = 0) -> dict[str, str]:
        (tmp_path / name).mkdir()
        out = {}
        for qtype in QTYPES:
            path = tmp_path / name / f"{qtype}.gguf"
            write_tiny_arch(path, TINY_ARCHS["gemma3"], qtype, seed)
            out[qtype] = hashlib.sha256(path.read_bytes()).hexdigest()
        return out

    one, two, other = digests("one"), digests("two"), digests("other", seed=1)
    assert len(set(one.values())) == len(QTYPES)
    assert one == two
    assert not set(one.values()) & set(other.values())


@pytest.mark.parametrize("qtype", sorted(QTYPES))
@pytest.mark.parametrize("name", sorted(TINY_ARCHS))
def test_a_tiny_files_greedy_token_leads_clearly_at_most_steps(tmp_path, name, qtype):
    path, t = tmp_path / "m.gguf", TINY_ARCHS[name]
    write_tiny_arch(path, t, qtype)
    (stage,) = stages_of(path, t, 1, "packed")
    tokens = load_tokenizer(path).encode("the cat is a thing")
    margins = []
    x = np.asarray(tokens, dtype=np.int32)
    for _ in range(10):
        logits = stage.forward(x, session="s", start_pos=len(tokens) - len(x), last_only=True)[0]
        top, second = np.sort(logits)[-2:][::-1]
        margins.append(top - second)
        tokens.append(int(logits.argmax()))
        x = np.asarray(tokens[-1:], dtype=np.int32)
    # A reference runtime's rounding differs from ours: a lead of 0.2 keeps its greedy token ours.
    assert np.mean(np.array(margins) >= 0.2) >= 0.7, np.round(margins, 2)


def test_a_tiny_k_file_is_the_same_bytes_for_the_same_seed_and_other_bytes_for_another(tmp_path):
    # As above, for the K types (the quantizer of tests/support/kquants), on one layer of llama_k.
    t = dataclasses.replace(TINY_K_ARCHS["llama_k"], n_layers=1)

    def digest(qtype: str, seed: int) -> str:
        path = tmp_path / f"{qtype}-{seed}.gguf"
        write_tiny_arch(path, t, qtype, seed)
        return hashlib.sha256(path.read_bytes()).hexdigest()

    one = [digest(qtype, 0) for qtype in K_TYPES]
    assert len(set(one)) == len(K_TYPES)
    assert one == [digest(qtype, 0) for qtype in K_TYPES]
    assert not set(one) & {digest(qtype, 1) for qtype in K_TYPES}


def test_the_q4_k_m_mix_holds_each_matrix_in_the_type_llama_cpps_q4_k_m_gives_it(tmp_path):
    # Eight layers: llama.cpp gives more bits to layer 0 (the first eighth), 7 (the last) and every
    # third from the first eighth on (3, 6), in attn_v and ffn_down; the head, and a tied embedding,
    # get Q6_K; a fused attn_qkv Q5_K; every other matrix Q4_K.
    def types(name: str) -> dict[str, str]:
        t = dataclasses.replace(TINY_K_ARCHS[name], n_layers=8, ffn=256)
        write_tiny_arch(tmp_path / f"{name}.gguf", t, "q4_k_m")
        reader = gguf.GGUFReader(tmp_path / f"{name}.gguf")
        return {r.name: r.tensor_type.name for r in reader.tensors if len(r.shape) == 2}

    llama, gemma3, phi3 = types("llama_k"), types("gemma3_k"), types("phi3_k")
    more = {0, 3, 6, 7}
    for i in range(8):
        want = "Q6_K" if i in more else "Q4_K"
        assert llama[f"blk.{i}.attn_v.weight"] == want
        assert llama[f"blk.{i}.ffn_down.weight"] == want
        assert phi3[f"blk.{i}.ffn_down.weight"] == want
        assert {llama[f"blk.{i}.{m}.weight"] for m in ("attn_q", "attn_k", "attn_output", "ffn_gate")} == {
            "Q4_K"
        }
        assert phi3[f"blk.{i}.attn_qkv.weight"] == "Q5_K"
    assert (llama["output.weight"], llama["token_embd.weight"]) == ("Q6_K", "Q4_K")
    assert "output.weight" not in gemma3 and gemma3["token_embd.weight"] == "Q6_K"  # tied: it is the head


def test_a_tiny_file_of_an_unknown_type_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"tiny files are written in f32, .*q4_k_m, not 'q3_k'"):
        write_tiny_arch(tmp_path / "m.gguf", TINY_K_ARCHS["llama_k"], "q3_k")


# gemma3's window of 4, met by chunks of every kind: one that starts inside a held window and is
# longer than it (positions 3..10), single rows that wrap the ring, then one that ends the prompt.
MID_RING = [(0, 3), (3, 10), (10, 11), (11, 12)]


@pytest.mark.parametrize("split", SPLITS)
def test_a_chunk_longer_than_the_window_after_a_held_one_matches_the_plain_forward(files, split):
    path, weights = files["gemma3"]
    t = TINY_ARCHS["gemma3"]
    got = run(stages_of(path, t, SPLITS[split]), MID_RING)
    want = naive_logits(weights, t, TOKENS)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())  # as the first test


def test_the_compiled_path_keeps_the_window_as_the_reference_does_across_chunks(tmp_path, monkeypatch):
    path, t = tmp_path / "m.gguf", TINY_ARCHS["gemma3"]
    write_tiny_arch(path, t, "q8_0")
    compiled = stages_of(path, t, 2, "packed")
    monkeypatch.setattr(decode, "supports", lambda p, layers: "turned off by this test")
    reference = stages_of(path, t, 2, "packed")
    got, want = run(compiled, MID_RING), run(reference, MID_RING)
    # As in the compiled path's test above: float32 rounding until an 8-bit code flips.
    assert np.abs(got - want).max() <= 0.02 * np.abs(want).max()
    assert np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.9
