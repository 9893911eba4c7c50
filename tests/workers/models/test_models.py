"""The model table: each kind of spec parsed once, clear errors, stages that know their place."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest

from tests.support.tiny_gguf import TinyLlama, write_tiny_llama
from workers import models
from workers.fake import FakeModel, reference
from workers.models import GGUFModel, ModelSpecError
from workers.models.ops import silu
from workers.models.synthetic import SyntheticModel, make_input
from workers.protocol.info import MAX_SESSIONS
from workers.protocol.report import HeadRows, LayerRange
from workers.stage import StageError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """A tiny llama GGUF file of TinyLlama's default shape (3 blocks, hidden 64)."""
    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    write_tiny_llama(path)
    return str(path)


def test_each_kind_of_spec_is_parsed_into_its_typed_model(tiny):
    assert models.parse("synthetic:layers=3, hidden=8,seed=2") == SyntheticModel(
        name="synthetic:layers=3, hidden=8,seed=2", layers=3, hidden=8, seed=2
    )
    assert models.parse("synthetic") == SyntheticModel(name="synthetic")
    fake = models.parse("fake:layers=4,delay_ms=2.5,stage=0,fail_on=3")
    assert fake == FakeModel(name=fake.name, layers=4, delay_ms=2.5, stage=0, fail_on=3)
    assert models.parse(tiny) == GGUFModel(name=tiny, path=Path(tiny))


def test_a_gguf_file_is_built_packed_by_default_the_test_models_in_f32(tiny):
    assert models.default_precision(tiny) == "packed"
    assert models.default_precision("synthetic:layers=2") == models.default_precision("fake") == "f32"
    with pytest.raises(ModelSpecError, match="unknown model 'nonsense'"):
        models.default_precision("nonsense")


@pytest.mark.parametrize("spec", ["nonsense", "fakes", "fake-ish:layers=2", "model.ggu", "", "SYNTHETIC"])
def test_a_spec_of_no_known_kind_is_one_error_listing_the_accepted_specs(spec):
    accepted = r"accepted: synthetic\[:layers=N,hidden=H,seed=S\], fake\[:knob=value,...\], smollm2, .*\.gguf"
    for call in (lambda: models.describe(spec), lambda: models.build(spec, LayerRange(0, 1), "f32")):
        with pytest.raises(ModelSpecError, match=f"unknown model {spec!r}; {accepted}"):
            call()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("fake:layers=8,nonsense=1", r"bad option 'nonsense=1' in model spec .*; options: layers, hidden, "),
        ("synthetic:layers", r"bad option 'layers' in model spec 'synthetic:layers'; options: layers, "),
        ("synthetic:name=x", r"bad option 'name=x'"),
        ("synthetic:layers=three", r"bad value for layers in model spec 'synthetic:layers=three': 'three'"),
        ("synthetic:hidden=0", r"bad value for hidden .*: '0' \(Expected `int` >= 1\)"),
        ("synthetic:hidden=65537", r"bad value for hidden .*: '65537' \(Expected `int` <= 65536\)"),
        ("fake:delay_ms=-1", r"bad value for delay_ms .*: '-1'"),
        ("fake:stage=first", r"bad value for stage .*: 'first'"),
        ("smollm2:layers=2", r"model spec 'smollm2:layers=2': smollm2 takes no options"),
    ],
)
def test_a_bad_option_is_an_error_naming_it_and_the_spec(spec, message):
    with pytest.raises(ModelSpecError, match=message):
        models.describe(spec)


@pytest.mark.parametrize("kind", ["synthetic:layers=3", "fake:layers=3", "tiny"])
@pytest.mark.parametrize("layers", [LayerRange(2, 4), LayerRange(3, 3), LayerRange(0, 0), LayerRange(5, 9)])
def test_layers_that_do_not_fit_the_model_are_one_clear_error_for_every_kind(tiny, kind, layers):
    spec = tiny if kind == "tiny" else kind
    with pytest.raises(ModelSpecError, match=f"layers {layers} do not fit model {spec!r} with 3 layers"):
        models.build(spec, layers, "f32")


def test_a_layer_range_knows_whether_it_starts_or_ends_the_model():
    assert LayerRange(0, 3).is_first and not LayerRange(1, 3).is_first
    assert LayerRange(1, 3).is_last(3) and not LayerRange(0, 2).is_last(3)


@pytest.mark.parametrize(
    "x",
    [
        np.zeros((2, 64), np.float64),
        np.zeros((2, 63), np.float32),
        np.zeros((0, 64), np.float32),
        np.zeros(64, np.float32),
        np.zeros((1, 2, 64), np.float32),
        np.array([1, 2], np.int32),
    ],
    ids=lambda x: f"{x.dtype}{list(x.shape)}",
)
@pytest.mark.parametrize("kind", ["synthetic:layers=3,hidden=64", "fake:layers=3,hidden=64", "tiny"])
def test_every_stage_past_the_first_refuses_what_is_not_hidden_states_in_the_same_words(tiny, kind, x):
    stage = models.build(tiny if kind == "tiny" else kind, LayerRange(1, 2), "f32")
    expected = rf"^stage 1\.\.2 expects float32 \(T, 64\), got {x.dtype} \({x.shape[0]}"
    with pytest.raises(StageError, match=expected):
        stage.forward(x, session="s", start_pos=0, last_only=False)


def test_any_split_of_the_synthetic_model_computes_bitwise_the_same_as_one_stage():
    spec = "synthetic:layers=5,hidden=32,seed=7"
    x = make_input(6, 32, seed=1)

    def run(*ranges: LayerRange) -> np.ndarray:
        y = x
        for layers in ranges:
            y = models.build(spec, layers, "f32").forward(y, session="s", start_pos=0, last_only=False)
        return y

    whole = run(LayerRange(0, 5))
    for bounds in ([0, 2, 5], [0, 1, 3, 4, 5]):
        assert np.array_equal(run(*(LayerRange(a, b) for a, b in pairwise(bounds))), whole)


