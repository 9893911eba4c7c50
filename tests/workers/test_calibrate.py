"""Calibration times each layer at decode, a chunk of layers at a time, and prints its costs as JSON."""

from __future__ import annotations

import gc
import statistics
import subprocess
import sys

import gguf
import msgspec
import pytest

from coordinator.plan.split import Head, split_by_cost, stage_costs
from tests.support.tiny_gguf import TinyLlama, write_tiny_llama
from workers import calibrate
from workers.calibrate import Costs, measure
from workers.models import ModelSpecError, parse
from workers.models.quants import ROWS
from workers.protocol.report import LayerRange, check_stages, resident_bytes

SLOW = "synthetic:layers=6,hidden=16,slow=2..4,slow_ms=10"


def test_slow_layers_measure_at_least_their_spin_and_the_others_far_less():
    costs = measure(SLOW, "f32", prompt=4, steps=2)
    assert len(costs.layers) == 6 and (costs.precision, costs.prompt, costs.steps) == ("f32", 4, 2)
    assert all(ms >= 10 for ms in costs.layers[2:4]), costs.layers
    assert all(ms < 5 for ms in costs.layers[:2] + costs.layers[4:]), costs.layers


def test_a_stage_s_fixed_cost_is_measured_once_and_taken_off_every_layer():
    spec = "synthetic:layers=6,hidden=16,stage_ms=5"
    costs = measure(spec, "f32", prompt=4, steps=3)
    assert 4 <= costs.stage_ms <= 6, costs
    assert all(0 <= ms < 1 for ms in costs.layers), costs.layers  # each layer alone spun the stage's 5 ms
    # A stage then costs its fixed cost plus its layers', as a stage of them measures.
    [whole] = calibrate.measure_stages(spec, "f32", [LayerRange(0, 4)], prompt=4, steps=3).ms
    assert whole == pytest.approx(costs.stage_ms + sum(costs.layers[:4]), abs=1.0)
    plain = measure("synthetic:layers=6,hidden=16", "f32", prompt=4, steps=3)
    assert plain.stage_ms < 1, plain


def test_a_big_head_is_timed_apart_from_the_last_layer_so_a_measured_plan_cuts_its_rows(tmp_path):
    # Six narrow layers and a head of 32,768 rows (2.2 MB of Q8_0, read whole every token), as Gemma 3's
    # 262,144-row head outweighs its layers; the embedding of the same size is only looked up.
    path = tmp_path / "big_head.gguf"
    q8 = gguf.GGMLQuantizationType.Q8_0
    write_tiny_llama(path, TinyLlama(n_layers=6, vocab=32768), blocks=True, types={"token_embd": q8})
    costs = measure(str(path), "packed", prompt=2, steps=5)
    # The head reads ~25 times the bytes of a layer: 3 times leaves room for a loaded machine's noise.
    # (Layers 0 and 5 are left out: the first's stage reads an embedding row from the file, the last's
    # applies the final norm and passes the head's first rows on, a few calls' worth each.)
    # Against the middle layers' median: one layer's timing may double under load (measured 0.105 ms
    # beside three of 0.04-0.055 in CI), the head's ~25 times their bytes does not shrink to that.
    assert costs.head_rows == 32768 and costs.head_ms > 3 * statistics.median(costs.layers[1:-1]), costs
    head = Head(costs.head_rows, costs.head_ms)
    ranges = split_by_cost(costs.layers, 3, head=head)
    check_stages(ranges, 6, 32768)
    assert all(r.head is None or r.head.start % ROWS == 0 for r in ranges), ranges
    # Where whole layers cannot balance the head, its rows are cut: the slowest stage within 1.10x the
    # mean, as no split of whole layers may be (the head outweighs a third of a step on its own), or
    # no slower than layer 0 alone, when a loaded machine made its row's read from the file outweigh that.
    predicted = stage_costs(costs.layers, ranges, costs.stage_ms, head)
    alone = costs.stage_ms + costs.layers[0] + 1e-9
    assert max(predicted) <= max(1.10 * sum(predicted) / 3, alone), (costs, ranges, predicted)
    whole = split_by_cost([*costs.layers[:-1], costs.layers[-1] + costs.head_ms], 3)
    assert max(predicted) <= max(stage_costs(costs.layers, whole, costs.stage_ms, head)), (costs, ranges)


