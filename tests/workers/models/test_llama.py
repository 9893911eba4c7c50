"""The llama stages: SmolLM2's real answer, splits, the KV cache, precisions, sessions."""

from __future__ import annotations

import ctypes.util
import itertools
import json

import numba
import numpy as np
import pytest

from tests.conftest import REFERENCE
from tests.support.soak import soak_beyond
from tests.support.tiny_gguf import TinyLlama, write_tiny_llama
from workers import models
from workers.models import gguf_file, kernels, kernels_q8, transformer
from workers.protocol.report import LayerRange
from workers.stage import StageError

# From the fixture, so " Paris" is checked even where it is absent.
PROMPT_IDS = [504, 3575, 282, 4649, 314]  # "The capital of France is"
GREEDY_IDS = [7042, 30, 198, 198, 504]  # " Paris.\n\nThe"
DECODE_STEPS = 3


@pytest.fixture(scope="module")
def spec(smollm2) -> str:
    return "smollm2"


@pytest.fixture(scope="module")
def whole(smollm2_f32):
    """The whole model as one f32 stage (built once per test session)."""
    return smollm2_f32


def ids(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def run_chain(stages, session: str) -> list[np.ndarray]:
    """Prefill the prompt, then feed the greedy tokens one by one; the last stage's logits of each."""
    steps = [(ids(PROMPT_IDS), 0)]
    steps += [(ids([tok]), len(PROMPT_IDS) + i) for i, tok in enumerate(GREEDY_IDS[:DECODE_STEPS])]
    outputs = []
    for x, start_pos in steps:
        for stage in stages:
            x = stage.forward(x, session=session, start_pos=start_pos, last_only=True)
        outputs.append(x)
    return outputs


@pytest.fixture(scope="module")
def whole_run(whole) -> list[np.ndarray]:
    return run_chain([whole], session="whole-run")


def even_split(n: int, s: int) -> list[LayerRange]:
    bounds = [round(i * n / s) for i in range(s + 1)]
    return [LayerRange(a, b) for a, b in itertools.pairwise(bounds)]


def test_the_capital_of_france_is_greedily_continued_with_paris(whole_run):
    greedy = [int(np.argmax(logits[-1])) for logits in whole_run]
    assert greedy[0] == 7042  # " Paris"
    assert greedy == GREEDY_IDS[: DECODE_STEPS + 1]


def test_the_last_position_agrees_with_the_reference_runtime(whole):
    ref = json.loads(REFERENCE.read_text())
    assert ref["prompt_ids"] == PROMPT_IDS and ref["greedy_first_5"] == GREEDY_IDS
    logits = whole.forward(ids(PROMPT_IDS), session="reference", start_pos=0, last_only=True)[0]
    assert list(np.argsort(-logits)[:3]) == ref["last_position_top10_ids"][:3]
    # A wrong RoPE pairing still says " Paris" here but misses these by more than 1.5.
    top10 = ref["last_position_top10_ids"]
    assert np.abs(logits[top10] - np.array(ref["last_position_top10_logits"])).max() < 0.5


# Splits into 3 and 5 stages (5 in make soak) are checked through worker processes in
# stages/test_llama_pipeline.py.
# Four stages hold a first, two middle and a last stage, every kind of cut two stages make: 2 is make soak's.
@pytest.mark.parametrize("n_stages", soak_beyond([1, 2, 4], keep=[1, 4]))
def test_any_split_into_stages_gives_bitwise_the_same_logits(spec, whole, whole_run, n_stages):
    # One stage is the whole model again: a second session on it must repeat itself.
    stages = [whole] if n_stages == 1 else [models.build(spec, r, "f32") for r in even_split(30, n_stages)]
    chained = run_chain(stages, session=f"split-{n_stages}")
    for got, want in zip(chained, whole_run, strict=True):
        assert got.dtype == np.float32 and got.shape == want.shape
        assert np.array_equal(got, want)


def test_decoding_with_the_cache_matches_rerunning_the_whole_sequence(whole, whole_run):
    sequence = PROMPT_IDS + GREEDY_IDS[:DECODE_STEPS]
    fresh = whole.forward(ids(sequence), session="no-cache", start_pos=0, last_only=True)
    assert np.abs(fresh - whole_run[-1]).max() < 1e-3


def test_last_only_gives_the_last_row_of_all_logits(whole):
    every = whole.forward(ids(PROMPT_IDS), session="rows", start_pos=0, last_only=False)
    last = whole.forward(ids(PROMPT_IDS), session="rows", start_pos=0, last_only=True)
    assert every.shape == (len(PROMPT_IDS), 49152) and last.shape == (1, 49152)
    assert np.abs(every[-1:] - last).max() < 1e-4


def test_the_stage_describes_what_it_holds(whole):
    assert (whole.precision, whole.n_packed) == ("f32", 0)
    assert 134_000_000 < whole.n_params < 135_000_000  # SmolLM2-135M, tied head counted once
    assert models.describe("smollm2") == whole.info
    assert (whole.info.n_layers, whole.info.hidden, whole.info.vocab) == (30, 576, 49152)


def test_a_stage_reads_only_its_own_tensors(spec, monkeypatch):
    read = []

    def recording(way):
        def record(self, name):
            read.append(name)
            return way(self, name)

        return record

    for way in ("raw", "mapped"):  # a tensor read in, or mapped to be regrouped
        monkeypatch.setattr(gguf_file.GGUFFile, way, recording(getattr(gguf_file.GGUFFile, way)))
    models.build(spec, LayerRange(10, 12), "packed")
    assert {n.split(".")[1] for n in read} == {"10", "11"}
    read.clear()
    first = models.build(spec, LayerRange(0, 1), "packed")
    assert "output_norm.weight" not in read
    # the embedding is left in the file, its rows read as they are looked up
    assert "token_embd.weight" not in read and first.token_embd.entry.name == "token_embd.weight"
    read.clear()
    models.build(spec, LayerRange(29, 30), "packed")  # the head is tied to token_embd
    assert {"token_embd.weight", "output_norm.weight"} <= set(read)
    assert not any(n.startswith("blk.") and not n.startswith("blk.29.") for n in read)


@pytest.mark.parametrize(("precision", "name"), [("packed", "q4_1+q8_0")])
def test_each_precision_stays_close_to_f32(spec, whole_run, precision, name):
    stage = models.build(spec, LayerRange(0, 30), precision)
    assert stage.precision == name
    assert (stage.n_packed > 0) == (precision == "packed")
    logits = stage.forward(ids(PROMPT_IDS), session="p", start_pos=0, last_only=True)[0]
    assert int(np.argmax(logits)) == GREEDY_IDS[0]
    assert np.corrcoef(logits, whole_run[0][0])[0, 1] > 0.999


def test_a_packed_middle_stage_names_only_its_types(spec):
    stage = models.build(spec, LayerRange(3, 5), "packed")
    assert stage.precision == "q4_1"
    assert stage.n_packed == stage.n_params - 4 * 576  # the norms stay f32


def test_an_unknown_precision_is_a_clear_error(spec):
    with pytest.raises(ValueError, match="precision 'f16' is not supported; accepted: packed, f32"):
        models.build(spec, LayerRange(0, 1), "f16")


# ---------------------------------------------------------------- sessions and inputs


@pytest.fixture(scope="module")
def middle(spec):
    """Blocks 10..12: hidden states in, hidden states out."""
    return models.build(spec, LayerRange(10, 12), "f32")


def hidden(T: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((T, 576), dtype=np.float32)


def test_a_middle_stage_maps_hidden_states_to_hidden_states(middle):
    out = middle.forward(hidden(4), session="h", start_pos=0, last_only=True)
    assert out.dtype == np.float32 and out.shape == (4, 576)


def test_positions_must_continue_the_session(middle):
    middle.forward(hidden(4), session="c", start_pos=0, last_only=False)
    with pytest.raises(StageError, match="must start at 4, not 3"):
        middle.forward(hidden(1), session="c", start_pos=3, last_only=False)
    with pytest.raises(StageError, match="no cache"):
        middle.forward(hidden(1), session="never-started", start_pos=4, last_only=False)
    middle.forward(hidden(1), session="c", start_pos=4, last_only=False)


def test_position_zero_restarts_a_session(middle):
    first = middle.forward(hidden(3, seed=1), session="r", start_pos=0, last_only=False)
    middle.forward(hidden(2, seed=2), session="r", start_pos=3, last_only=False)
    again = middle.forward(hidden(3, seed=1), session="r", start_pos=0, last_only=False)
    assert np.array_equal(first, again)
    with pytest.raises(StageError, match="must start at 3"):
        middle.forward(hidden(1), session="r", start_pos=5, last_only=False)


def test_the_context_length_bounds_positions(middle):
    with pytest.raises(StageError, match="context length 8192"):
        middle.forward(hidden(2), session="long", start_pos=8191, last_only=False)


def test_reset_frees_a_session_and_the_least_recently_used_is_evicted(spec):
    middle = models.build(spec, LayerRange(10, 11), "f32")
    middle.forward(hidden(1), session="keep", start_pos=0, last_only=False)
    middle.forward(hidden(1), session="drop", start_pos=0, last_only=False)
    middle.reset("drop")
    middle.reset("unknown")  # nothing to free is fine
    assert middle.n_sessions() == 1
    for i in range(transformer.MAX_SESSIONS - 1):
        middle.forward(hidden(1), session=f"s{i}", start_pos=0, last_only=False)
    middle.forward(hidden(1), session="keep", start_pos=1, last_only=False)  # now recently used
    middle.forward(hidden(1), session="one-more", start_pos=0, last_only=False)
    assert middle.n_sessions() == transformer.MAX_SESSIONS
    middle.forward(hidden(1), session="keep", start_pos=2, last_only=False)
    with pytest.raises(StageError, match="evicted"):
        middle.forward(hidden(1), session="s0", start_pos=1, last_only=False)


@pytest.mark.parametrize(
    ("x", "match"),
    [
        (np.zeros((2, 576), dtype=np.float64), "expects float32"),
        (np.zeros((2, 100), dtype=np.float32), r"expects float32 \(T, 576\)"),
        (np.zeros((0, 576), dtype=np.float32), "expects float32"),
        (np.array([1, 2], dtype=np.int32), "expects float32"),
    ],
)
def test_a_middle_stage_rejects_bad_input(middle, x, match):
    with pytest.raises(StageError, match=match):
        middle.forward(x, session="bad", start_pos=0, last_only=False)


@pytest.mark.parametrize(
    ("x", "match"),
    [
        (np.zeros((2, 576), dtype=np.float32), "expects int32 token ids"),
        (np.array([], dtype=np.int32), "expects int32 token ids"),
        (np.array([5, 49152], dtype=np.int32), "token ids must be in 0..49151"),
    ],
)
def test_the_first_stage_rejects_bad_input(whole, x, match):
    with pytest.raises(StageError, match=match):
        whole.forward(x, session="bad", start_pos=0, last_only=True)


# ---------------------------------------------------------------- a tiny model of other shapes


def naive_logits(w: dict[str, np.ndarray], t: TinyLlama, tokens: list[int]) -> np.ndarray:
    """The llama forward written plainly in float64: no cache, K and V repeated, a loop over heads."""
    T, H, KV, hd = len(tokens), t.n_heads, t.n_kv_heads, t.head_dim
    w = {k: v.astype(np.float64) for k, v in w.items()}

    def norm(x, weight):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + t.eps) * weight

    def rope(x):  # rotate pairs (2i, 2i+1) by position · base^(-2i/hd)
        out = x.copy()
        for i in range(hd // 2):
            angle = np.arange(T)[:, None] * t.rope_base ** (-2 * i / hd)
            a, b = x[..., 2 * i], x[..., 2 * i + 1]
            out[..., 2 * i] = a * np.cos(angle) - b * np.sin(angle)
            out[..., 2 * i + 1] = a * np.sin(angle) + b * np.cos(angle)
        return out

    x = w["token_embd.weight"][tokens]
    for layer in range(t.n_layers):
        n = f"blk.{layer}."
        h = norm(x, w[n + "attn_norm.weight"])
        q = rope((h @ w[n + "attn_q.weight"].T).reshape(T, H, hd))
        k = np.repeat(rope((h @ w[n + "attn_k.weight"].T).reshape(T, KV, hd)), H // KV, axis=1)
        v = np.repeat((h @ w[n + "attn_v.weight"].T).reshape(T, KV, hd), H // KV, axis=1)
        heads = []
        for j in range(H):
            scores = q[:, j] @ k[:, j].T / np.sqrt(hd)
            scores[np.triu_indices(T, 1)] = -np.inf
            p = np.exp(scores - scores.max(-1, keepdims=True))
            heads.append(p / p.sum(-1, keepdims=True) @ v[:, j])
        x = x + np.concatenate(heads, axis=-1) @ w[n + "attn_output.weight"].T
        h = norm(x, w[n + "ffn_norm.weight"])
        gate = h @ w[n + "ffn_gate.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * (h @ w[n + "ffn_up.weight"].T)) @ w[n + "ffn_down.weight"].T
    return norm(x, w["output_norm.weight"]) @ w["output.weight"].T


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    return path, write_tiny_llama(path, mixed_types=True)


def test_a_tiny_llama_file_is_described_from_its_metadata(tiny):
    info = models.describe(str(tiny[0]))
    t = TinyLlama()
    assert (info.n_layers, info.hidden, info.vocab, info.context_length) == (3, t.hidden, t.vocab, 32)


@pytest.mark.parametrize("layers", [[(0, 3)], [(0, 1), (1, 3)], [(0, 1), (1, 2), (2, 3)]])
def test_a_tiny_llama_matches_a_plain_forward_with_and_without_cache(tiny, layers):
    path, weights = tiny
    stages = [models.build(str(path), LayerRange(a, b), "f32") for a, b in layers]
    tokens = [3, 17, 5, 39, 0, 22]
    x = ids(tokens[:4])
    for stage in stages:
        x = stage.forward(x, session="t", start_pos=0, last_only=False)
    np.testing.assert_allclose(x, naive_logits(weights, TinyLlama(), tokens[:4]), atol=1e-4)
    for pos in (4, 5):
        x = ids(tokens[pos : pos + 1])
        for stage in stages:
            x = stage.forward(x, session="t", start_pos=pos, last_only=True)
        np.testing.assert_allclose(x[0], naive_logits(weights, TinyLlama(), tokens[: pos + 1])[-1], atol=1e-4)


def test_packed_keeps_every_stored_type_of_a_tiny_llama(tiny, monkeypatch):
    path, weights = tiny
    f32 = models.build(str(path), LayerRange(0, 3), "f32")
    packed = models.build(str(path), LayerRange(0, 3), "packed")
    assert packed.precision == "f16+q4_1+q8_0"
    assert packed.n_params == f32.n_params == sum(w.size for w in weights.values())
    # More rows than KERNEL_MAX_ROWS (lowered to fit the tiny model's context) go through float32
    # tiles of the dequantized blocks: f32's products to rounding.
    monkeypatch.setattr(kernels, "KERNEL_MAX_ROWS", 4)
    x = ids(list(range(1, 4 + 3)))
    want = f32.forward(x, session="a", start_pos=0, last_only=False)
    np.testing.assert_allclose(packed.forward(x, session="a", start_pos=0, last_only=False), want, atol=1e-4)
    # Fewer are rounded to 8 bits per block first (kernels_q8): close, not to rounding.
    x = ids([1, 2, 3])
    want = f32.forward(x, session="b", start_pos=0, last_only=False)
    got = packed.forward(x, session="b", start_pos=0, last_only=False)
    assert 0 < np.abs(got - want).max() <= 0.02 * np.abs(want).max()


@pytest.fixture(scope="module")
def tiny_blocks(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "blocks.gguf"
    return path, write_tiny_llama(path, blocks=True)


@pytest.mark.parametrize("layers", [[(0, 3)], [(0, 2), (2, 3)]])
def test_packed_blocks_on_a_few_rows_take_the_compiled_path_and_match_a_plain_forward(tiny_blocks, layers):
    path, weights = tiny_blocks
    stages = [models.build(str(path), LayerRange(a, b), "packed") for a, b in layers]
    assert all(stage.compiled for stage in stages)  # every block matrix is Q4_1 or Q8_0
    tokens = [3, 17, 5, 39, 0, 22, 9, 30, 11]
    prompt = 6  # a prompt of a few rows: each row sees the ones before it
    steps = [(0, prompt)] + [(pos, pos + 1) for pos in range(prompt, len(tokens))]
    for start, end in steps:
        x = ids(tokens[start:end])
        for stage in stages:
            x = stage.forward(x, session="t", start_pos=start, last_only=False)
        want = naive_logits(weights, TinyLlama(), tokens[:end])[start:end]
        # Rows rounded to 8 bits per block before each product (kernels_q8): close, not to rounding.
        assert np.abs(x - want).max() <= 0.02 * np.abs(want).max(), f"positions {start}..{end}"


def test_compiled_blocks_split_between_two_threads_give_bitwise_what_one_thread_gives(
    tiny_blocks, monkeypatch
):
    path, _ = tiny_blocks
    tokens = [3, 17, 5, 39, 0, 22, 9]

    def greedy_logits() -> list[np.ndarray]:
        stage = models.build(str(path), LayerRange(0, 3), "packed")
        steps = [(0, 5), (5, 6), (6, 7)]  # a prompt of a few rows, then two decode steps
        return [stage.forward(ids(tokens[a:b]), session="t", start_pos=a, last_only=True) for a, b in steps]

    before = kernels.threads()
    try:
        kernels.set_threads(1)
        alone = greedy_logits()
        kernels.set_threads(2)
        assert kernels.threads() == 2, "this test needs two cores"
        for layer in kernels_q8.CHUNK_MIN_BYTES:  # every product split, however small
            monkeypatch.setitem(kernels_q8.CHUNK_MIN_BYTES, layer, 1)
        split = greedy_logits()
    finally:
        kernels.set_threads(before)
    for got, want in zip(split, alone, strict=True):
        np.testing.assert_array_equal(got, want)
    # The pool a split wakes: OpenMP's where the system has libgomp (4 µs against the workqueue's 45).
    assert numba.threading_layer() == ("omp" if ctypes.util.find_library("gomp") else "workqueue")


# A prompt of 30 positions as a coordinator sends it in chunks, each continuing the session's cache.
CHUNKED = [(0, 7), (7, 13), (13, 20), (20, 26), (26, 30)]


def prompt_outputs(path, precision: str, chunks: list[tuple[int, int]], session: str) -> np.ndarray:
    """Every position's logits of one prompt through two stages, forwarded chunk by chunk."""
    stages = [models.build(str(path), LayerRange(a, b), precision) for a, b in [(0, 2), (2, 3)]]
    tokens = ids(list(np.random.default_rng(5).integers(0, TinyLlama().vocab, 30)))
    outputs = []
    for a, b in chunks:
        x = tokens[a:b]
        for stage in stages:
            x = stage.forward(x, session=session, start_pos=a, last_only=False)
        outputs.append(x)
    return np.concatenate(outputs)


def test_a_prompt_in_chunks_gives_bitwise_its_logits_at_once_on_compiled_blocks(tiny_blocks):
    # The compiled path computes each row by itself (its products row by row, its attention over its
    # own keys), so where a prompt is cut changes nothing.
    path, _ = tiny_blocks
    whole = prompt_outputs(path, "packed", [(0, 30)], "whole")
    np.testing.assert_array_equal(prompt_outputs(path, "packed", CHUNKED, "chunked"), whole)


def test_a_prompt_in_chunks_gives_its_logits_at_once_to_float32_rounding(tiny):
    # f32 goes through BLAS, whose sums may be ordered by the matrices' shapes: 2e-6 apart measured
    # (logits up to 4), the tokens the same (tests/coordinator/runs/test_long_prompts.py).
    path, _ = tiny
    whole = prompt_outputs(path, "f32", [(0, 30)], "whole")
    np.testing.assert_allclose(prompt_outputs(path, "f32", CHUNKED, "chunked"), whole, rtol=0, atol=1e-5)
