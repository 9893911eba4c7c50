"""How a run is one row of the store: its record as JSON, its output as float32 bytes, bounded.

The ClusterRun without its output is the `run` column (JSON); the output is
the `output` BLOB of raw float32 bytes, stored last, so listing runs never
reads or decodes outputs. Outputs come back as float32 values (they are
float32 tensors on the wire anyway). A run's output is stored up to
MAX_STORED_OUTPUT floats; a bigger one is kept as its shape and SHA-256
digest only.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
import numpy as np

from coordinator.stats import ClusterRun
from coordinator.store.file import StoreError

# Floats of a run's output stored (256 KiB); a bigger output is stored as its shape and digest only.
MAX_STORED_OUTPUT = 65_536

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(ClusterRun)


def bound_output(y: np.ndarray) -> tuple[list[float], list[int], str, bool]:
    """A forward's output as stored: (values or [] when over MAX_STORED_OUTPUT, shape, sha256, omitted)."""
    y = np.ascontiguousarray(y, np.float32)
    digest = hashlib.sha256(memoryview(y).cast("B")).hexdigest()
    omitted = y.size > MAX_STORED_OUTPUT
    return ([] if omitted else y.ravel().tolist()), list(y.shape), digest, omitted


def encode(run: ClusterRun) -> tuple[bytes, bytes]:
    """A run's `run` and `output` columns."""
    output = np.asarray(run.output, np.float32)
    if output.size > MAX_STORED_OUTPUT:  # whoever made the run, the store keeps its bound
        _, shape, digest, _ = bound_output(output)
        run = msgspec.structs.replace(run, output_shape=shape, output_digest=digest, output_omitted=True)
        output = output[:0]
    meta = _encoder.encode(msgspec.structs.replace(run, output=[]))
    return meta, output.tobytes()


def decode(store: str, run_id: int, meta: Any, output: Any = None) -> ClusterRun:
    """The run a row of `store` holds (its output only when `output` was read); StoreError if damaged."""
    try:
        run = _decoder.decode(meta)
    except (msgspec.DecodeError, TypeError, ValueError) as exc:
        raise StoreError(f"{store}: run {run_id} is damaged and cannot be read: {exc}") from exc
    run.id = run_id
    if output is not None:
        if not isinstance(output, bytes) or len(output) % 4:
            raise StoreError(
                f"{store}: run {run_id} is damaged: its output is not float32 bytes "
                f"({type(output).__name__} of length {len(output) if isinstance(output, bytes) else '?'})"
            )
        run.output = np.frombuffer(output, np.float32).tolist()
    return run
