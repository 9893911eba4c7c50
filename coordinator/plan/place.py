"""Place joined workers: who builds which stage's layers, and who waits as a spare.

A pure function of what the workers offered (in join order), what the
pipeline lacks (its first plan, or the vacancies a departed worker left) and
the model's footprint; the join listener applies its answer over the wire.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from coordinator.plan.split import Holder, PlanError, split_by_cost, split_by_memory
from workers.models.footprint import Footprint
from workers.protocol.report import LayerRange
from workers.protocol.wire import Offer


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
    """

    given: list[Given]
    spares: list[int]


def member_name(offer: Offer) -> str:
    """How a person knows a joined worker: by the address it serves at."""
    return f"worker {offer.addr}"


def place(
    members: Sequence[Offer],
    stages: FirstPlan | Sequence[Vacancy],
    footprint: Callable[[str], Footprint],
    costs: Sequence[float] = (),
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
    can hold stays open.
    """
    if isinstance(stages, FirstPlan):
        given = _first_plan(members, stages, footprint, costs)
    else:
        given = _refill(members, stages, footprint)
    taken = {g.member for g in given}
    return Placement(given, [i for i in range(len(members)) if i not in taken])


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
