"""bench.fidelity's bookkeeping on tiny inputs: leads, the steps compared, distances, medians, its lines."""

from __future__ import annotations

import numpy as np
import pytest

from bench.fidelity import MARGIN, agreement, distances, lead, lines, shared_prefix, summary


def test_a_rows_lead_is_its_top_logit_over_its_second_even_when_they_tie():
    logits = np.array([[0.0, 3.0, 1.5, 2.5], [1.0, 1.0, -2.0, 0.0]], dtype=np.float32)
    assert lead(logits).tolist() == [0.5, 0.0]


def test_only_steps_where_llamacpp_leads_by_the_margin_are_compared_and_all_are_counted_beside():
    ours, theirs = [1, 2, 3, 4], [1, 9, 3, 8]
    leads = [MARGIN, 5.0, MARGIN - 0.01, 0.05]
    assert agreement(ours, theirs, leads) == {"same": 1, "compared": 2, "same_all": 2, "positions": 4}


def test_two_greedy_runs_share_the_tokens_before_their_first_difference():
    assert shared_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert shared_prefix([1, 2], [1, 2]) == 2
    assert shared_prefix([5], [1, 2]) == 0


def test_each_engines_distance_to_the_reference_is_its_rms_and_max_and_their_ratio_ours_over_theirs():
    ref = np.zeros(4, dtype=np.float32)
    ours = np.array([1.0, -1.0, 1.0, -1.0], dtype=np.float32)  # RMS 1, max 1
    theirs = np.array([2.0, 2.0, -2.0, 0.0], dtype=np.float32)  # RMS sqrt(3)
    d = distances(ours, theirs, ref)
    assert d["ours_rms"] == 1.0 and d["ours_max"] == 1.0 and d["llamacpp_max"] == 2.0
    assert d["llamacpp_rms"] == pytest.approx(np.sqrt(3))
    assert d["ratio"] == round(1 / np.sqrt(3), 3)


def _row(ratio: float, same: int, compared: int, shared: int) -> dict:
    return {
        "prompt": "p", "ids": 5, "leads": [1.0, 0.1], "same": [True, False], "shared_prefix": shared,
        "agreement": {"same": same, "compared": compared, "same_all": same, "positions": 2},
        "ratio": ratio, "ours_rms": ratio / 10, "llamacpp_rms": 0.1,
    }  # fmt: skip


def test_the_prompts_totals_add_their_steps_and_take_the_median_of_their_ratios():
    rows = [_row(0.8, 1, 1, 2), _row(1.3, 0, 1, 0), _row(0.9, 1, 2, 1)]
    s = summary(rows)
    assert s["greedy"] == {"same": 2, "compared": 4, "same_all": 2, "positions": 6}
    assert s["median_ratio"] == 0.9 and s["shared_prefix"] == [2, 0, 1]
    assert s["median_ours_rms"] == pytest.approx(0.09)


def test_the_lines_show_each_steps_lead_whether_it_was_compared_and_the_targets():
    rows = [_row(0.8, 1, 1, 2)]
    f = {"file": "m.gguf", "precision": "q8_0", "steps": 2, "margin": MARGIN, "prompts": rows,
         "long": {"same": 9, "compared": 9, "same_all": 10, "positions": 10}, **summary(rows)}  # fmt: skip
    text = "\n".join(lines(f))
    assert "leads 1.00= 0.10~" in text, "a compared step says whether the top-1s agree; a near tie says ~"
    assert "10/10 = 1.000 (target ≥ 0.99" in text and "(target ≤ 1.0)" in text
