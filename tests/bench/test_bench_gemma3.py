"""The gemma3 bench section's bookkeeping: ours over llama.cpp's, workers over one process, targets met."""

from __future__ import annotations

import numpy as np

from bench.gemma3 import TARGETS, balance_floor, ratios
from bench.model import PROMPT_TEXT, fill, prompt_ids
from tests.support.tiny_gguf import tiny_arch, write_tiny_arch
from workers.models.tokenizer import load_tokenizer


def _way(prefill: float, decode: float, resident: int) -> dict:
    return {"prefill_tok_s": prefill, "decode_tok_s": decode, "resident_bytes": resident}


def _section(workers_decode: float, slowest_over_mean: float) -> dict:
    return {
        "threads": {
            "1": {
                "llamacpp": _way(100, 20, 400),
                "in_process": _way(150, 25, 500),
                "served": _way(90, 27, 432),
            },
            "2": {
                "llamacpp": _way(200, 30, 400),
                "in_process": _way(200, 40, 420),
                "served": _way(210, 29, 440),
            },
        },
        "workers": {"decode_tok_s": workers_decode},
        "plan": {
            "measured": {"slowest_over_mean": slowest_over_mean},
            "layer_ms": [1.0] * 5,
            "stage_ms": 0.0,
        },
    }


def test_each_ways_figures_are_over_llamacpps_at_the_same_threads_with_each_target_judged():
    r = ratios(_section(workers_decode=20, slowest_over_mean=1.2))
    served = r["vs_llamacpp"]["1"]["served"]
    assert {k: served[k] for k in ("prefill", "decode", "resident")} == {"prefill": 0.9, "decode": 1.35,
                                                                          "resident": 1.08}  # fmt: skip
    assert served["met"] == {"prefill": False, "decode": True, "decode_stretch": True, "resident": True}
    alone = r["vs_llamacpp"]["1"]["in_process"]
    assert alone["resident"] == 1.25 and alone["met"]["resident"] is False
    assert alone["met"]["decode_stretch"] is False, "1.25 × is short of the stretch target"
    two = r["vs_llamacpp"]["2"]["served"]
    assert two["decode"] == 0.97 and two["met"]["decode"] is False
    assert r["vs_llamacpp"]["2"]["in_process"]["met"]["prefill"] is True, "1.0 × meets a target of 1.0"


def test_workers_decode_is_over_the_one_process_figure_at_one_thread_and_the_plans_balance_judged():
    r = ratios(_section(workers_decode=20, slowest_over_mean=1.2))
    assert r["workers_decode_over_one_process"] == 0.8
    assert r["met"] == {"workers_decode": False, "slowest_over_mean": False}
    r = ratios(_section(workers_decode=TARGETS["workers_decode"] * 25, slowest_over_mean=1.1))
    assert r["met"] == {"workers_decode": True, "slowest_over_mean": True}


def test_a_bench_prompt_is_exactly_n_ids_with_bos_first_when_given():
    ids = fill([5, 6, 7], 8, bos=2)
    assert ids.dtype == np.int32 and ids.tolist() == [2, 5, 6, 7, 5, 6, 7, 5]
    assert fill([5, 6, 7], 4).tolist() == [5, 6, 7, 5]


def test_a_files_bench_prompt_has_no_bos_when_its_prompts_start_without_one(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_arch(path, tiny_arch("gemma3"), "f32")  # its tokenizer says add_bos_token false
    tokenizer = load_tokenizer(path)
    ids = prompt_ids(40, str(path))
    assert ids.tolist() == fill(tokenizer.encode(PROMPT_TEXT), 40).tolist()
    assert tokenizer.bos_id not in ids.tolist()


def test_no_split_balances_better_than_its_costliest_layer_alone_on_a_stage():
    assert balance_floor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0], 0.0, 3) == 1.0, "even layers can balance exactly"
    # a head of 14 ms on the last of 18 layers of ~0.6: its stage is the slowest whatever the split
    assert balance_floor([0.6] * 17 + [14.0], 0.2, 3) == round((14.2 * 3) / (0.6 * 17 + 14.0 + 0.6), 3)
    # the same head timed apart from the last layer, as a plan may cut its rows: the stages can balance
    assert balance_floor([0.6] * 18, 0.2, 3, head_ms=14.0) == 1.0