@pytest.mark.parametrize("kind", ["synthetic:layers=4,hidden=8", "fake:layers=4,hidden=8"])
def test_only_the_last_stage_cuts_its_output_to_the_last_position(kind):
    x = make_input(3, 8, seed=0)
    first, second = (models.build(kind, layers, "f32") for layers in (LayerRange(0, 2), LayerRange(2, 4)))
    middle = first.forward(x, session="s", start_pos=0, last_only=True)
    last = second.forward(middle, session="s", start_pos=0, last_only=True)
    assert middle.shape == (3, 8) and last.shape == (1, 8)


def test_fake_knobs_misbehave_only_on_the_stage_they_name():
    spec = "fake:layers=4,fail_on=1,stage=2"
    x = np.ones((2, 4), np.float32)
    first = models.build(spec, LayerRange(0, 2), "f32")
    y = first.forward(x, session="s", start_pos=0, last_only=False)
    np.testing.assert_array_equal(y, reference(x, range(2)))
    with pytest.raises(StageError, match="fake failure on forward 1, as asked"):
        models.build(spec, LayerRange(2, 4), "f32").forward(x, session="s", start_pos=0, last_only=False)


def test_fake_knobs_written_with_a_layer_apply_to_that_stage_on_top_of_the_shared_ones():
    spec = "fake:layers=6,delay_ms=2,fail_on@2=1,delay_ms@4=7"
    ranges = (LayerRange(0, 2), LayerRange(2, 4), LayerRange(4, 6))
    first, middle, last = (models.build(spec, r, "f32").knobs for r in ranges)
    assert (first.delay_ms, first.fail_on) == (2, 0)
    assert (middle.delay_ms, middle.fail_on) == (2, 1)
    assert (last.delay_ms, last.fail_on) == (7, 0)
    assert models.parse(spec).fail_on == 0 and models.parse(spec).layers == 6


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("fake:layers@2=3", r"'layers@2=3'.*KNOB@LAYER=VALUE .*any knob but layers, hidden, stage"),
        ("fake:crash_on@x=1", r"'crash_on@x=1'.*KNOB@LAYER=VALUE \(LAYER: the stage's first layer\)"),
        ("fake:crash_on@2=soon", r"bad value for crash_on .*'soon'.*the stage at layer 2 of model spec"),
    ],
)
def test_bad_per_stage_fake_knobs_are_refused_naming_them(spec, says):
    with pytest.raises(ModelSpecError, match=says):
        models.parse(spec)


@pytest.mark.parametrize("kind", ["synthetic:layers=2,hidden=8", "fake:layers=2,hidden=8"])
def test_stateless_stages_hold_no_session_whatever_runs(kind):
    stage = models.build(kind, LayerRange(0, 2), "f32")
    stage.forward(make_input(2, 8, seed=0), session="a", start_pos=0, last_only=False)
    assert stage.n_sessions() == 0
    stage.reset("a")
    stage.reset("never-seen")
    assert stage.n_sessions() == 0


def test_silu_of_a_very_negative_input_is_zero_without_an_overflow_warning():
    assert np.array_equal(silu(np.array([-1000.0, 0.0], np.float32)), np.zeros(2, np.float32))


def test_a_tiny_gguf_is_described_as_a_token_model(tiny):
    info = models.describe(tiny)
    t = TinyLlama()
    assert (info.input, info.n_layers, info.hidden, info.vocab) == ("tokens", 3, t.hidden, t.vocab)
    assert models.gguf_path(tiny) == Path(tiny) and models.gguf_path("synthetic") is None


def test_a_model_says_how_many_sessions_its_stages_keep_at_once(tiny):
    from workers.models import transformer

    assert models.describe(tiny).max_sessions == transformer.MAX_SESSIONS
    assert models.describe("synthetic").max_sessions == models.describe("fake").max_sessions == MAX_SESSIONS


def test_a_run_without_a_prompt_gets_seeded_activations_of_its_seq_length():
    info = models.describe("synthetic:layers=2,hidden=8")
    x = models.model_input(info, 5, seed=3)
    assert x.shape == (5, 8) and x.dtype == np.float32
    np.testing.assert_array_equal(x, models.model_input(info, 5, seed=3))
    assert not np.array_equal(x, models.model_input(info, 5, seed=4))


def test_a_model_that_takes_tokens_has_no_input_without_a_prompt(tiny):
    with pytest.raises(ValueError, match=f"model {tiny!r} takes tokens: its runs start from a prompt"):
        models.model_input(models.describe(tiny), 5, seed=0)


@pytest.mark.parametrize(
    ("layers", "named"),
    [
        (LayerRange(1, 2, HeadRows(0, 32)), r"head rows 0\.\.32 do not fit .* with its last layer \(2\)"),
        (LayerRange(3, 3, HeadRows(32, 41)), r"head rows 32\.\.41 do not fit .* rows within 0\.\.40"),
    ],
)
def test_head_rows_off_the_last_layer_or_past_the_vocabulary_are_refused_naming_them(tmp_path, layers, named):
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, TinyLlama())  # 3 layers, 40 rows
    with pytest.raises(ModelSpecError, match=named):
        models.build(str(path), layers, "f32")


def test_a_model_without_a_head_has_no_rows_to_cut():
    with pytest.raises(ModelSpecError, match=r"head rows 0\.\.8 do not fit model 'synthetic"):
        models.build("synthetic:layers=4,hidden=8", LayerRange(4, 4, HeadRows(0, 8)), "f32")
