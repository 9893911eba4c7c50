"""Give memory a process has freed back to the system, not only to its allocator."""

from __future__ import annotations

import ctypes
import sys
from contextlib import suppress


def give_back() -> None:
    """Return the free pages of the heap to the system (glibc only; elsewhere nothing is done).

    glibc keeps freed blocks below its adaptive mmap threshold in the heap, resident: a stage's build
    frees many (tensors read, regrouped, then dropped), ~8 MiB of them on Gemma 3 270M.
    """
    if sys.platform == "linux":
        with suppress(OSError, AttributeError):
            ctypes.CDLL(None).malloc_trim(0)
