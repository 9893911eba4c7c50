"""A session's keys and values in a stage: every position on a global block, a ring on a windowed one.

A block attending through a sliding window of W positions (llama.cpp's standard
window: position p sees p - W < q <= p) never again reads a key W positions
behind the newest, so it keeps only the last W, position q at q mod W: its bytes
stop growing once a session passes W positions, while a global block's grow
with the session (by doubling, up to the context). Either grows from MIN_CACHE
positions, so a short session holds little.

The arrays are two per kind, each block in its kind's arrays at `slots[index]`:
global keys, values (G, KV, capacity, hd), windowed ones (S, KV, ring, hd). The
compiled path (workers.models.decode) writes and reads the same arrays.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence

import numpy as np

MAPPED_BYTES = 1 << 20  # from here a session's array is a mapping of its own (see _mapped)
MIN_CACHE = 64  # positions a new session's arrays start with; they double as needed


def kv_slots(windows: Sequence[int]) -> tuple[int, ...]:
    """Each block's index among the blocks of its kind (windowed, or global), in order."""
    seen = {True: 0, False: 0}
    slots = []
    for window in windows:
        slots.append(seen[window > 0])
        seen[window > 0] += 1
    return tuple(slots)


def _mapped(shape: tuple[int, ...]) -> np.ndarray:
    """An array for a session's keys or values, float32: a mapping of its own when it is big.

    An array from the heap goes back to it when the session ends and stays resident there, in the
    arena of whichever serving thread grew it (12 MB a SmolLM2 session grown to 256 positions): the
    stage's resident set then counts sessions long gone. A mapping goes back to the system with the
    array. Its pages are faulted in as positions are written, so a session holds what it used, not
    the doubled capacity: 0.7 ms more a 160-position SmolLM2 session than reusing the heap's pages
    (0.4% of its prefill; MAP_POPULATE costs as the heap does, but holds the whole capacity).
    """
    n = 4 * int(np.prod(shape))
    if n < MAPPED_BYTES:
        return np.empty(shape, dtype=np.float32)
    return np.frombuffer(mmap.mmap(-1, n), dtype=np.float32).reshape(shape)


def _grown(a: np.ndarray, need: int, most: int, held: int) -> np.ndarray:
    """a (N, KV, capacity, hd) with room for `need` positions (doubling, at most `most`), rows :held kept."""
    capacity = a.shape[2]
    if need <= capacity:
        return a
    capacity = max(MIN_CACHE, capacity)
    while capacity < need:
        capacity *= 2
    out = _mapped((*a.shape[:2], min(capacity, most), a.shape[3]))
    out[:, :, :held] = a[:, :, :held]
    return out


class KVCache:
    """One session's keys and values for a stage's blocks, block i windowed by windows[i] (0: global).

    length: the positions 0..length every block holds (the windowed ones, the last W of them).
    k, v: the global blocks' (G, KV, capacity, hd); ring_k, ring_v: the windowed ones' (S, KV, ring, hd),
    position q at q mod W once the ring is full (before, at q: the ring grows like the others up to W).
    """

    def __init__(self, windows: Sequence[int], n_kv: int, head_dim: int, limit: int) -> None:
        sizes = {w for w in windows if w > 0}
        if len(sizes) > 1:
            raise ValueError(f"a stage's windowed blocks must share one window, got {sorted(sizes)}")
        self.length = 0
        self.limit = limit
        self.windows = tuple(windows)
        self.window = sizes.pop() if sizes else 0
        self.slots = kv_slots(self.windows)
        n_ring = sum(1 for w in self.windows if w > 0)
        self.k = np.empty((len(self.windows) - n_ring, n_kv, 0, head_dim), dtype=np.float32)
        self.v = np.empty_like(self.k)
        self.ring_k = np.empty((n_ring, n_kv, 0, head_dim), dtype=np.float32)
        self.ring_v = np.empty_like(self.ring_k)

    def reserve(self, n: int) -> None:
        """Make room for positions up to n, keeping the ones held (callers keep n within the limit)."""
        self.k = _grown(self.k, n, self.limit, self.length)
        self.v = _grown(self.v, n, self.limit, self.length)
        ring = min(self.window, self.limit)
        # A ring smaller than its window has not wrapped yet: positions 0..length sit in order.
        held = min(self.length, self.ring_k.shape[2])
        self.ring_k = _grown(self.ring_k, min(n, ring), ring, held)
        self.ring_v = _grown(self.ring_v, min(n, ring), ring, held)

    def nbytes(self) -> int:
        """The bytes the session's keys and values hold, every block."""
        return self.k.nbytes + self.v.nbytes + self.ring_k.nbytes + self.ring_v.nbytes

    def block_bytes(self, index: int) -> int:
        """The bytes block `index`'s keys and values hold."""
        k = self.ring_k if self.windows[index] else self.k
        return 2 * k[self.slots[index]].nbytes

    def extend(
        self, index: int, start_pos: int, k: np.ndarray, v: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """Store k, v (T, KV, hd) at start_pos.. for block `index`; the keys, values (KV, L, hd) its rows
        may see, in order, and the position of the first of them (0 on a global block)."""
        end, slot = start_pos + k.shape[0], self.slots[index]
        k, v = k.transpose(1, 0, 2), v.transpose(1, 0, 2)  # (KV, T, hd)
        window = self.windows[index]
        if not window:
            self.k[slot, :, start_pos:end] = k
            self.v[slot, :, start_pos:end] = v
            return self.k[slot, :, :end], self.v[slot, :, :end], 0
        ring_k, ring_v = self.ring_k[slot], self.ring_v[slot]  # (KV, ring, hd)
        first = max(0, start_pos - window + 1)  # the oldest position the first new row sees
        held = np.arange(first, start_pos) % window
        keys = np.concatenate([ring_k[:, held], k], axis=1)  # (KV, start_pos - first + T, hd)
        values = np.concatenate([ring_v[:, held], v], axis=1)
        kept = np.arange(max(start_pos, end - window), end)  # the new positions the ring keeps
        ring_k[:, kept % window] = k[:, kept - start_pos]
        ring_v[:, kept % window] = v[:, kept - start_pos]
        return keys, values, first