def test_layers_are_built_no_more_than_a_budget_s_worth_at_a_time(monkeypatch):
    built: list[list[int]] = []
    real_decode = calibrate._decode_ms

    def decode(stages, info, prompt, steps):
        built.append([s.layers.start for s in stages])
        return real_decode(stages, info, prompt, steps)

    monkeypatch.setattr(calibrate, "_decode_ms", decode)
    layer_bytes = (16 + 4 * 16 * 16) * 4  # a synthetic layer of hidden 16: norm, up, down in f32
    measure("synthetic:layers=5,hidden=16", "f32", prompt=2, steps=1, budget=2 * layer_bytes)
    # Each chunk of several layers is timed layer by layer, then as one stage (its first layer's start).
    assert built == [[0, 1], [0], [2, 3], [2], [4]]
    built.clear()
    measure("synthetic:layers=5,hidden=16", "f32", prompt=2, steps=1, budget=1)
    assert built == [[0], [1], [2], [3], [4]], "a layer over the budget is still measured, alone"


def test_the_command_prints_one_line_of_costs_and_refuses_a_precision_the_model_lacks():
    model = "synthetic:layers=3,hidden=8"
    run = [sys.executable, "-m", "workers.calibrate", "--model", model, "--steps", "1"]
    done = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    costs = msgspec.json.decode(done.stdout, type=Costs)
    assert len(costs.layers) == 3 and all(ms >= 0 for ms in costs.layers)
    bad = subprocess.run([*run, "--precision", "packed"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stdout == ""
    assert "calibrate: synthetic model computes in f32 only, not 'packed'" in bad.stderr


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("synthetic:layers=4,slow=3..5", "slow layers 3..5 lie beyond its 4 layers"),
        ("synthetic:slow=two", "slow: bad layer range 'two'"),
    ],
)
def test_slow_layers_outside_the_synthetic_model_are_a_spec_error(spec, says):
    with pytest.raises(ModelSpecError, match=says):
        parse(spec)


def test_whole_stages_are_timed_as_layers_are_and_a_range_beyond_the_model_is_refused(capsys):
    checked = calibrate.measure_stages(
        SLOW, "f32", [LayerRange(0, 2), LayerRange(2, 4), LayerRange(4, 6)], 4, 2
    )
    assert checked.ranges == [LayerRange(0, 2), LayerRange(2, 4), LayerRange(4, 6)]
    assert checked.ms[1] >= 20 and checked.ms[0] < 5 and checked.ms[2] < 5, checked.ms
    with pytest.raises(SystemExit) as exited:
        calibrate.main(["--model", SLOW, "--stages", "0..3,3..9"])
    out, err = capsys.readouterr()
    assert exited.value.code == 2 and out == ""
    assert "calibrate: layers 3..9 do not fit model" in err


def test_a_stage_with_weights_worth_caching_is_timed_after_the_cache_is_emptied_a_tiny_one_not(monkeypatch):
    emptied = []
    monkeypatch.setattr(calibrate, "_evict", lambda: emptied.append(True))
    calibrate.measure_stages("synthetic:layers=4,hidden=16", "f32", [LayerRange(0, 2)], prompt=2, steps=3)
    assert emptied == []  # a few hundred weights: nothing in a cache to empty
    # hidden 1024: a layer holds 1024 x 1024 weights, past EVICT_PARAMS; every timed step's forward and
    # the one that warms up are each preceded by one emptying.
    calibrate.measure_stages("synthetic:layers=2,hidden=1024", "f32", [LayerRange(0, 2)], prompt=2, steps=3)
    assert len(emptied) == 4


def test_the_last_level_cache_is_read_from_sysfs_where_the_cpu_says():
    size = calibrate.last_cache_bytes()
    assert size >= 1 << 20 and size % 1024 == 0, size


def test_a_sampled_measure_gives_back_the_buffer_it_emptied_the_cache_with(monkeypatch):
    # A joiner measures its host in its own process, then serves there: what emptied the cache between
    # the timed forwards (twice the cache, every page written) must not stay resident after.
    cache = 128 << 20
    monkeypatch.setattr(calibrate, "last_cache_bytes", lambda: cache)
    before = resident_bytes()
    costs = calibrate.measure_sampled("synthetic:layers=4,hidden=1024", "f32", prompt=4, steps=2)
    gc.collect()
    assert len(costs.layers) == 4
    grown = resident_bytes() - before
    assert grown < cache, f"the process kept {grown / 2**20:.0f} MiB after measuring"
