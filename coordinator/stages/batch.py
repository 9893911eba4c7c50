"""A decode batch on the wire: its sessions' rows stacked into one payload, and cut back apart.

One forward carries every session's rows of a batch, in order, with an entry
per session saying which rows are its; the reply's rows come back in the same
order, to be cut at the same boundaries.
"""

from __future__ import annotations

import numpy as np

from workers.protocol.info import BatchItem
from workers.protocol.messages import BatchEntry


def stack_batch(items: list[BatchItem]) -> tuple[np.ndarray, list[BatchEntry]]:
    """The items' rows stacked in order, and the entries that say whose rows are whose."""
    if not items:
        raise ValueError("a batch needs at least one item")
    sessions = [i.session for i in items]
    if len(set(sessions)) != len(sessions):
        raise ValueError(f"a batch names each session once, got {sessions}")
    if empty := [i.session for i in items if np.ndim(i.x) == 0 or len(i.x) == 0]:
        raise ValueError(f"every item of a batch needs rows; sessions without: {empty}")
    entries = [BatchEntry(i.session, i.start_pos, len(i.x), i.last_only) for i in items]
    return np.concatenate([i.x for i in items]), entries


def split_rows(y: np.ndarray, rows: list[int]) -> list[np.ndarray]:
    """Cut stacked outputs back into one array per item."""
    return np.split(y, np.cumsum(rows)[:-1])
