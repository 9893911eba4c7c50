"""Give memory a process has freed, or no longer uses, back to the system, not only to its allocator."""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

# The JIT's library (llvmlite's LLVM). Loading the kernels from numba's cache runs LLVM's linker over
# their machine code, paging in ~52 MiB of its code on Gemma 3 (and ~16 MiB of its tables, left): a
# stage whose kernels are all loaded runs none of it again (a kernel compiled later pages back its part).
JIT_LIBRARY = "libllvmlite"
MADV_DONTNEED = 4  # from <asm-generic/mman-common.h>
M_TRIM_THRESHOLD = -1  # from <malloc.h>
# The trim threshold give_back leaves: the most glibc's adaptive one reaches (twice its largest mmap
# threshold, 32 MiB on 64 bits), so frees after it trim no more often than before. Setting it stops
# glibc adapting its mmap threshold, which stays where the build left it (served decode and prefill
# measured as fast as before, SmolLM2 at 1 and 2 threads).
KEEP_TOP = 64 << 20
# A block glibc's free hands back to the top of the heap, trimming it, whatever the mmap threshold:
# at least its consolidation threshold (64 KiB), below its least mmap threshold (128 KiB).
TRIM_BLOCK = 96 << 10


def give_back() -> None:
    """Return the free pages of the heap, and the JIT's code, to the system (glibc, Linux only).

    glibc keeps freed blocks below its adaptive mmap threshold in the heap, resident: a stage's build
    frees many (tensors read, regrouped, then dropped), ~8 MiB of them on Gemma 3 270M. malloc_trim
    gives back the free blocks of every arena but trims the top of the main arena only, and a worker
    builds on a thread of its own, whose arena's top kept 8 MB of a SmolLM2 Q4_K_M build (1.7 MB of a
    Q4_1 one): a free with the trim threshold at 0 trims the calling thread's arena's top as well.
    """
    with trimming():
        pass


@contextmanager
def trimming() -> Iterator[None]:
    """Within: every free that ends at the top of its arena gives that top back. After: give_back.

    For freeing what another thread allocated (a dropped stage's arrays, in its build thread's arena),
    whose arena's top no call from this thread can reach afterwards. Not around compute: its arrays,
    freed and allocated again each forward, would be given back and faulted in again each time.
    """
    libc = _libc()
    if libc is not None:
        libc.mallopt(M_TRIM_THRESHOLD, 0)
    try:
        yield
    finally:
        if libc is not None:
            libc.malloc_trim(0)
            libc.free(libc.malloc(TRIM_BLOCK))  # this thread's arena's top, at threshold 0
            libc.mallopt(M_TRIM_THRESHOLD, KEEP_TOP)
        if sys.platform == "linux":
            with suppress(OSError):
                release_mapped(JIT_LIBRARY)


def _libc() -> ctypes.CDLL | None:
    """glibc's allocator's calls, or None where there are none to make."""
    if sys.platform != "linux":
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.malloc.restype = ctypes.c_void_p
        libc.free.argtypes = [ctypes.c_void_p]
        # Looked up now: a libc without them (not glibc) has no arenas to trim.
        libc.mallopt, libc.malloc_trim  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


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
