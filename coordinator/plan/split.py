"""Split a model's layers into contiguous stages: evenly, to fit the workers' memory, or by measured cost."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from coordinator.units import size_text
from workers.models.quants import ROWS
from workers.protocol.report import HeadRows, LayerRange

# The last stage's (cost, Σ cost²) from its layers' cost: what follows its layers counted in.
Tail = Callable[[float], tuple[float, float]]


class PlanError(ValueError):
    """A split that cannot be made."""


def split(n_layers: int, stages: int) -> list[LayerRange]:
    """Contiguous ranges covering 0..n_layers; sizes differ by at most one, larger first."""
    if stages < 1:
        raise PlanError(f"need at least 1 stage, got {stages}")
    if n_layers < 1:
        raise PlanError(f"the model has no layers to split ({n_layers})")
    if stages > n_layers:
        raise PlanError(f"cannot split {n_layers} layers into {stages} stages: at most {n_layers}")
    size, extra = divmod(n_layers, stages)
    ranges, start = [], 0
    for i in range(stages):
        end = start + size + (1 if i < extra else 0)
        ranges.append(LayerRange(start, end))
        start = end
    return ranges


@dataclass(frozen=True)
class Holder:
    """A worker that may hold a stage.

    name: how a person knows it, e.g. "worker 10.0.0.2:40123".
    free_bytes: memory it can give its stage.
    cost: bytes it would hold for a range (its precision decides).
    """

    name: str
    free_bytes: int
    cost: Callable[[LayerRange], int]

    def fits(self, layers: LayerRange) -> bool:
        return self.cost(layers) <= self.free_bytes


def split_by_memory(n_layers: int, holders: list[Holder]) -> list[LayerRange]:
    """One contiguous range per holder, in their order, each within its holder's memory.

    An even split (as `split`) when every holder can take its share; else
    ranges as near as they can fit to shares in proportion to the holders'
    memory; else a PlanError naming who is short.
    """
    even = split(n_layers, len(holders))
    if all(h.fits(r) for h, r in zip(holders, even, strict=True)):
        return even
    ends = _fitting_ends(n_layers, holders)
    if not ends[0][0]:
        raise PlanError(_shortage(n_layers, holders, even))
    total_free = sum(h.free_bytes for h in holders) or 1
    ranges, start, share = [], 0, 0
    for i, holder in enumerate(holders):
        share += holder.free_bytes
        target = n_layers * share / total_free
        end = min(ends[i][start], key=lambda e: abs(e - target))
        ranges.append(LayerRange(start, end))
        start = end
    return ranges


@dataclass(frozen=True)
class Head:
    """The head as a planner may cut its rows across stages.

    rows: its rows (the vocabulary). ms: a decode step through all of them (the final norm is the last
    layer's cost). group: a cut falls on a multiple of this many rows, the rows a packed kernel computes
    side by side, so that no stage computes a group of which it keeps only some.
    """

    rows: int
    ms: float
    group: int = ROWS

    def __post_init__(self) -> None:
        if self.rows < 1 or self.group < 1 or not (math.isfinite(self.ms) and self.ms >= 0):
            raise PlanError(f"bad head: {self.rows} rows costing {self.ms!r} ms, cut by {self.group}")

    def row_ms(self, rows: int) -> float:
        """What `rows` of the head cost."""
        return self.ms * rows / self.rows


# A cut head sends the logits so far on a hop more (1 MB a token for a 262k vocabulary), so it is cut
# only where that makes the slowest stage cheaper by more than this share of it.
CUT_GAIN = 0.02


def split_by_cost(
    costs: Sequence[float], stages: int, holders: Sequence[Holder] = (), head: Head | None = None
) -> list[LayerRange]:
    """Contiguous ranges whose costliest stage costs least; among those, the most even; each fits its holder.

    costs: what each layer costs (e.g. decode ms per token); a stage costs the
    sum of its layers'. holders: one per stage, in order, when memory limits
    the split; none when it does not. A PlanError when no split fits.
    head: the head, when costs[-1] leaves it out: its rows go whole on the last layer's stage, or, when
    that makes the slowest stage cheaper (and no holders limit the split), are cut across that stage
    and stages of head rows after it.
    """
    n_layers = len(costs)
    even = split(n_layers, stages)
    if holders and len(holders) != stages:
        raise PlanError(f"{len(holders)} workers for {stages} stages: need one worker per stage")
    bad = next((i for i, c in enumerate(costs) if not (math.isfinite(c) and c >= 0)), None)
    if bad is not None:
        raise PlanError(f"layer {bad} has cost {costs[bad]!r}: costs must be finite and at least 0")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    whole = _whole_head(head)
    fits = _fits_table(n_layers, holders) if holders else None
    least = _least_largest(prefix, stages, fits, whole)
    if math.isinf(least):
        raise PlanError(_shortage(n_layers, list(holders), even))
    ranges = _most_even_under(prefix, stages, _bound(least), fits, whole)
    if head is None or holders or stages < 2:
        return ranges
    cut = min((_cut_head(costs, prefix, stages, j, head) for j in range(1, stages)), key=lambda c: c[0])
    return cut[1] if cut[0] < least * (1 - CUT_GAIN) else ranges


def _bound(least: float) -> float:
    # Measured costs tie rarely, but an even bound for every stage keeps the rest balanced too.
    return least * (1 + 1e-9) + 1e-12


def _whole_head(head: Head | None) -> Callable[[float], tuple[float, float]]:
    """The last stage's (cost, Σ cost²) from its layers' cost, with the whole head on it."""
    ms = 0.0 if head is None else head.ms
    return lambda c: (c + ms, (c + ms) ** 2)


def _cut_head(
    costs: Sequence[float], prefix: list[float], stages: int, after: int, head: Head
) -> tuple[float, list[LayerRange]]:
    """The best split with the head cut over the last layer's stage and `after` stages of head rows only.

    Its costliest stage's cost, and the split. The last layer's stage takes at least a group of rows;
    the head's stages share what is left of it as evenly as groups allow.
    """
    n_layers, share = len(prefix) - 1, after + 1
    groups = -(-head.rows // head.group)
    if stages - after > n_layers or groups < share:
        return math.inf, []
    least_rows = head.row_ms(head.group)

    def tail(c: float) -> tuple[float, float]:  # the last layer's stage and the head's stages after it
        top = max((c + head.ms) / share, c + least_rows)
        rest = (c + head.ms - top) / after
        return max(top, rest), top * top + after * rest * rest

    least = _least_largest(prefix, stages - after, None, tail)
    ranges = _most_even_under(prefix, stages - after, _bound(least), None, tail)
    last = ranges[-1]
    c = prefix[n_layers] - prefix[last.start]
    top = max((c + head.ms) / share, c + least_rows)
    # Row boundaries in groups: the last layer's stage takes what is left of its share after its
    # layers, the head's stages the rest in equal parts.
    first = min(max(1, round((top - c) / head.ms * groups)) if head.ms else 1, groups - after)
    ends = [first + round(k * (groups - first) / after) for k in range(after + 1)]
    rows = [min(e * head.group, head.rows) for e in ends]
    cut = [LayerRange(last.start, n_layers, HeadRows(0, rows[0]))]
    cut += [LayerRange(n_layers, n_layers, HeadRows(a, b)) for a, b in itertools.pairwise(rows)]
    split_ = [*ranges[:-1], *cut]
    return max(stage_costs(costs, split_, head=head)), split_


def stage_costs(
    costs: Sequence[float], ranges: Sequence[LayerRange], fixed: float = 0.0, head: Head | None = None
) -> list[float]:
    """What each stage costs: the sum of its layers' costs and its head rows', plus what any stage costs.

    head: the head, when costs[-1] leaves it out: the whole of it counts on the last layer's stage when
    the head is not cut, else each stage counts its rows'.
    """
    n_layers = len(costs)

    def rows(r: LayerRange) -> float:
        if head is None or r.end != n_layers:
            return 0.0
        return head.ms if r.head is None else head.row_ms(len(r.head))

    return [fixed + sum(costs[r.start : r.end]) + rows(r) for r in ranges]


def _fits_table(n_layers: int, holders: Sequence[Holder]) -> list[list[list[bool]]]:
    """fit[i][s][e]: whether holder i can hold layers s..e."""
    return [[[e > s and h.fits(LayerRange(s, e)) for e in range(n_layers + 1)] for s in range(n_layers + 1)]
            for h in holders]  # fmt: skip


def _least_largest(
    prefix: list[float], stages: int, fits: list[list[list[bool]]] | None, tail: Tail
) -> float:
    """The least cost of the costliest stage over every split that fits (inf when none does).

    tail: the last stage's (cost, Σ cost²) from its layers' cost (what follows them counted in).
    """
    n_layers = len(prefix) - 1
    # worst[s]: for the holders from i on, starting at layer s; built from the last holder back.
    worst = [tail(prefix[n_layers] - prefix[s])[0] if fits is None or fits[-1][s][n_layers] else math.inf
             for s in range(n_layers + 1)]  # fmt: skip
    for i in range(stages - 2, -1, -1):
        worst = [min((max(prefix[e] - prefix[s], worst[e])
                      for e in range(s + 1, n_layers - (stages - 2 - i))
                      if fits is None or fits[i][s][e]), default=math.inf)
                 for s in range(n_layers + 1)]  # fmt: skip
    return worst[0]


def _most_even_under(
    prefix: list[float], stages: int, bound: float, fits: list[list[list[bool]]] | None, tail: Tail
) -> list[LayerRange]:
    """The split with the least sum of squared stage costs among those whose every stage costs <= bound.

    Ties (layers that cost nothing, or the same) go to the least sum of squared
    layer counts, then to larger stages first, as `split` has them.
    """
    n_layers = len(prefix) - 1

    def allowed(i: int, s: int, e: int) -> bool:
        return prefix[e] - prefix[s] <= bound and (fits is None or fits[i][s][e])

    def last(s: int) -> tuple[float, int]:
        worst, squared = tail(prefix[n_layers] - prefix[s])
        fit = worst <= bound and (fits is None or fits[-1][s][n_layers])
        return (squared, (n_layers - s) ** 2) if fit else (math.inf, 0)

    # squares[s]: (Σ cost², Σ layers²) of the best split of s..n among the holders from i on.
    squares = [last(s) for s in range(n_layers + 1)]
    ends: list[list[int]] = [[n_layers] * (n_layers + 1)]
    tie = 1e-9 * (tail(prefix[n_layers])[0] ** 2 + 1)
    for i in range(stages - 2, -1, -1):
        best, chosen = [(math.inf, 0)] * (n_layers + 1), [0] * (n_layers + 1)
        for s in range(n_layers + 1):
            for e in range(n_layers - (stages - 1 - i), s, -1):
                if not allowed(i, s, e):
                    continue
                value = ((prefix[e] - prefix[s]) ** 2 + squares[e][0], (e - s) ** 2 + squares[e][1])
                if value[0] < best[s][0] - tie or (value[0] <= best[s][0] + tie and value[1] < best[s][1]):
                    best[s], chosen[s] = value, e
        squares = best
        ends.insert(0, chosen)
    ranges, start = [], 0
    for i in range(stages):
        ranges.append(LayerRange(start, ends[i][start]))
        start = ranges[-1].end
    return ranges


def _fitting_ends(n_layers: int, holders: list[Holder]) -> list[list[list[int]]]:
    """ends[i][s]: where holder i may end when it starts at layer s, leaving a split that fits to the rest.

    Built from the last holder back; an empty list means no such split.
    """
    count = len(holders)
    ends = [[[] for _ in range(n_layers + 1)] for _ in range(count)]
    for i in range(count - 1, -1, -1):
        for s in range(i, n_layers - (count - 1 - i)):  # each holder before and after keeps a layer
            ends[i][s] = [e for e in range(s + 1, n_layers + 1)
                          if (e == n_layers if i == count - 1 else bool(ends[i + 1][e]))
                          and holders[i].fits(LayerRange(s, e))]  # fmt: skip
    return ends


def _shortage(n_layers: int, holders: list[Holder], even: list[LayerRange]) -> str:
    """Why no split fits: who cannot hold an even share, and how much memory there is against the need."""
    short = [f"{h.name} has {size_text(h.free_bytes)} free, "
             f"its even share (layers {r}) needs {size_text(h.cost(r))}"
             for h, r in zip(holders, even, strict=True) if not h.fits(r)]  # fmt: skip
    need = min(h.cost(LayerRange(0, n_layers)) for h in holders)
    free = sum(h.free_bytes for h in holders)
    return (
        f"the {len(holders)} workers cannot hold the model's {n_layers} layers in any split: "
        f"{'; '.join(short)} (together {size_text(free)} free, the model needs about {size_text(need)})"
    )
