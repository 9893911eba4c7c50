"""The planner splits layers into contiguous, covering, balanced stages."""

from __future__ import annotations

import asyncio
import itertools
import re
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.cli.main import main
from coordinator.cluster import ClusterConfig, open_cluster
from coordinator.plan.calibration import default_plan
from coordinator.plan.split import (
    Head,
    Holder,
    PlanError,
    split,
    split_by_cost,
    split_by_memory,
    stage_costs,
)
from tests.coordinator.stages.test_join import TOKEN, offer
from workers.models.quants import ROWS
from workers.protocol.report import LayerRange, check_stages
from workers.protocol.wire import read_frame

# Layer 4 computes 8 ms a forward, the others a few µs: a measured plan gives it a stage of its own.
SLOW = "synthetic:layers=9,hidden=16,slow=4..5,slow_ms=8"
ISOLATED = [LayerRange(0, 4), LayerRange(4, 5), LayerRange(5, 9)]


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
    for before, after in itertools.pairwise(ranges):
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


def holder(name: str, free: int, per_layer: int = 10, first_extra: int = 0) -> Holder:
    """A worker with `free` bytes, for a model whose layers cost `per_layer` and whose first stage more."""
    return Holder(name, free, lambda r: per_layer * len(r) + (first_extra if r.is_first else 0))


def test_workers_that_can_each_hold_an_even_share_get_the_even_split():
    holders = [holder("a", 40), holder("b", 1000), holder("c", 40)]
    assert split_by_memory(12, holders) == split(12, 3)


def test_a_worker_short_of_its_even_share_gets_fewer_layers_and_the_others_take_the_rest():
    ranges = split_by_memory(12, [holder("a", 20), holder("b", 100), holder("c", 100)])
    assert ranges == [LayerRange(0, 1), LayerRange(1, 7), LayerRange(7, 12)]


def test_the_first_stage_s_extra_bytes_count_against_its_worker():
    ranges = split_by_memory(12, [holder("a", 60, first_extra=40), holder("b", 100), holder("c", 30)])
    assert ranges == [LayerRange(0, 2), LayerRange(2, 10), LayerRange(10, 12)]


def test_workers_that_cannot_hold_the_model_together_are_a_plan_error_naming_who_is_short():
    mb = 10**6
    holders = [holder("worker a", 20 * mb, 10 * mb), holder("worker b", 100 * mb, 10 * mb),
               holder("worker c", 30 * mb, 10 * mb)]  # fmt: skip
    with pytest.raises(PlanError) as caught:
        split_by_memory(30, holders)
    message = str(caught.value)
    assert "worker a has 20.0 MB free, its even share (layers 0..10) needs 100 MB" in message
    assert "worker c has 30.0 MB free, its even share (layers 20..30) needs 100 MB" in message
    assert "worker b" not in message
    assert "together 150 MB free, the model needs about 300 MB" in message


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_a_split_by_memory_covers_the_layers_in_order_and_fits_every_worker_whenever_one_can(data):
    n = data.draw(st.integers(min_value=1, max_value=40))
    count = data.draw(st.integers(min_value=1, max_value=min(n, 6)))
    sizes = data.draw(st.lists(st.integers(min_value=1, max_value=50), min_size=n, max_size=n))
    frees = data.draw(st.lists(st.integers(min_value=0, max_value=800), min_size=count, max_size=count))
    holders = [Holder(f"w{i}", free, lambda r: sum(sizes[r.start : r.end])) for i, free in enumerate(frees)]
    try:
        ranges = split_by_memory(n, holders)
    except PlanError:
        assert not any_split_fits(n, holders), "a split that fits exists, yet the planner gave up"
        return
    assert [r.start for r in ranges] == [0] + [r.end for r in ranges[:-1]]
    assert ranges[-1].end == n and all(len(r) >= 1 for r in ranges)
    assert all(h.fits(r) for h, r in zip(holders, ranges, strict=True))


def any_split_fits(n: int, holders: list[Holder], start: int = 0) -> bool:
    """Brute force: can holders, in order, cover start..n with ranges that fit them?"""
    if not holders:
        return start == n
    ends = range(start + 1, n - len(holders) + 2)
    return any(holders[0].fits(LayerRange(start, e)) and any_split_fits(n, holders[1:], e) for e in ends)


