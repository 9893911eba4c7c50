"""Memory given back after a build: the heap's free pages, the JIT's pages of code."""

from __future__ import annotations

import subprocess
import sys

import numba
import numpy as np
import pytest

from workers import memory

LLVM = "libllvmlite"  # the library numba compiles and links with
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/smaps")


def jit_code_resident_kib() -> int:
    """kB of the JIT library's code (its executable mappings) resident in this process."""
    total, counting = 0, False
    with open("/proc/self/smaps", encoding="utf-8", errors="replace") as f:
        for line in f:
            field, _, rest = line.partition(" ")
            if "-" in field and not field.endswith(":"):
                parts = rest.split()
                counting = len(parts) >= 5 and LLVM in parts[4] and parts[0].startswith("r-x")
            elif counting and field == "Rss:":
                total += int(rest.split()[0])
    return total


def test_after_giving_back_no_page_of_the_jits_code_is_resident_and_it_compiles_and_runs_as_before():
    @numba.njit
    def add(a, b):
        return a + b

    assert add(np.int64(1), np.int64(2)) == 3  # LLVM initialised and run: its code paged in
    before = jit_code_resident_kib()
    memory.give_back()
    after = jit_code_resident_kib()
    # Tens of MB of LLVM's code paged in to compile; none after (1 MB for what might run in between).
    assert after < 1024 < 8192 < before, (before, after)

    @numba.njit
    def times(a, b):
        return a * b

    assert add(np.int64(2), np.int64(3)) == 5  # the compiled code, untouched
    assert times(np.int64(2), np.int64(3)) == 6  # and LLVM, its pages back as it runs


# A thread allocates and frees this much in blocks below glibc's least mmap threshold (128 KiB), so
# that they come from its arena and, freed, join the top of that arena's heap.
THREAD_MB, BLOCK = 24, 64 << 10
CHILD = f"""
import ctypes, threading
from workers import memory
from workers.protocol.report import resident_bytes
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
seen = {{}}
def build():
    # A big block freed, as a build frees what it read: glibc raises its mmap threshold to that block's
    # size and its trim threshold to twice it, so the blocks below stay at the top when freed.
    libc.free(libc.malloc({THREAD_MB << 20}))
    blocks = (ctypes.c_void_p * ({THREAD_MB << 20} // {BLOCK}))()  # held apart: nothing between the blocks
    for i in range(len(blocks)):
        blocks[i] = libc.malloc({BLOCK})
        ctypes.memset(blocks[i], 1, {BLOCK})  # resident
    for i in reversed(range(len(blocks))):
        libc.free(blocks[i])
    seen["freed"] = resident_bytes()
    memory.give_back()
    seen["given_back"] = resident_bytes()
thread = threading.Thread(target=build)
thread.start()
thread.join()
print(seen["freed"] - seen["given_back"])
"""


def test_what_a_thread_freed_into_its_arena_is_given_back_from_that_thread():
    # A worker builds on a thread of its own: malloc_trim alone leaves the top of that thread's arena
    # (its freed blocks ended there) resident. In a fresh process, so that no other arena is in play.
    child = [sys.executable, "-c", CHILD]
    out = subprocess.run(child, capture_output=True, text=True, timeout=60, check=True)
    given_back = int(out.stdout)
    assert given_back > (THREAD_MB - 4) << 20, f"gave back {given_back / 2**20:.1f} MiB of {THREAD_MB}"
