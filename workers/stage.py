"""The Stage interface: what a worker process runs, whatever the model."""

from __future__ import annotations

from typing import Literal, Protocol

import msgspec
import numpy as np

from workers.report import LayerRange


class StageError(Exception):
    """A forward or reset that cannot be served; the message goes back to the client."""


class ModelInfo(msgspec.Struct, frozen=True):
    """What the coordinator needs to know of a model without loading tensors.

    name: the model spec as given.
    n_layers: layers (blocks) in the whole model.
    input: "tokens" (int32 ids of shape (T,)) or "hidden" (float32 (T, hidden)).
    hidden: width of the activations passed between stages.
    vocab: vocabulary size (0 when the model has no tokenizer).
    context_length: the most positions a session may hold.
    """

    name: str
    n_layers: int
    input: Literal["tokens", "hidden"]
    hidden: int
    vocab: int = 0
    context_length: int = 1 << 20


class Stage(Protocol):
    """A contiguous range of layers, built and ready to run forwards.

    A stage is first when `layers.is_first` and last when
    `layers.is_last(info.n_layers)`. `forward` and `reset` may be called
    from a worker thread, one call at a time; `n_sessions` from any thread.
    """

    info: ModelInfo
    layers: LayerRange
    precision: str
    n_params: int
    n_packed: int

    def forward(self, x: np.ndarray, *, session: str, start_pos: int, last_only: bool) -> np.ndarray:
        """Run the stage's layers on `x`, rows at positions start_pos, start_pos+1, …"""
        ...

    def reset(self, session: str) -> None:
        """Forget any state held for `session`."""
        ...

    def n_sessions(self) -> int:
        """Sessions currently holding state."""
        ...


class StatelessStage:
    """A stage that holds nothing per session."""

    def reset(self, session: str) -> None:
        """Nothing is held per session."""

    def n_sessions(self) -> int:
        """No sessions are held."""
        return 0


def check_hidden(x: np.ndarray, hidden: int, layers: LayerRange) -> np.ndarray:
    """Refuse anything but hidden states: float32 of shape (T, hidden), T >= 1."""
    if x.dtype != np.float32 or x.ndim != 2 or x.shape[0] == 0 or x.shape[1] != hidden:
        raise StageError(f"stage {layers} expects float32 (T, {hidden}), got {x.dtype} {x.shape}")
    return x
