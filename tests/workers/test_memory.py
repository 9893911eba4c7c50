"""Memory given back after a build: the heap's free pages, the JIT's pages of code."""

from __future__ import annotations

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
