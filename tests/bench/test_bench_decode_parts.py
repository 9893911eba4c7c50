"""bench.decode_parts' bookkeeping: a step's parts summed by type, and what the parts leave unexplained."""

from __future__ import annotations

import pytest

from bench.decode_parts import _flat, _summary, lines


def _medians() -> dict[str, float]:
    return {
        "step_us": 1000.0, "step_wall_us": 1500.0, "embed_us": 10.0, "blocks_us": 600.0, "head_us": 300.0,
        "product Q8_0 attn_q": 100.0, "product Q5_0 ffn_up": 200.0, "product Q5_0 ffn_gate": 150.0,
        "rounding_us": 20.0, "attention_us": 40.0, "norms_us": 30.0, "rope_us": 5.0, "gate_us": 15.0,
        "dispatch_us": 2.0, "calls": 5.0,
    }  # fmt: skip


def test_a_steps_products_are_summed_by_stored_type_and_its_unexplained_time_is_what_is_left():
    s = _summary(_medians())
    assert s["products_by_type_us"] == {"Q5_0": 350.0, "Q8_0": 100.0}
    assert s["products_us"]["Q5_0 ffn_up"] == 200.0
    assert s["dispatch_in_parts_us"] == 10.0, "each call from Python paid a dispatch the blocks do not"
    assert s["blocks_rest_us"] == 600 - (450 + 20 + 40 + 30 + 5 + 15 - 10)
    assert s["python_us"] == 1000 - 10 - 600 - 300
    assert s["parts_us"] == {"embed_us": 10.0, "blocks_us": 600.0, "head_us": 300.0}


def test_a_summarys_figures_flatten_to_one_key_each_so_rounds_can_take_their_medians():
    flat = _flat({"model": "m", "position": 110, "step_us": 1.5, "parts_us": {"head_us": 2.5}})
    assert flat == {"step_us": 1.5, "parts_us/head_us": 2.5}
    assert _flat(_summary(_medians()))["products_by_type_us/Q5_0"] == pytest.approx(350.0)


def test_the_lines_give_each_parts_share_of_our_step_and_llamacpps_step_beside_it():
    ours = _flat(_summary(_medians()))
    r = {"model": "m", "position": 110, "rounds": 3, "ours": ours, "llamacpp_step_us": 2000.0,
         "llamacpp_step_wall_us": 2500.0}  # fmt: skip
    text = "\n".join(lines(r))
    assert "ours 1000 µs, llama.cpp 2000 µs (× 2.00 our speed" in text
    assert "head (with its norm): 300 µs (30%)" in text and "products Q5_0: 350 µs (35%)" in text