def brute_force_splits(n: int, stages: int, start: int = 0):
    """Every split of start..n into `stages` contiguous non-empty ranges."""
    if stages == 1:
        yield [LayerRange(start, n)]
        return
    for end in range(start + 1, n - stages + 2):
        for rest in brute_force_splits(n, stages - 1, end):
            yield [LayerRange(start, end), *rest]


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_a_measured_split_makes_its_costliest_stage_as_cheap_as_any_split_that_fits_can(data):
    n = data.draw(st.integers(min_value=1, max_value=9))
    stages = data.draw(st.integers(min_value=1, max_value=min(n, 4)))
    costs = data.draw(
        st.lists(st.integers(min_value=0, max_value=40).map(lambda c: c / 4), min_size=n, max_size=n)
    )
    limited = data.draw(st.booleans())
    frees = data.draw(st.lists(st.integers(min_value=0, max_value=60), min_size=stages, max_size=stages))
    holders = [
        Holder(f"w{i}", f, lambda r: 4 * len(r) + (5 if r.is_last(n) else 0)) for i, f in enumerate(frees)
    ]
    holders = holders if limited else []
    fitting = [s for s in brute_force_splits(n, stages)
               if all(h.fits(r) for h, r in zip(holders, s, strict=False))]  # fmt: skip
    try:
        ranges = split_by_cost(costs, stages, holders)
    except PlanError:
        assert not fitting, "a split that fits exists, yet the planner gave up"
        return
    assert [r.start for r in ranges] == [0] + [r.end for r in ranges[:-1]] and ranges[-1].end == n
    assert len(ranges) == stages and all(len(r) >= 1 for r in ranges)
    assert all(h.fits(r) for h, r in zip(holders, ranges, strict=False))
    least = min(max(stage_costs(costs, s)) for s in fitting)
    assert max(stage_costs(costs, ranges)) == pytest.approx(least)
    evenest = min(
        sum(c * c for c in stage_costs(costs, s)) for s in fitting if max(stage_costs(costs, s)) <= least
    )
    assert sum(c * c for c in stage_costs(costs, ranges)) == pytest.approx(evenest), (
        "not the most even of the best"
    )


@settings(max_examples=200, deadline=None)
@given(st.data(), st.sampled_from([1.0, 1.6, 0.37, 0.0]))
def test_layers_that_cost_the_same_get_the_even_split(data, cost):
    n = data.draw(st.integers(min_value=1, max_value=60))
    s = data.draw(st.integers(min_value=1, max_value=min(n, 8)))
    assert split_by_cost([cost] * n, s) == split(n, s)


def test_slow_layers_get_stages_of_their_own():
    fast, slow = 0.05, 30.0
    assert split_by_cost([fast] * 4 + [slow] + [fast] * 4, 3) == [
        LayerRange(0, 4),
        LayerRange(4, 5),
        LayerRange(5, 9),
    ]
    two_slow = [fast] * 3 + [slow, slow] + [fast] * 3
    assert split_by_cost(two_slow, 4) == [
        LayerRange(0, 3),
        LayerRange(3, 4),
        LayerRange(4, 5),
        LayerRange(5, 8),
    ]


def test_the_stage_that_holds_a_costly_head_gets_fewer_layers():
    costs = [1.0] * 29 + [6.0]  # SmolLM2-like: the last layer's cost includes the head
    ranges = split_by_cost(costs, 3)
    predicted = stage_costs(costs, ranges)
    assert len(ranges[2]) < len(ranges[0]) and len(ranges[2]) < len(ranges[1])
    assert max(predicted) <= 1.10 * sum(predicted) / 3
    assert max(stage_costs(costs, split(30, 3))) == 15.0  # the even split's last stage: 9 layers and the head


GEMMA_LIKE = [0.4] * 18  # Gemma 3 270M's shape: 18 cheap layers and a 262,144-row head


def test_a_head_that_outweighs_a_stage_is_cut_on_row_groups_so_the_slowest_stage_is_near_the_mean():
    head = Head(262144, 12.0)  # 60% of a step, as Gemma 3's tied Q8_0 head measures
    ranges = split_by_cost(GEMMA_LIKE, 3, head=head)
    predicted = stage_costs(GEMMA_LIKE, ranges, head=head)
    check_stages(ranges, 18, 262144)
    assert [len(r) for r in ranges] == [16, 2, 0], ranges  # 6.4 ms of layers; 2 layers and rows; rows
    assert all(r.head.start % ROWS == 0 for r in ranges[1:]), ranges
    assert max(predicted) <= 1.01 * sum(predicted) / 3, predicted  # a row group's cost from exact
    whole = stage_costs(GEMMA_LIKE, split_by_cost([*GEMMA_LIKE[:-1], 0.4 + 12.0], 3), head=head)
    assert max(whole) >= 12.4, whole  # no split of whole layers comes near: the head alone is 12 ms
    assert str(ranges[1]) == f"16..18 + head rows 0..{ranges[1].head.end}"


