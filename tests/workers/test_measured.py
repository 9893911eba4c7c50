"""A joiner's own layer costs: measured by a sample of layers, kept on its host under a fingerprint."""

from __future__ import annotations

import pytest

from workers import calibrate, measured
from workers.calibrate import Costs

MODEL = "synthetic:layers=6,hidden=16"


@pytest.fixture
def counted(tmp_path, monkeypatch):
    """A measure that counts its calls, with the cache in a directory of the test's own."""
    monkeypatch.setenv(measured.CACHE_ENV, str(tmp_path / "calibration"))
    monkeypatch.delenv("RLX_THREADS", raising=False)
    calls: list[tuple[str, str]] = []

    def measure(spec: str, precision: str) -> Costs:
        calls.append((spec, precision))
        return Costs(layers=[float(len(calls))] * 6, precision=precision)

    return calls, measure


def test_a_second_join_with_the_same_fingerprint_reuses_the_kept_costs(counted):
    calls, measure = counted
    first, kept_first = measured.own_costs(MODEL, "f32", measure)
    again, kept_again = measured.own_costs(MODEL, "f32", measure)
    assert (kept_first, kept_again) == ("sampled", measured.KEPT)
    assert again == first and len(calls) == 1


@pytest.mark.parametrize("change", ["quota", "threads", "model", "precision"])
def test_a_changed_quota_thread_count_model_or_precision_is_measured_again(counted, monkeypatch, change):
    calls, measure = counted
    measured.own_costs(MODEL, "f32", measure)
    spec, precision = MODEL, "f32"
    if change == "quota":
        monkeypatch.setattr(measured, "cpu_quota", lambda: "40000 100000")
    elif change == "threads":
        monkeypatch.setenv("RLX_THREADS", "1")
    elif change == "model":
        spec = "synthetic:layers=6,hidden=32"
    else:
        precision = "f16"
    costs, kept = measured.own_costs(spec, precision, measure)
    assert kept == "sampled" and len(calls) == 2 and costs.layers == [2.0] * 6


def test_a_damaged_cache_file_is_measured_again_and_replaced(counted):
    calls, measure = counted
    measured.own_costs(MODEL, "f32", measure)
    [path] = measured.cache_dir().iterdir()
    path.write_text("{not json")
    _, kept = measured.own_costs(MODEL, "f32", measure)
    _, kept_after = measured.own_costs(MODEL, "f32", measure)
    assert (kept, kept_after, len(calls)) == ("sampled", measured.KEPT, 2)


def test_the_host_key_names_the_cpu_cores_quota_model_file_precision_and_threads():
    key = measured.host_key(MODEL, "f32")
    assert set(key) == {"cpu", "cores", "quota", "model", "precision", "threads", "method"}
    assert key["model"].startswith("spec:" + MODEL) and key["precision"] == "f32"


def test_a_sampled_calibration_gives_every_layer_a_cost_from_three_small_stages():
    costs = calibrate.measure_sampled(MODEL, "f32", prompt=4, steps=3)
    assert len(costs.layers) == 6 and all(ms >= 0 for ms in costs.layers)
    assert costs.layers[:-1] == [costs.layers[0]] * 5  # the middle layer stands for every one before the last


def test_a_sampled_calibration_times_a_run_of_middle_layers_as_one_stage_not_a_layer_or_two(monkeypatch):
    built: list[list[tuple[int, int]]] = []
    real_decode = calibrate._decode_ms

    def decode(stages, info, prompt, steps):
        built.append([(s.layers.start, s.layers.end) for s in stages])
        return real_decode(stages, info, prompt, steps)

    monkeypatch.setattr(calibrate, "_decode_ms", decode)
    calibrate.measure_sampled("synthetic:layers=12,hidden=16", "f32", prompt=2, steps=2)
    # A layer or two stay in the cache from step to step, which a served stage's many layers do not.
    run = calibrate.SAMPLED_RUN
    assert built == [[(2, 3)], [(2, 2 + run)], [(11, 12)]]


def test_a_fake_models_costs_are_what_its_spec_declares_never_forwards_that_would_trip_its_knobs(counted):
    calls, measure = counted
    costs, how = measured.own_costs("fake:layers=4,delay_ms=300,crash_on=1", "f32", measure)
    assert (how, costs.layers, costs.stage_ms, calls) == ("declared", [measured.FAKE_LAYER_MS] * 4, 300.0, [])


@pytest.mark.parametrize(
    ("quota", "share"),
    [("40000 100000", 0.4), ("-1 100000", 0.0), ("max 100000", 0.0), ("", 0.0), ("150000 100000", 1.5)],
)
def test_the_cpu_share_offered_is_the_cgroups_quota_over_its_period_and_none_without_one(
    monkeypatch, quota, share
):
    monkeypatch.setattr(measured, "cpu_quota", lambda: quota)
    assert measured.cpu_share() == share
