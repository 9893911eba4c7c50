"""Under xdist, each test process's OpenBLAS pool sized to its share of the cores, as a worker's is.

Loaded by `-p` (pyproject's addopts), so before any conftest or test module imports numpy: OpenBLAS
reads its thread count once, when numpy loads it. make test runs two test processes more than the
cores; each with a pool as wide as the host, their threads spin on cores the other processes hold
(test_llama.py took 42 CPU-s beside a second pytest process, 8 with one thread each). The launcher
leaves a count our environment sets as it is, so the workers a test starts, and the references in
this process they are compared with bitwise, compute with the same count. One test process (no
xdist, or `-n 1`) keeps OpenBLAS's own default.
"""

from __future__ import annotations

import os

BLAS_VAR = "OPENBLAS_NUM_THREADS"
_processes = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _processes > 1 and BLAS_VAR not in os.environ:
    os.environ[BLAS_VAR] = str(max(1, len(os.sched_getaffinity(0)) // _processes))
