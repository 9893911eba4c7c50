"""The planner splits layers into contiguous, covering, balanced stages."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.planner import PlanError, split
from workers.report import LayerRange


@st.composite
def layers_and_stages(draw):
    n = draw(st.integers(min_value=1, max_value=500))
    s = draw(st.integers(min_value=1, max_value=n))
    return n, s


@settings(max_examples=300, deadline=None)
@given(layers_and_stages())
def test_a_split_is_contiguous_covering_and_balanced_to_within_one_layer(ns):
    n, s = ns
    ranges = split(n, s)
    assert len(ranges) == s
    assert all(isinstance(r, LayerRange) for r in ranges)
    assert ranges[0].start == 0
    assert ranges[-1].end == n
    for before, after in zip(ranges, ranges[1:]):
        assert before.end == after.start
    sizes = [len(r) for r in ranges]
    assert min(sizes) >= 1
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True), "larger stages come first"


def test_a_known_split_gives_the_extra_layers_to_the_first_stages():
    assert split(10, 3) == [LayerRange(0, 4), LayerRange(4, 7), LayerRange(7, 10)]
    assert split(5, 5) == [LayerRange(i, i + 1) for i in range(5)]
    assert split(7, 1) == [LayerRange(0, 7)]


def test_more_stages_than_layers_is_a_plan_error_naming_both_numbers():
    with pytest.raises(PlanError, match=r"cannot split 3 layers into 4 stages"):
        split(3, 4)


@pytest.mark.parametrize("stages", [0, -1])
def test_fewer_than_one_stage_is_a_plan_error(stages):
    with pytest.raises(PlanError, match=r"at least 1 stage"):
        split(10, stages)


def test_a_model_without_layers_is_a_plan_error():
    with pytest.raises(PlanError, match="no layers"):
        split(0, 1)
