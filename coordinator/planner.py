"""Split a model's layers into contiguous stages: evenly, or to fit the workers' memory."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from workers.report import LayerRange


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


def size_text(n_bytes: int) -> str:
    """Bytes for a person, in decimal units: 512 B, 65.8 kB, 538 MB, 1.2 GB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n_bytes >= scale:
            value = n_bytes / scale
            return f"{value:.1f} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{n_bytes} B"
