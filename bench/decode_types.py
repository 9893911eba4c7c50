"""Where a decode token's products go, by stored type: µs per type for one row through every matrix.

`python -m bench.decode_types FILE.gguf [--threads N]` (N sets RLX_THREADS and
numba's pool here, before they load) prints one JSON line: for each type and
role (attn_q, ffn_down, the head, ...), how many matrices, their blocks' bytes
and the best of REPS sweeps of one row through them all, in µs, and GB/s of
blocks streamed. The per-call cost of Python (~10 µs a product) is included,
as in workers.models.kernels' product but not in a stage's compiled decode
(workers.models.decode): `overhead_us` is one sweep of the same calls on a
tiny matrix (kernels.tiny), to subtract.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict

REPS = 7


def _best_us(fn, reps: int = REPS) -> float:
    """The fastest of `reps` calls, µs: the least disturbed on a shared machine."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return round(best * 1e6, 1)


def profile(path: str) -> dict:
    """Each (type, role)'s matrices of the file swept once with one row, and the whole sweep."""
    import numpy as np

    from workers import models
    from workers.models import kernels
    from workers.models.gguf_file import open_gguf

    kernels.warm_up()
    file = open_gguf(models.gguf_path(path))
    groups: dict[str, list] = defaultdict(list)
    for e in file.tensors.values():
        if len(e.shape) == 2:
            role = e.name.split(".")[-2] if e.name.startswith("blk.") else e.name.removesuffix(".weight")
            packed = kernels.PackedMatrix(file.raw(e.name), e.qtype.name.lower(), e.shape)
            groups[f"{e.qtype.name} {role}"].append(packed)
    x = np.random.default_rng(0).standard_normal((1, max(w.shape[1] for ws in groups.values() for w in ws)),
                                                 dtype=np.float32)  # fmt: skip
    rows = {key: x[:, : ws[0].shape[1]] for key, ws in groups.items()}
    out: dict = {"threads": kernels.threads(), "types": {}}
    for key, ws in sorted(groups.items()):
        us = _best_us(lambda ws=ws, r=rows[key]: [w.kernel(r) for w in ws])
        held = sum(w.nbytes for w in ws)
        out["types"][key] = {"matrices": len(ws), "bytes": held, "us": us, "gb_s": round(held / us / 1e3, 1)}
    everything = [(w, rows[key]) for key, ws in groups.items() for w in ws]
    out["all_us"] = _best_us(lambda: [w.kernel(r) for w, r in everything])
    tiny = kernels.tiny("q8_0")
    one = np.ones((1, tiny.shape[1]), dtype=np.float32)
    out["overhead_us"] = _best_us(lambda: [tiny.kernel(one) for _ in everything])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.decode_types", description=__doc__.splitlines()[0])
    parser.add_argument("file", help="smollm2 or a path to a .gguf file")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    for name in ("RLX_THREADS", "NUMBA_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        os.environ[name] = str(args.threads)
    print(json.dumps(profile(args.file)))


if __name__ == "__main__":
    main()