def test_a_head_that_whole_layers_can_balance_is_not_cut():
    head = Head(49152, 0.5)  # SmolLM2-like: the head about a layer and a quarter
    ranges = split_by_cost(GEMMA_LIKE, 3, head=head)
    assert all(r.head is None for r in ranges), ranges
    assert ranges == split_by_cost([*GEMMA_LIKE[:-1], 0.4 + 0.5], 3)
    assert stage_costs(GEMMA_LIKE, ranges, 0.1, head) == stage_costs([*GEMMA_LIKE[:-1], 0.9], ranges, 0.1)


def test_a_head_is_cut_over_as_many_stages_of_rows_only_as_balance_it():
    head = Head(262144, 40.0)  # more than two stages' worth: two stages of head rows only
    ranges = split_by_cost([0.5] * 6, 4, head=head)
    check_stages(ranges, 6, 262144)
    assert [len(r) for r in ranges[2:]] == [0, 0] and ranges[1].end == 6, ranges
    predicted = stage_costs([0.5] * 6, ranges, head=head)
    assert max(predicted) <= 1.01 * sum(predicted) / 4, predicted


def test_a_head_is_not_cut_where_memory_limits_the_split_or_on_one_stage():
    head = Head(262144, 12.0)
    holders = [holder("a", 1000), holder("b", 1000), holder("c", 1000)]
    assert all(r.head is None for r in split_by_cost(GEMMA_LIKE, 3, holders, head=head))
    assert split_by_cost(GEMMA_LIKE, 1, head=head) == [LayerRange(0, 18)]


def test_a_head_with_no_rows_or_a_cost_that_is_not_a_number_is_a_plan_error():
    with pytest.raises(PlanError, match="bad head: 0 rows"):
        Head(0, 1.0)
    with pytest.raises(PlanError, match="costing nan"):
        Head(10, float("nan"))


def test_a_measured_split_keeps_each_stage_within_its_worker_s_memory():
    costs = [1.0] * 12
    holders = [holder("a", 30), holder("b", 1000), holder("c", 1000)]  # a holds at most 3 layers of 10 bytes
    ranges = split_by_cost(costs, 3, holders)
    assert ranges == [LayerRange(0, 3), LayerRange(3, 8), LayerRange(8, 12)] or len(ranges[0]) <= 3
    assert all(h.fits(r) for h, r in zip(holders, ranges, strict=True))


def test_a_measured_split_no_worker_set_can_hold_is_a_plan_error_naming_who_is_short():
    holders = [holder("worker a", 20), holder("worker b", 100), holder("worker c", 30)]
    with pytest.raises(PlanError) as caught:
        split_by_cost([1.0] * 30, 3, holders)
    assert "worker a has 20 B free, its even share (layers 0..10) needs 100 B" in str(caught.value)
    assert "worker b" not in str(caught.value)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_a_cost_that_is_not_a_finite_non_negative_number_is_a_plan_error_naming_its_layer(bad):
    with pytest.raises(PlanError, match=rf"layer 2 has cost {bad!r}: costs must be finite and at least 0"):
        split_by_cost([1.0, 1.0, bad, 1.0], 2)


def test_a_measured_split_needs_one_worker_per_stage_and_no_more_stages_than_layers():
    with pytest.raises(PlanError, match="2 workers for 3 stages"):
        split_by_cost([1.0] * 6, 3, [holder("a", 100), holder("b", 100)])
    with pytest.raises(PlanError, match="cannot split 2 layers into 3 stages"):
        split_by_cost([1.0, 1.0], 3)


