"""Placing joined workers, as a pure function: the first plan, vacancies refilled, spares, who is short."""

from __future__ import annotations

import msgspec
import pytest

from coordinator.plan.costmodel import ModelShape
from coordinator.plan.hosts import Host
from coordinator.plan.place import FirstPlan, Given, Measured, Placement, Vacancy, host_of, place
from coordinator.plan.split import PlanError
from workers.models.footprint import Footprint
from workers.protocol.messages import Fingerprint, Offer
from workers.protocol.report import LayerRange

# 100 bytes a layer in f32, a quarter of that packed; nothing outside the layers.
FOOTPRINTS = {"f32": Footprint(layers=[100] * 6), "packed": Footprint(layers=[25] * 6)}
PLENTY = 10_000


def footprint(precision: str) -> Footprint:
    return FOOTPRINTS[precision]


def offered(i: int, memory_bytes: int = PLENTY, precision: str = "f32") -> Offer:
    """What the i-th worker to join offers."""
    spec = "synthetic:layers=6"
    return Offer(addr=f"10.0.0.{i}:7000", model=spec, fingerprint=Fingerprint(kind="spec", name=spec),
                 precision=precision, memory_bytes=memory_bytes, cores=2)  # fmt: skip


def ranges(placement: Placement) -> list[LayerRange]:
    return [g.layers for g in placement.given]


def test_a_first_plan_splits_the_layers_evenly_among_workers_that_can_hold_an_even_share():
    placement = place([offered(i) for i in range(3)], FirstPlan(6, 3), footprint)
    assert placement.given == [Given(0, 0, LayerRange(0, 2)), Given(1, 1, LayerRange(2, 4)),
                               Given(2, 2, LayerRange(4, 6))]  # fmt: skip
    assert placement.spares == []


def test_a_first_plan_waits_until_as_many_workers_as_stages_have_joined():
    placement = place([offered(0), offered(1)], FirstPlan(6, 3), footprint)
    assert placement == Placement(given=[], spares=[0, 1])


def test_a_worker_that_cannot_hold_an_even_share_gets_fewer_layers_by_memory():
    placement = place([offered(0, memory_bytes=150), offered(1)], FirstPlan(4, 2), footprint)
    assert ranges(placement) == [LayerRange(0, 1), LayerRange(1, 4)]


def test_each_worker_is_measured_by_the_footprint_of_its_own_precision():
    small_f32, small_packed = offered(0, 150, "f32"), offered(1, 150, "packed")
    assert ranges(place([small_f32, small_packed], FirstPlan(4, 2), footprint)) == [
        LayerRange(0, 1),
        LayerRange(1, 4),
    ]
    with pytest.raises(PlanError):
        place([small_f32, offered(1, 150, "f32")], FirstPlan(4, 2), footprint)


def test_measured_costs_give_the_costliest_layer_a_stage_of_its_own_rather_than_an_even_split():
    costs = [1.0, 1.0, 1.0, 1.0, 8.0, 1.0]
    placement = place([offered(i) for i in range(3)], FirstPlan(6, 3), footprint, costs)
    assert ranges(placement) == [LayerRange(0, 4), LayerRange(4, 5), LayerRange(5, 6)]


