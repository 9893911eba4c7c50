"""Numba's on-disk cache of the kernels, as workers of one host fill it when they start at once.

Apart from the other kernel tests, so that this compile from scratch runs beside them, not after them.
"""

from __future__ import annotations

import os
import subprocess
import sys


def test_two_workers_compiling_the_kernels_at_once_share_the_cache(tmp_path):
    code = "from workers.models import kernels; kernels.warm_up(); print(kernels.threads())"
    env = os.environ | {"NUMBA_CACHE_DIR": str(tmp_path), "RLX_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        assert out.strip() == "1"
    assert list(tmp_path.rglob("*.nbc")), "no compiled kernel was cached"
