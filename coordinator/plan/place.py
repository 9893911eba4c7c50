"""Place joined workers: who builds which stage's layers, and who waits as a spare.

A pure function of what the workers offered (in join order), what the
pipeline lacks (its first plan, or the vacancies a departed worker left) and
the model's footprint; the join listener applies its answer over the wire.

When every member waiting for the first plan measured itself (its layer
costs, timed on its own host) and its link (timed by the coordinator), the
first plan is `plan_hosts`' over them, for exactly the pipeline's stages:
which members serve, in which order, with which layers, by speed, memory and
link; a member it leaves out is a spare with the reason. Without those
measurements for every one (an older worker), it is the even or memory split
below, and the placement says why.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from coordinator.plan.costmodel import CostModelError, ModelShape, from_spec
from coordinator.plan.hosts import Host
from coordinator.plan.placement import EXACT_HOSTS, REFERENCE, HostPlan, PlannedStage, plan_hosts
from coordinator.plan.split import Holder, PlanError, split_by_cost, split_by_memory
from workers.calibrate import Costs
from workers.models.footprint import Footprint
from workers.protocol.info import ModelInfo
from workers.protocol.messages import Offer
from workers.protocol.report import LayerRange


@dataclass(frozen=True)
class FirstPlan:
    """No stage has been given yet: split the model's layers among the first workers to join.

    n_layers: the model's layers.
    stages: how many stages, each to one worker.
    """

    n_layers: int
    stages: int


@dataclass(frozen=True)
class Vacancy:
    """A stage that lost its worker: it is refilled by exactly its range.

    stage: the stage's index in the pipeline.
    layers: the range it holds.
    """

    stage: int
    layers: LayerRange


@dataclass(frozen=True)
class Given:
    """One worker told to build one stage.

    member: the worker's index among the members placed.
    stage: the stage's index in the pipeline.
    layers: the range to build.
    """

    member: int
    stage: int
    layers: LayerRange


@dataclass(frozen=True)
class Placement:
    """What `place` decided.

    given: the workers given a stage, in stage order.
    spares: the indices of the workers given nothing, in join order.
    why: for some spares, why they were left out (by index).
    how: how the plan was made, for a person ("" for a refill).
    """

    given: list[Given]
    spares: list[int]
    why: dict[int, str] = field(default_factory=dict)
    how: str = ""


# A first plan of joined workers: by their measurements (minimizing one of placement.OBJECTIVES), or
# EVEN: split evenly (or by memory) in join order, their measurements only used to predict its speed.
EVEN = "even"
JOIN_PLANS = ("latency", "throughput", EVEN)


@dataclass(frozen=True)
class Measured:
    """What the members measured, for a first plan by speed, memory and link.

    shape: the model's shape (its layers' bytes for memory, its hops' bytes).
    hosts: per member (in join order), the host its measurements make; None for one without.
    objective: what the plan minimizes (coordinator.plan.placement.OBJECTIVES), or EVEN.
    """

    shape: ModelShape
    hosts: Sequence[Host | None]
    objective: str = "latency"


def speed_view(offer: Offer) -> dict | None:
    """A member's measured speed, for /nodes: its decode step through every layer, as it timed it."""
    if not offer.layer_ms:
        return None
    return {"decode_ms": round(sum(offer.layer_ms) + offer.stage_ms, 3), "stage_ms": offer.stage_ms,
            "calibration": offer.calibration, "cpu_share": offer.cpu_share or None}  # fmt: skip


def host_of(offer: Offer, link: tuple[float, float] | None, n_layers: int) -> Host | None:
    """The host a member's measurements (and its link's (round trip ms, bytes/s)) make; None if unusable."""
    ms = offer.layer_ms
    if link is None or len(ms) != n_layers or not all(math.isfinite(v) for v in (*ms, offer.stage_ms)):
        return None
    costs = Costs(layers=list(ms), precision=offer.precision, stage_ms=offer.stage_ms)
    return Host(member_name(offer), offer.cores, offer.memory_bytes, measured=costs, latency_ms=link[0],
                bandwidth=link[1], cpu_share=offer.cpu_share)  # fmt: skip


def shape_of(spec: str, info: ModelInfo, held: Footprint) -> ModelShape:
    """The model's shape for the planner: from its GGUF file, else (synthetic, fake) from its footprint."""
    try:
        return from_spec(spec)
    except CostModelError:
        pass
    vocab = info.vocab or info.hidden  # a model of hidden rows sends hidden rows back from its last stage
    return ModelShape(spec, info.n_layers, info.hidden, 1, 1, info.hidden, vocab,
                      layer_bytes=tuple(held.layers), head_bytes=held.head)  # fmt: skip


def member_name(offer: Offer) -> str:
    """How a person knows a joined worker: by the address it serves at."""
    return f"worker {offer.addr}"


