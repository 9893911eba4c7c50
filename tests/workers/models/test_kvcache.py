"""A session's KV cache: a windowed block keeps a ring of its window, a global block every position."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from workers.models.kvcache import MIN_CACHE, KVCache, kv_slots
from workers.models.ops import causal_mask

KV, HD, WINDOW = 2, 8, 4
LIMIT = 4 * MIN_CACHE


def keys_at(positions: range) -> np.ndarray:
    """Keys (T, KV, hd) whose every value is its position, so a key read back tells where it was from."""
    return np.broadcast_to(
        np.arange(positions.start, positions.stop, dtype=np.float32)[:, None, None], (len(positions), KV, HD)
    ).copy()


def fill(cache: KVCache, index: int, chunks: list[int]) -> list[tuple[np.ndarray, int]]:
    """Chunks of `chunks` rows through block `index`; what extend gave each: (positions seen, first)."""
    seen, start = [], 0
    for n in chunks:
        cache.reserve(start + n)
        k = keys_at(range(start, start + n))
        keys, values, first = cache.extend(index, start, k, -k)
        np.testing.assert_array_equal(values, -keys)
        seen.append((keys[0, :, 0], first))
        start += n
        cache.length = start
    return seen


def test_each_block_has_its_place_among_the_blocks_of_its_kind():
    assert kv_slots([4, 4, 0, 4, 0]) == (0, 1, 0, 2, 1)


def advance(cache: KVCache, n: int) -> None:
    """n more positions through every block."""
    start = cache.length
    cache.reserve(start + n)
    k = keys_at(range(start, start + n))
    for block in range(len(cache.windows)):
        cache.extend(block, start, k, -k)
    cache.length = start + n


PER_POSITION = 2 * KV * HD * 4  # a key and a value of float32


def test_a_windowed_blocks_bytes_stop_growing_at_the_window_while_a_global_blocks_grow():
    cache = KVCache([WINDOW, 0], KV, HD, LIMIT)
    held = []
    for _ in range(3):
        advance(cache, MIN_CACHE)
        held.append((cache.block_bytes(0), cache.block_bytes(1)))
    assert [windowed for windowed, _ in held] == [WINDOW * PER_POSITION] * 3
    assert [full for _, full in held] == [n * MIN_CACHE * PER_POSITION for n in (1, 2, 4)]
    assert cache.nbytes() == sum(held[-1])


def test_a_short_session_holds_its_positions_rounded_up_in_either_kind():
    cache = KVCache([2 * MIN_CACHE, 0], KV, HD, LIMIT)
    advance(cache, 3)
    assert (cache.block_bytes(0), cache.block_bytes(1)) == (MIN_CACHE * PER_POSITION,) * 2
    advance(cache, 2 * MIN_CACHE)  # the ring full and wrapped: its window, no more
    assert cache.block_bytes(0) == 2 * MIN_CACHE * PER_POSITION


@pytest.mark.parametrize("chunks", [[10], [3, 9], [1] * 12, [5, 1, 1, 6]])
def test_a_windowed_block_sees_the_last_window_of_positions_whatever_the_chunks(chunks):
    cache = KVCache([WINDOW], KV, HD, LIMIT)
    start = 0
    for n, (positions, first) in zip(chunks, fill(cache, 0, chunks), strict=True):
        assert first == max(0, start - WINDOW + 1)
        np.testing.assert_array_equal(positions, np.arange(first, start + n))
        start += n


def test_a_global_block_sees_every_position():
    cache = KVCache([WINDOW, 0], KV, HD, LIMIT)
    (_, _), (positions, first) = fill(cache, 1, [3, 9])
    assert first == 0
    np.testing.assert_array_equal(positions, np.arange(12))


def test_a_row_sees_exactly_the_keys_llama_cpps_standard_window_gives_it():
    # llama_hparams::is_masked_swa (LLAMA_SWA_TYPE_STANDARD): key p0 is hidden from query p1 when
    # p1 - p0 >= window, so position p sees p - window < q <= p: the window counts the row itself.
    start, T = 6, 5
    first = start - WINDOW + 1
    mask = causal_mask(T, start, WINDOW, first)
    for row in range(T):
        p1 = start + row
        seen = [first + j for j in np.flatnonzero(mask[row] == 0)]
        assert seen == [q for q in range(p1 + 1) if p1 - q < WINDOW]


def test_windowed_blocks_of_two_sizes_in_one_stage_are_refused():
    with pytest.raises(ValueError, match=r"one window, got \[2, 4\]"):
        KVCache([4, 2, 0], KV, HD, LIMIT)


# A session's keys and values, freed in a process whose allocator keeps what is freed (its mmap
# threshold raised by a big block freed first, as a stage's build frees what it read).
SESSION_CHILD = """
import ctypes
import numpy as np
from workers.models.kvcache import KVCache
from workers.protocol.report import resident_bytes
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.free(libc.malloc(24 << 20))
cache = KVCache([0] * 30, 3, 64, 4096)
cache.reserve(256)
cache.k[:] = 1.0  # written: resident
cache.v[:] = 1.0
held, before = cache.nbytes(), resident_bytes()
del cache
print(held, before - resident_bytes())
"""


def test_a_sessions_keys_and_values_go_back_to_the_system_when_it_ends():
    out = subprocess.run([sys.executable, "-c", SESSION_CHILD], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    held, given_back = map(int, out.stdout.split())
    assert held > 8 << 20  # big enough to tell
    assert given_back > 0.9 * held, f"gave back {given_back} of the session's {held} bytes"
