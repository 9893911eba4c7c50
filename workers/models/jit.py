"""Where numba keeps the compiled kernels: one directory per version of their sources.

Numba stamps a cached function with its own source file only. A compiled
function that calls compiled functions of another file (run_blocks calling
the products, the norms) would load from the cache as it was built, with the
callees' old code, after that other file changed: a stale kernel, computing
what the source no longer says. So the cache lives in a directory named by a
hash of every source file here that uses numba, and a changed kernel anywhere
is compiled again. The lowest compiling modules (kernels_q8, decode_ops)
import this one before their first decorator, and every other one imports them
first, so the directory is set before any function is cached.

The base is NUMBA_CACHE_DIR when set (the portable build's cache, a test's own
directory), else this package's `__pycache__` when it may be written, else
the user's cache directory, as numba itself would fall back.

A kernel loaded from the cache is kept lean (`LeanLibrary`): numba parses,
beside its machine code, the whole optimized IR of it and of everything it
calls, in case later compiled code links it, and keeps it: ~12 MiB of IR
text for a Gemma 3 stage's eleven entry points, ~40 MiB resident as LLVM
holds it. Here that IR stays the bitcode it was read as, parsed again only
if something does link the kernel.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numba
from llvmlite import binding as llvm
from numba.core.codegen import JITCodeLibrary, JITCPUCodegen

HERE = Path(__file__).parent
LOADER = Path(__file__).name  # this module: it places and loads the kernels, it compiles none of them


def sources_hash() -> str:
    """A short hash of the name and bytes of every module here that uses numba, but this one."""
    digest = hashlib.sha256()
    for path in sorted(HERE.glob("*.py")):
        text = path.read_bytes()
        if b"numba" in text and path.name != LOADER:
            digest.update(path.name.encode() + b"\0" + text)
    return digest.hexdigest()[:16]


def cache_base() -> Path:
    """The directory the kernels' versions are kept under."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return Path(os.environ["NUMBA_CACHE_DIR"])
    pycache = HERE / "__pycache__"
    if os.access(pycache if pycache.exists() else HERE, os.W_OK):
        return pycache
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rlx-cluster" / "numba"


CACHE_DIR = cache_base() / f"kernels-{sources_hash()}"
numba.config.CACHE_DIR = str(CACHE_DIR)


class LeanLibrary(JITCodeLibrary):
    """A compiled library that, loaded from the cache, keeps the IR to link it as bitcode, not parsed."""

    _linking_bitcode: bytes | None = None

    @classmethod
    def _unserialize(cls, codegen, state):
        library = super()._unserialize(codegen, state)
        _, kind, data = state
        if kind == "object":  # (machine code, the IR other code links); the machine code is loaded
            # numba parsed the IR to learn the symbols it defines; LLVM frees the module dropped here.
            library._linking_bitcode, library._shared_module = data[1], None
        return library

    def _get_module_for_linking(self):
        if self._shared_module is None and self._linking_bitcode is not None:
            self._shared_module = llvm.parse_bitcode(self._linking_bitcode)
            self._linking_bitcode = None
        return super()._get_module_for_linking()


# Read as a library is made or loaded, so set before the first: the codegen is made on the first compile.
JITCPUCodegen._library_class = LeanLibrary
