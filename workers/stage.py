"""The Stage interface: what a worker process runs, whatever the model."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from workers.protocol.info import BatchItem, ModelInfo
from workers.protocol.report import LayerRange


class StageError(Exception):
    """A forward or reset that cannot be served; the message goes back to the client."""


class Stage(Protocol):
    """A contiguous range of layers, built and ready to run forwards.

    A stage is first when `layers.is_first` and last when
    `layers.is_last(info.n_layers)`. `forward`, `forward_batch` and `reset` may be called
    from a worker thread, one call at a time; `n_sessions` and `kv_bytes` from any thread.
    """

    info: ModelInfo
    layers: LayerRange
    precision: str
    n_params: int
    n_packed: int

    def forward(self, x: np.ndarray, *, session: str, start_pos: int, last_only: bool) -> np.ndarray:
        """Run the stage's layers on `x`, rows at positions start_pos, start_pos+1, …"""
        ...

    def forward_batch(self, items: list[BatchItem]) -> list[np.ndarray]:
        """Run `forward` for each item (distinct sessions) at once; the outputs in the items' order.

        Each output equals what `forward` returns for its item, up to float reassociation in the
        matmuls (rows computed together may round differently in the last bits).
        """
        ...

    def reset(self, session: str) -> None:
        """Forget any state held for `session`."""
        ...

    def n_sessions(self) -> int:
        """Sessions currently holding state."""
        ...

    def kv_bytes(self) -> dict[str, int]:
        """The bytes each session's state (its KV cache) holds now, by session."""
        ...


class StatelessStage:
    """A stage that holds nothing per session."""

    def forward_batch(self, items: list[BatchItem]) -> list[np.ndarray]:
        """Forward each item in turn: nothing is shared between the rows of a stateless stage."""
        return [
            self.forward(x, session=session, start_pos=start_pos, last_only=last_only)
            for x, session, start_pos, last_only in items
        ]

    def reset(self, session: str) -> None:
        """Nothing is held per session."""

    def n_sessions(self) -> int:
        """No sessions are held."""
        return 0

    def kv_bytes(self) -> dict[str, int]:
        """Nothing is held per session."""
        return {}


def check_hidden(x: np.ndarray, hidden: int, layers: LayerRange) -> np.ndarray:
    """Refuse anything but hidden states: float32 of shape (T, hidden), T >= 1."""
    if x.dtype != np.float32 or x.ndim != 2 or x.shape[0] == 0 or x.shape[1] != hidden:
        raise StageError(f"stage {layers} expects float32 (T, {hidden}), got {x.dtype} {x.shape}")
    return x
