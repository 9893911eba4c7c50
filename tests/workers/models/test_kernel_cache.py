"""Numba's on-disk cache of the kernels, as workers of one host fill it when they start at once.

The compiled functions here are two of the decode path's (norm and attention): compiling them takes a few
seconds, long enough for two processes to overlap, where compiling every product kernel from scratch takes
over a minute and a half of both cores — the same cache, the same writes, at a third of the suite's budget.
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
q, keys = np.ones((1, 2, 32), np.float32), np.ones((1, 4, 32), np.float32)
out = np.empty((1, 64), np.float32)
decode_ops.attend(q, q[:, :1], q[:, :1], keys, keys.copy(), 0, out, np.float32(0.1), 0)
stats = [f.stats for f in (decode_ops.rms_norm, decode_ops.attend)]
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
    assert third["misses"] == 0 and third["hits"] == 2, third
