"""Pure numpy pieces shared by the model stages."""

from __future__ import annotations

import numpy as np


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: np.float32) -> np.ndarray:
    """Scale each row of x (T, D) to unit root-mean-square, then by `weight`."""
    return x * (1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)) * weight


def silu(x: np.ndarray) -> np.ndarray:
    """x · sigmoid(x)."""
    with np.errstate(over="ignore"):  # exp(-x) → inf for x < -88 gives the right limit, 0
        return x / (1.0 + np.exp(-x))
