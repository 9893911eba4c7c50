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
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numba

HERE = Path(__file__).parent


def sources_hash() -> str:
    """A short hash of the name and bytes of every module here that uses numba."""
    digest = hashlib.sha256()
    for path in sorted(HERE.glob("*.py")):
        text = path.read_bytes()
        if b"numba" in text:
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
