"""Give memory a process has freed, or no longer uses, back to the system, not only to its allocator."""

from __future__ import annotations

import ctypes
import sys
from contextlib import suppress
from pathlib import Path

# The JIT's library (llvmlite's LLVM). Loading the kernels from numba's cache runs LLVM's linker over
# their machine code, paging in ~52 MiB of its code on Gemma 3 (and ~16 MiB of its tables, left): a
# stage whose kernels are all loaded runs none of it again (a kernel compiled later pages back its part).
JIT_LIBRARY = "libllvmlite"
MADV_DONTNEED = 4  # from <asm-generic/mman-common.h>


def give_back() -> None:
    """Return the free pages of the heap, and the JIT's code, to the system (glibc, Linux only).

    glibc keeps freed blocks below its adaptive mmap threshold in the heap, resident: a stage's build
    frees many (tensors read, regrouped, then dropped), ~8 MiB of them on Gemma 3 270M.
    """
    if sys.platform == "linux":
        with suppress(OSError, AttributeError):
            ctypes.CDLL(None).malloc_trim(0)
        with suppress(OSError):
            release_mapped(JIT_LIBRARY)


def release_mapped(library: str) -> int:
    """Drop this process's pages of the code of `library` (a file name's start); the mappings dropped.

    Only its executable mappings that cannot be written: a shared library's code, which nothing writes
    (relocations go to its data and tables, mapped apart), so that its pages are the file's, in the page
    cache, and come back on the next touch as they were. Its read-only tables are left: the dynamic
    linker wrote some of them before making them read-only, and those pages exist nowhere else.
    /proc/self/maps, not smaps: smaps walks every page of the process, ~50 ms on a Gemma 3 stage.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    dropped = 0
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
        for line in f:
            parts = line.split()  # range perms offset device inode [path]
            if len(parts) < 6 or not Path(parts[5]).name.startswith(library):
                continue
            if parts[1].startswith("r-x"):
                start, end = (int(a, 16) for a in parts[0].split("-"))
                dropped += libc.madvise(start, end - start, MADV_DONTNEED) == 0
    return dropped