def place(
    members: Sequence[Offer],
    stages: FirstPlan | Sequence[Vacancy],
    footprint: Callable[[str], Footprint],
    costs: Sequence[float] = (),
    measured: Measured | None = None,
) -> Placement:
    """Give the stages that lack a worker to the members, in the order they joined.

    members: what each waiting worker offered, in join order.
    stages: the first plan, or the vacancies (in stage order) of a pipeline planned before.
    footprint: the model's footprint in a precision (each member's own).
    costs: each layer's measured cost; with them the first plan balances
        those (within memory) instead of splitting evenly.

    A first plan waits (gives nothing) until there are as many members as
    stages, then plans over all of them: the first `stages` in join order get
    a stage each, in order: evenly, by memory when one cannot hold an even
    share, or by cost. When no split fits them, the one of them that can hold
    the least of the model gives its place to the next member to have joined,
    until a split fits (the members passed over are spares) or nobody is left
    to try; then a PlanError names who is short among the last tried. A
    vacancy goes to the first member that can hold its range; one that nobody
    can hold stays open. With `measured` (see the module's docstring) the
    first plan places by it when every member measured; when its objective
    is EVEN, the first plan is the split above, and its `how` the speed the
    measurements predict of it.
    """
    how = ""
    if isinstance(stages, FirstPlan):
        if measured is not None and measured.objective == EVEN:
            given = _first_plan(members, stages, footprint, costs)
            taken = {g.member for g in given}
            spares = [i for i in range(len(members)) if i not in taken]
            return Placement(given, spares, how=_predicted_even(measured, given) if given else "")
        if measured is not None and len(members) >= stages.stages:
            unmeasured = [member_name(m) for m, h in zip(members, measured.hosts, strict=True) if h is None]
            if not unmeasured:
                return _by_measure(measured, stages)
            split = "by cost" if costs else "evenly or by memory"
            how = (f"split {split}, not by measured speed: {', '.join(unmeasured)} did not "
                   "measure its layers or link (an older rlx-worker?)")  # fmt: skip
        given = _first_plan(members, stages, footprint, costs)
    else:
        given = _refill(members, stages, footprint)
    taken = {g.member for g in given}
    return Placement(given, [i for i in range(len(members)) if i not in taken], how=how)


def _by_measure(measured: Measured, plan: FirstPlan) -> Placement:
    """The first plan by `plan_hosts` over the members' measurements, for exactly the pipeline's stages."""
    hosts = list(measured.hosts)
    assert all(h is not None for h in hosts)
    # The exact plan weighs up to EXACT_HOSTS hosts; beyond, the ones fastest through the whole model.
    whole = [h.costs(measured.shape, REFERENCE) for h in hosts]
    order = sorted(range(len(hosts)), key=lambda i: sum(whole[i].weights_ms) + sum(whole[i].row_ms))
    weighed = sorted(order[:EXACT_HOSTS])
    why = {i: f"not weighed: the plan weighs the {EXACT_HOSTS} fastest members" for i in order[EXACT_HOSTS:]}
    planned = plan_hosts(
        [hosts[i] for i in weighed], measured.shape, objective=measured.objective, stages=plan.stages
    )
    index = {id(hosts[i]): i for i in weighed}
    given = [Given(index[id(s.host)], stage, s.layers) for stage, s in enumerate(planned.stages)]
    why |= {index[id(host)]: reason for host, reason in planned.spares}
    taken = {g.member for g in given}
    how = (f"placed by measured speed, memory and link ({planned.objective}): predicted "
           f"{planned.decode_ms():.2f} ms a decode step, its slowest stage "
           f"{planned.slowest_ms():.2f} ms")  # fmt: skip
    return Placement(given, [i for i in range(len(hosts)) if i not in taken], why, how)


def _predicted_even(measured: Measured, given: list[Given]) -> str:
    """How an even split was made, with its speed as the members' measurements predict it."""
    hosts = [measured.hosts[g.member] for g in given]
    if any(h is None for h in hosts):
        return "split evenly or by memory (asked for), in join order"
    shape = measured.shape
    planned = HostPlan([PlannedStage(h, g.layers, h.costs(shape, REFERENCE), shape.in_bytes(g.stage == 0, 1),
                        shape.out_bytes(g.layers.end == shape.n_layers, 1)) for h, g in zip(hosts, given,
                        strict=True)], [], "latency", exact=True)  # fmt: skip
    return (f"split evenly or by memory (asked for), in join order: predicted {planned.decode_ms():.2f} ms "
            f"a decode step, its slowest stage {planned.slowest_ms():.2f} ms")  # fmt: skip


def _first_plan(
    members: Sequence[Offer], plan: FirstPlan, footprint: Callable[[str], Footprint], costs: Sequence[float]
) -> list[Given]:
    if len(members) < plan.stages:
        return []
    if costs and len(costs) != plan.n_layers:
        raise PlanError(f"{len(costs)} measured layer costs for a model of {plan.n_layers} layers")
    holders = [_holder(m, footprint) for m in members]

    def fitting(chosen: list[Holder]) -> list[LayerRange]:
        if costs:
            return split_by_cost(costs, plan.stages, chosen)
        return split_by_memory(plan.n_layers, chosen)

    def share(i: int) -> float:
        """How much of the whole model member i can hold."""
        return holders[i].free_bytes / max(1, holders[i].cost(LayerRange(0, plan.n_layers)))

    tried, untried = list(range(plan.stages)), list(range(plan.stages, len(members)))
    while True:
        try:
            ranges = fitting([holders[i] for i in tried])
            pairs = zip(tried, ranges, strict=True)
            return [Given(i, stage, layers) for stage, (i, layers) in enumerate(pairs)]
        except PlanError:
            if not untried:
                raise
        # The one holding the least makes way for the next to have joined (of equals, the later goes).
        tried.remove(min(reversed(tried), key=share))
        tried.append(untried.pop(0))  # joined after every one tried: stage order stays join order


def _refill(
    members: Sequence[Offer], vacancies: Sequence[Vacancy], footprint: Callable[[str], Footprint]
) -> list[Given]:
    holders = [_holder(m, footprint) for m in members]
    free = list(range(len(members)))
    given = []
    for vacancy in vacancies:
        fit = next((i for i in free if holders[i].fits(vacancy.layers)), None)
        if fit is not None:
            free.remove(fit)
            given.append(Given(fit, vacancy.stage, vacancy.layers))
    return given


def _holder(offer: Offer, footprint: Callable[[str], Footprint]) -> Holder:
    return Holder(member_name(offer), offer.memory_bytes, footprint(offer.precision).stage_bytes)