def plan(*args: str) -> subprocess.CompletedProcess:
    """Run `rlx-cluster plan ARGS`."""
    command = [sys.executable, "-m", "coordinator", "plan", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_plan_measured_prints_the_slow_layer_on_its_own_stage_with_predicted_times_beside_the_even_split():
    done = plan("--model", SLOW, "--stages", "3", "--plan", "measured")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split("  ")[0] for line in lines[:3]] == [
        "stage 0: layers 0..4 (4 of 9)",
        "stage 1: layers 4..5 (1 of 9)",
        "stage 2: layers 5..9 (4 of 9)",
    ]
    times = [float(re.fullmatch(r".*  (\d+\.\d\d) ms per token", line)[1]) for line in lines[:3]]
    assert times[1] >= 8 and times[0] < 4 and times[2] < 4
    assert re.fullmatch(r"slowest stage: \d+\.\d\dx the mean \(measured in f32\)", lines[3])
    assert re.fullmatch(r"even split: 0\.\.3 [\d.]+ ms, 3\.\.6 [\d.]+ ms, 6\.\.9 [\d.]+ ms "
                        r"\(slowest [\d.]+x the mean\)", lines[4])  # fmt: skip
    assert re.fullmatch(r"each stage: \d+\.\d\d ms per token beyond its layers", lines[5])
    assert lines[6] == "layer costs: measured now, not kept (the model names no file)"
    assert len(lines) == 7
    assert "measuring each layer's decode time" in done.stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--plan", "fast"], "argument --plan: invalid choice: 'fast'"),
        (["--plan", "measured", "--stages", "12"], "rlx-cluster: cannot split 9 layers into 12 stages"),
        (["--plan", "measured", "--precision", "q2"], "argument --precision: invalid choice: 'q2'"),
        (["--stages", "0"], "argument --stages: must be a whole number >= 1"),
    ],
)
def test_plan_with_arguments_that_cannot_work_exits_2_saying_what_is_wrong(capsys, args, says):
    with pytest.raises(SystemExit) as exited:
        main(["plan", "--model", SLOW, *args])
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and says in err
    assert "measuring" not in err, "measured a split that cannot be made"


def test_a_real_model_is_planned_by_measure_and_a_test_model_evenly_by_default(smollm2):
    assert default_plan("smollm2") == "measured"
    assert default_plan(str(smollm2)) == "measured"
    assert default_plan(SLOW) == "even" and default_plan("fake:layers=4") == "even"


def measured_split(said: list[str]) -> list[LayerRange]:
    """The split a measured plan announced, from its progress line ("measured plan: 0..4 0.05 ms, …").

    What the layers cost is the plan test's concern (above); the tests that launch on a plan ask that
    the workers hold what was planned, whatever this machine measured.
    """
    [line] = [line for line in said if line.startswith("measured plan: ")]
    plan, even = line.removeprefix("measured plan: ").split("; even split: ")
    assert even.startswith("0..3 ") and ", 3..6 " in even and ", 6..9 " in even, line
    return [LayerRange(int(a), int(b)) for a, b in re.findall(r"(\d+)\.\.(\d+) [\d.]+ ms", plan)]


async def test_a_cluster_opened_with_a_measured_plan_launches_workers_on_the_measured_split():
    said: list[str] = []
    config = ClusterConfig(SLOW, 3, plan="measured", build_timeout=60.0, progress=said.append)
    async with asyncio.timeout(120), open_cluster(config) as cluster:
        launched = [n.report.layers for n in cluster.pipeline.nodes]
    assert launched == measured_split(said), said


async def test_an_unknown_plan_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match="unknown plan 'fastest'; accepted: even, measured"):
        async with asyncio.timeout(30), open_cluster(ClusterConfig(SLOW, 3, plan="fastest")):
            pass


async def test_workers_that_join_a_measured_plan_get_the_measured_split(api_factory):
    api = await api_factory(SLOW, 3, join="127.0.0.1:0", worker_token=TOKEN, plan="measured")
    joined = [await offer(api.cluster.joins.addr, 10**9, SLOW) for _ in range(3)]
    try:
        assigned = [(await asyncio.wait_for(read_frame(reader), 5))[0] for reader, _ in joined]
        assert [a.layers for a in assigned] == ISOLATED and all(a.ticket for a in assigned)
    finally:
        for _, writer in joined:
            writer.close()


def test_run_with_a_measured_plan_launches_and_runs_on_the_measured_split(capsys):
    with pytest.raises(SystemExit) as exited:
        main(
            ["run", "--model", SLOW, "--stages", "3", "--plan", "measured", "--db", ":memory:", "--seq", "2"]
        )
    out, err = capsys.readouterr()
    assert exited.value.code == 0, err
    planned = [str(r) for r in measured_split(err.splitlines())]
    assert [line.split()[1] for line in out.splitlines() if line.startswith("127.0.0.1:")] == planned, out
    assert "launching 3 worker(s) for " + SLOW + ": " + ", ".join(planned) in err


def test_a_plan_for_workers_that_are_attached_is_refused_they_hold_their_layers_already(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--model", SLOW, "--plan", "measured", "--attach", "127.0.0.1:9", "--db", ":memory:"])
    assert exited.value.code == 2
    assert "rlx-cluster: --plan measured and --attach exclude each other" in capsys.readouterr().err