def test_measured_costs_are_balanced_within_each_workers_memory():
    costs = [8.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    roomy = place([offered(i) for i in range(3)], FirstPlan(6, 3), footprint, costs)
    assert ranges(roomy) == [LayerRange(0, 1), LayerRange(1, 4), LayerRange(4, 6)]
    # The second worker holds at most 2 layers: the third takes what it cannot.
    tight = place([offered(0), offered(1, 200), offered(2)], FirstPlan(6, 3), footprint, costs)
    assert ranges(tight) == [LayerRange(0, 1), LayerRange(1, 3), LayerRange(3, 6)]


def test_measured_costs_for_another_number_of_layers_are_a_plan_error_naming_both():
    with pytest.raises(PlanError, match="5 measured layer costs for a model of 6 layers"):
        place([offered(i) for i in range(3)], FirstPlan(6, 3), footprint, [1.0] * 5)


def test_workers_beyond_the_first_plan_are_spares_in_join_order():
    placement = place([offered(i) for i in range(5)], FirstPlan(6, 3), footprint)
    assert [g.member for g in placement.given] == [0, 1, 2]
    assert placement.spares == [3, 4]


def test_a_first_plan_no_split_fits_is_a_plan_error_naming_the_short_worker():
    # Together they hold 2 + 1 + 1 of the 6 layers.
    members = [offered(0, memory_bytes=250), offered(1, memory_bytes=150), offered(2, memory_bytes=150)]
    with pytest.raises(PlanError) as raised:
        place(members, FirstPlan(6, 3), footprint)
    said = str(raised.value)
    assert "the 3 workers cannot hold the model's 6 layers in any split" in said
    assert "worker 10.0.0.1:7000 has 150 B free, its even share (layers 2..4) needs 200 B" in said
    assert "worker 10.0.0.2:7000 has 150 B free, its even share (layers 4..6) needs 200 B" in said
    assert "10.0.0.0" not in said, "a worker that holds its share is not named short"


def test_a_vacancy_is_refilled_by_exactly_its_range_by_the_first_worker_that_can_hold_it():
    members = [offered(0, memory_bytes=150), offered(1), offered(2)]
    placement = place(members, [Vacancy(1, LayerRange(2, 4))], footprint)
    assert placement.given == [Given(1, 1, LayerRange(2, 4))]
    assert placement.spares == [0, 2]


def test_each_vacancy_takes_its_own_worker_and_one_nobody_can_hold_stays_open():
    members = [offered(0, memory_bytes=250), offered(1, memory_bytes=250)]
    vacancies = [Vacancy(0, LayerRange(0, 3)), Vacancy(1, LayerRange(3, 5)), Vacancy(2, LayerRange(5, 6))]
    placement = place(members, vacancies, footprint)
    assert placement.given == [Given(0, 1, LayerRange(3, 5)), Given(1, 2, LayerRange(5, 6))]
    assert placement.spares == []


def test_with_no_vacancy_every_waiting_worker_is_a_spare():
    assert place([offered(0), offered(1)], [], footprint) == Placement(given=[], spares=[0, 1])


def test_a_first_plan_passes_over_an_early_worker_with_no_memory_and_leaves_it_a_spare():
    members = [offered(0, memory_bytes=0)] + [offered(i) for i in range(1, 7)]
    placement = place(members, FirstPlan(6, 3), footprint)
    assert placement.given == [Given(1, 0, LayerRange(0, 2)), Given(2, 1, LayerRange(2, 4)),
                               Given(3, 2, LayerRange(4, 6))]  # fmt: skip
    assert placement.spares == [0, 4, 5, 6]


def test_a_first_plan_by_cost_passes_over_a_worker_with_no_memory_too():
    members = [offered(0, memory_bytes=0)] + [offered(i) for i in range(1, 4)]
    placement = place(members, FirstPlan(6, 3), footprint, [1.0, 1.0, 1.0, 1.0, 8.0, 1.0])
    assert [g.member for g in placement.given] == [1, 2, 3]
    assert ranges(placement) == [LayerRange(0, 4), LayerRange(4, 5), LayerRange(5, 6)]
    assert placement.spares == [0]


def test_of_two_workers_too_short_together_the_later_makes_way_and_the_earlier_keeps_what_it_can_hold():
    # Each of the first two holds one of the 6 layers: with the third, a split by memory fits.
    members = [offered(0, memory_bytes=150), offered(1, memory_bytes=150), offered(2), offered(3)]
    placement = place(members, FirstPlan(6, 2), footprint)
    assert placement.given == [Given(0, 0, LayerRange(0, 1)), Given(2, 1, LayerRange(1, 6))]
    assert placement.spares == [1, 3]


def test_a_first_plan_nobody_who_joined_can_make_is_still_a_plan_error_naming_who_is_short():
    members = [offered(i, memory_bytes=150) for i in range(4)]
    with pytest.raises(PlanError, match="the 3 workers cannot hold the model's 6 layers in any split"):
        place(members, FirstPlan(6, 3), footprint)


# ---------------------------------------------------------------- by the members' measurements

SHAPE = ModelShape("synthetic:layers=6", 6, 16, 1, 1, 16, 16, layer_bytes=(100,) * 6)


def measured_host(i: int, layer_ms: float, latency_ms: float = 0.1) -> Host:
    """The host member i's measurements make: every layer `layer_ms`, a fast link."""
    costs = Offer(**{**msgspec.structs.asdict(offered(i)), "layer_ms": [layer_ms] * 6})
    host = host_of(costs, (latency_ms, 1e9), 6)
    assert host is not None
    return host


def test_members_that_measured_get_layers_in_proportion_to_their_speed_for_throughput():
    hosts = [measured_host(0, 3.0), measured_host(1, 1.0)]
    placement = place([offered(0), offered(1)], FirstPlan(6, 2), footprint,
                      measured=Measured(SHAPE, hosts, "throughput"))  # fmt: skip
    # 3 ms a layer against 1 ms: the slow one's 1.5 layers' worth rounds to the split 2 | 4 or 1 | 5,
    # of which the busiest stage is least at (slow 1 layer: 3 ms, fast 5: 5 ms) or (2: 6, 4: 4): 1 | 5.
    assert sorted((g.member, len(g.layers)) for g in placement.given) == [(0, 1), (1, 5)]
    assert placement.how.startswith("placed by measured speed, memory and link (throughput)")


def test_a_member_too_slow_to_help_waits_as_a_spare_saying_why():
    hosts = [measured_host(0, 1.0), measured_host(1, 20.0), measured_host(2, 1.0)]
    placement = place([offered(i) for i in range(3)], FirstPlan(6, 2), footprint,
                      measured=Measured(SHAPE, hosts))  # fmt: skip
    assert sorted(g.member for g in placement.given) == [0, 2]
    assert placement.spares == [1]
    assert placement.why[1].startswith("too slow to help: the best plan that uses it takes")


def test_one_member_without_measurements_makes_the_first_plan_the_even_split_saying_who():
    hosts = [measured_host(0, 3.0), None]
    placement = place([offered(0), offered(1)], FirstPlan(6, 2), footprint, measured=Measured(SHAPE, hosts))
    assert ranges(placement) == [LayerRange(0, 3), LayerRange(3, 6)]
    assert "worker 10.0.0.1:7000 did not measure its layers or link" in placement.how


def test_measurements_of_another_layer_count_or_not_finite_are_no_host():
    assert (
        host_of(Offer(**{**msgspec.structs.asdict(offered(0)), "layer_ms": [1.0] * 5}), (0.1, 1e9), 6) is None
    )
    nan = Offer(**{**msgspec.structs.asdict(offered(0)), "layer_ms": [float("nan")] * 6})
    assert host_of(nan, (0.1, 1e9), 6) is None
    assert host_of(offered(0), None, 6) is None
