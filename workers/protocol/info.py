"""What both sides know of a model and of one session's rows in a forward, without loading tensors."""

from __future__ import annotations

from typing import Literal, NamedTuple

import msgspec
import numpy as np

# The sessions a model's stage keeps state for at once, unless the model says otherwise.
MAX_SESSIONS = 8


class ModelInfo(msgspec.Struct, frozen=True):
    """What the coordinator needs to know of a model without loading tensors.

    name: the model spec as given.
    n_layers: layers (blocks) in the whole model.
    input: "tokens" (int32 ids of shape (T,)) or "hidden" (float32 (T, hidden)).
    hidden: width of the activations passed between stages.
    vocab: vocabulary size (0 when the model has no tokenizer).
    context_length: the most positions a session may hold.
    max_sessions: the most sessions a stage keeps state (a KV cache) for at once: more runs
        in flight than this would evict each other's.
    """

    name: str
    n_layers: int
    input: Literal["tokens", "hidden"]
    hidden: int
    vocab: int = 0
    context_length: int = 1 << 20
    max_sessions: int = MAX_SESSIONS


class BatchItem(NamedTuple):
    """One session's rows in a batched forward: what `Stage.forward` takes for that session.

    x: its input, token ids (T,) on the first stage, hidden states (T, hidden) after.
    session: whose state (KV cache) the rows extend; the sessions of one batch are distinct.
    start_pos: the position of its first row.
    last_only: on the last stage, return only its last row's logits (default: every row's output).
    """

    x: np.ndarray
    session: str
    start_pos: int
    last_only: bool = False
