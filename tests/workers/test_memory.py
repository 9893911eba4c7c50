"""Memory given back after a build: the heap's free pages, the JIT's pages of code."""

from __future__ import annotations

import sys

import numba
import numpy as np
import pytest

from workers import memory

LLVM = "libllvmlite"  # the library numba compiles and links with
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/smaps")


def jit_resident_kib() -> int:
    """kB of the JIT library's mappings resident in this process."""
    total, counting = 0, False
    with open("/proc/self/smaps", encoding="utf-8", errors="replace") as f:
        for line in f:
            field, _, rest = line.partition(" ")
            if "-" in field and not field.endswith(":"):
                parts = rest.split()
                counting = len(parts) >= 5 and LLVM in parts[4]
            elif counting and field == "Rss:":
                total += int(rest.split()[0])
    return total


def test_after_giving_back_the_jit_holds_only_its_written_pages_and_compiles_and_runs_as_before():
    @numba.njit
    def add(a, b):
        return a + b

    assert add(np.int64(1), np.int64(2)) == 3  # LLVM initialised and run: its code paged in
    before = jit_resident_kib()
    memory.give_back()
    after = jit_resident_kib()
    # What stays is what the process wrote into the library's mappings (its relocated tables and
    # data, ~2 MB here), not the tens of MB of LLVM's code and constants paged in to compile.
    assert after < 4096 < before, (before, after)

    @numba.njit
    def times(a, b):
        return a * b

    assert add(np.int64(2), np.int64(3)) == 5  # the compiled code, untouched
    assert times(np.int64(2), np.int64(3)) == 6  # and LLVM, its pages back as it runs
