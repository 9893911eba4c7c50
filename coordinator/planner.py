"""Split a model's layers into contiguous stages."""

from __future__ import annotations

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
