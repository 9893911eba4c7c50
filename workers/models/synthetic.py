"""A synthetic model: seeded random residual MLP layers, deterministic, no download.

Layer i's weights depend only on (seed, i), so any split of the layers into
stages computes exactly the same function as one process holding them all.
`slow=A..B,slow_ms=D` makes layers A..B each spin for D ms of CPU time per
forward (same output), for testing a planner that balances measured cost;
`stage_ms=F` makes every stage spin F ms per forward, whatever its layers (a
stage's fixed cost, as a real one has, for testing calibration).
"""

from __future__ import annotations

import time
from typing import Annotated

import msgspec
import numpy as np

from workers.models.ops import rms_norm, silu
from workers.protocol.info import ModelInfo
from workers.protocol.report import LayerRange
from workers.spec import ModelSpecError
from workers.stage import StatelessStage, check_hidden

EPS = np.float32(1e-5)
Size = Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]


class SyntheticModel(msgspec.Struct, frozen=True):
    """The model a `synthetic[:layers=N,hidden=H,seed=S]` spec names.

    name: the spec as given.
    layers: layers in the whole model.
    hidden: width of the activations.
    seed: what every layer's weights are drawn from.
    slow: layers `A..B` that spin `slow_ms` each per forward ("" for none).
    slow_ms: the CPU time each slow layer spends spinning.
    stage_ms: the CPU time every stage spends spinning per forward, beyond its layers.
    """

    name: str
    layers: Size = 8
    hidden: Size = 256
    seed: int = 0
    slow: str = ""
    slow_ms: Annotated[float, msgspec.Meta(ge=0, le=60_000)] = 20.0
    stage_ms: Annotated[float, msgspec.Meta(ge=0, le=60_000)] = 0.0

    def __post_init__(self) -> None:
        self.slow_layers()  # a bad range fails when the spec is parsed

    def slow_layers(self) -> range:
        """The layers that sleep, checked to lie within the model."""
        if not self.slow:
            return range(0)
        try:
            slow = LayerRange.parse(self.slow)
        except ValueError as exc:
            raise ModelSpecError(f"model spec {self.name!r}: slow: {exc}") from None
        if slow.end > self.layers:
            raise ModelSpecError(
                f"model spec {self.name!r}: slow layers {slow} lie beyond its {self.layers} layers"
            )
        return range(slow.start, slow.end)

    def describe(self) -> ModelInfo:
        """The synthetic model's shape: hidden states in, hidden states out."""
        return ModelInfo(name=self.name, n_layers=self.layers, input="hidden", hidden=self.hidden)

    def build(self, layers: LayerRange, precision: str) -> SyntheticStage:
        """Draw the weights of `layers`."""
        return SyntheticStage(self, layers, precision)


def make_input(seq: int, hidden: int, seed: int) -> np.ndarray:
    """A deterministic input of shape (seq, hidden) for a synthetic run."""
    return np.random.default_rng(seed).standard_normal((seq, hidden), dtype=np.float32)


def layer_weights(seed: int, index: int, hidden: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The norm weight, up and down projections of layer `index`."""
    rng = np.random.default_rng([seed, index])
    ffn = 2 * hidden
    norm = (1.0 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
    up = (rng.standard_normal((hidden, ffn)) / np.sqrt(hidden)).astype(np.float32)
    down = (rng.standard_normal((ffn, hidden)) / np.sqrt(ffn)).astype(np.float32)
    return norm, up, down


def _spin(seconds: float) -> None:
    """Keep this thread computing for `seconds` of its CPU time: a cost CPU time counts (a sleep is not)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class SyntheticStage(StatelessStage):
    """Layers `start..end` of the synthetic model: x + down(silu(up(norm(x))))."""

    def __init__(self, model: SyntheticModel, layers: LayerRange, precision: str) -> None:
        if precision != "f32":
            raise ValueError(f"synthetic model computes in f32 only, not {precision!r}")
        self.info = model.describe()
        self.layers = layers
        self.precision = precision
        self.n_packed = 0
        self.weights = [layer_weights(model.seed, i, model.hidden) for i in range(layers.start, layers.end)]
        self.n_params = sum(w.size for ws in self.weights for w in ws)
        slow = model.slow_layers()
        self.spins = [model.slow_ms / 1000 if i in slow else 0.0 for i in range(layers.start, layers.end)]
        self.fixed = model.stage_ms / 1000

    def forward(self, x: np.ndarray, *, session: str, start_pos: int, last_only: bool) -> np.ndarray:
        """Apply this stage's layers to activations of shape (T, hidden)."""
        x = check_hidden(x, self.info.hidden, self.layers)
        if self.fixed:
            _spin(self.fixed)
        for (norm, up, down), spin in zip(self.weights, self.spins, strict=True):
            x = x + silu(rms_norm(x, norm, EPS) @ up) @ down
            if spin:
                _spin(spin)
        return x[-1:] if last_only and self.layers.is_last(self.info.n_layers) else x
