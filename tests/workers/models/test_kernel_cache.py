"""Numba's on-disk cache of the kernels, as workers of one host fill it when they start at once.

The compiled function here is one of the decode path's (the norm): compiling it takes about a second of
each process's CPU after numba's import, and both processes start at once, so the two compile and write the
same cache together. Compiling every product kernel from scratch takes over a minute and a half of both
cores; the attention beside the norm took six seconds more of each, for the same cache and the same writes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

COMPILE = """
import json, numpy as np
from workers.models import decode_ops, jit
x = np.ones((2, 64), np.float32)
decode_ops.rms_norm(x, x[0], np.float32(1e-5))
stats = [decode_ops.rms_norm.stats]
print(json.dumps({"dir": str(jit.CACHE_DIR), "hits": sum(len(s.cache_hits) for s in stats),
                  "misses": sum(len(s.cache_misses) for s in stats)}))
"""


def run_at_once(n: int, env: dict) -> list[dict]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", COMPILE],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(n)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_two_workers_compiling_the_kernels_at_once_share_the_cache_and_a_third_loads_it(tmp_path):
    env = os.environ | {"NUMBA_CACHE_DIR": str(tmp_path), "RLX_THREADS": "1"}
    first = run_at_once(2, env)
    assert {r["dir"] for r in first} == {first[0]["dir"]}
    assert first[0]["dir"].startswith(str(tmp_path / "kernels-"))  # a directory per version of the sources
    assert list(tmp_path.rglob("*.nbc")), "no compiled kernel was cached"
    (third,) = run_at_once(1, env)
    assert third["misses"] == 0 and third["hits"] == 1, third
