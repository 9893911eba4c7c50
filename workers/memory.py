"""Give memory a process has freed, or no longer uses, back to the system, not only to its allocator."""

from __future__ import annotations

import ctypes
import sys
from contextlib import suppress
from pathlib import Path

# The JIT's library (llvmlite's LLVM). Loading the kernels from numba's cache runs LLVM's linker over
# their machine code, paging in ~65 MiB of its code and tables on Gemma 3; a stage whose kernels are all
# loaded runs none of it again (only a kernel compiled later would, paging back what it runs).
JIT_LIBRARY = "libllvmlite"
MADV_DONTNEED = 4  # from <asm-generic/mman-common.h>


def give_back() -> None:
    """Return the free pages of the heap, and the JIT's pages of code, to the system (glibc, Linux only).

    glibc keeps freed blocks below its adaptive mmap threshold in the heap, resident: a stage's build
    frees many (tensors read, regrouped, then dropped), ~8 MiB of them on Gemma 3 270M.
    """
    if sys.platform == "linux":
        with suppress(OSError, AttributeError):
            ctypes.CDLL(None).malloc_trim(0)
        with suppress(OSError):
            release_mapped(JIT_LIBRARY)


def release_mapped(library: str) -> int:
    """Drop this process's pages of the file mappings of `library` (a file name's start); the count dropped.

    Only mappings that cannot be written and hold no page of their own (Anonymous: 0, no page copied on
    write): their pages are the file's, in the page cache, and come back on the next touch as they were.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    dropped = 0
    for start, end, perms, anonymous in _mappings(library):
        if "w" not in perms and anonymous == 0 and libc.madvise(start, end - start, MADV_DONTNEED) == 0:
            dropped += 1
    return dropped


def _mappings(library: str) -> list[tuple[int, int, str, int]]:
    """(start, end, permissions, Anonymous kB) of each mapping of a file whose name starts `library`."""
    found: list[list] = []
    keep = False
    with open("/proc/self/smaps", encoding="utf-8", errors="replace") as f:
        for line in f:
            field, _, rest = line.partition(" ")
            if "-" in field and not field.endswith(":"):  # a mapping's first line: range perms ... path
                parts = rest.split()
                keep = len(parts) >= 5 and Path(parts[4]).name.startswith(library)
                if keep:
                    start, end = (int(a, 16) for a in field.split("-"))
                    found.append([start, end, parts[0], -1])
            elif keep and field == "Anonymous:":
                found[-1][3] = int(rest.split()[0])
    return [(start, end, perms, anonymous) for start, end, perms, anonymous in found]
