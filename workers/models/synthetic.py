"""A synthetic model: seeded random residual MLP layers, deterministic, no download.

Layer i's weights depend only on (seed, i), so any split of the layers into
stages computes exactly the same function as one process holding them all.
"""

from __future__ import annotations

import numpy as np

from workers.models import parse_options
from workers.report import LayerRange
from workers.stage import ModelInfo, StageError

OPTIONS = {"layers": int, "hidden": int, "seed": int}
DEFAULTS = {"layers": 8, "hidden": 256, "seed": 0}
EPS = 1e-5


def _options(spec: str) -> dict[str, int]:
    options = DEFAULTS | parse_options(spec, OPTIONS)
    for key, value in options.items():
        if key != "seed" and not 0 < value <= 1 << 16:
            raise ValueError(f"synthetic model: {key}={value} must be in 1..65536")
    return options  # type: ignore[return-value]


def describe(spec: str) -> ModelInfo:
    """Describe the synthetic model named by `spec`."""
    o = _options(spec)
    return ModelInfo(name=spec, n_layers=o["layers"], input="hidden", hidden=o["hidden"])


def make_input(seq: int, hidden: int, seed: int) -> np.ndarray:
    """A deterministic input of shape (seq, hidden) for a synthetic run."""
    return np.random.default_rng(seed).standard_normal((seq, hidden), dtype=np.float32)


def rms_norm(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """Scale each row to unit root-mean-square, then by `weight`."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * weight


def silu(x: np.ndarray) -> np.ndarray:
    """x · sigmoid(x)."""
    return x / (1.0 + np.exp(-x))


def layer_weights(seed: int, index: int, hidden: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The norm weight, up and down projections of layer `index`."""
    rng = np.random.default_rng([seed, index])
    ffn = 2 * hidden
    norm = (1.0 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
    up = (rng.standard_normal((hidden, ffn)) / np.sqrt(hidden)).astype(np.float32)
    down = (rng.standard_normal((ffn, hidden)) / np.sqrt(ffn)).astype(np.float32)
    return norm, up, down


class SyntheticStage:
    """Layers `start..end` of the synthetic model: x + down(silu(up(norm(x))))."""

    def __init__(self, info: ModelInfo, spec: str, layers: LayerRange, precision: str) -> None:
        if precision != "f32":
            raise ValueError(f"synthetic model computes in f32 only, not {precision!r}")
        o = _options(spec)
        self.info = info
        self.layers = layers
        self.precision = precision
        self.n_packed = 0
        self.weights = [layer_weights(o["seed"], i, o["hidden"]) for i in range(layers.start, layers.end)]
        self.n_params = sum(w.size for ws in self.weights for w in ws)

    def forward(self, x: np.ndarray, *, session: str, start_pos: int, last_only: bool) -> np.ndarray:
        """Apply this stage's layers to activations of shape (T, hidden)."""
        if x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != self.info.hidden:
            raise StageError(
                f"synthetic stage expects float32 (T, {self.info.hidden}), got {x.dtype} {x.shape}"
            )
        for norm, up, down in self.weights:
            x = x + silu(rms_norm(x, norm) @ up) @ down
        return x[-1:] if last_only and self.layers.end == self.info.n_layers else x

    def reset(self, session: str) -> None:
        """Nothing is held per session."""

    def n_sessions(self) -> int:
        """No sessions are held."""
        return 0
