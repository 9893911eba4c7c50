"""Two floors under the model's figures on this machine, measured rather than argued.

`python -m bench.floors memory` prints, as JSON, a fresh process's resident
set (VmRSS) after each step a packed worker takes before it reads a weight:
Python and the libraries a worker imports, numba, numba's JIT loading its
first cached kernel, then every other kernel. That is what a packed stage
holds whatever its layers, beside the budget's 80 MB for "the interpreter and
libraries". The kernels must be in numba's cache already (`make kernels`),
or compiling them would be counted.

`python -m bench.floors products` times the products of a prompt of PROMPT
rows through every layer's seven matrices, float32 on BLAS as the f32 path
computes them (SmolLM2's shapes, from its file's metadata; constant values),
and nothing else: no attention, norms or head. Its threads are BLAS's, set
by the caller's environment (bench.__main__.fresh).
"""

from __future__ import annotations

import json
import sys
import time

from workers.protocol.report import resident_bytes as rss

PROMPT = 128
REPS = 3


def memory() -> dict:
    """The resident set after each step a packed worker takes before its weights."""
    steps = {"python": rss()}  # with msgspec, which reading it imports
    import gguf  # noqa: F401
    import numpy as np
    import tokenizers  # noqa: F401

    import workers.models
    import workers.server  # noqa: F401

    steps["libraries"] = rss()
    import numba  # noqa: F401

    steps["numba"] = rss()
    from workers.models import kernels_q8

    kernels_q8.quantize(np.ones((1, 32), dtype=np.float32))
    steps["first_kernel"] = rss()
    from workers.models import decode

    decode.warm_up()
    steps["all_kernels"] = rss()
    return steps


def products() -> dict:
    """Best of REPS: PROMPT rows through every layer's seven float32 products, on BLAS alone."""
    import numpy as np

    from workers import models
    from workers.models.arch import read_params
    from workers.models.gguf_file import open_gguf

    p = read_params(open_gguf(models.smollm2_path()))
    q, kv = p.n_heads * p.head_dim, p.n_kv_heads * p.head_dim
    shapes = [(p.hidden, q), (p.hidden, kv), (p.hidden, kv), (q, p.hidden),
              (p.hidden, p.ffn), (p.hidden, p.ffn), (p.ffn, p.hidden)]  # fmt: skip
    # Each layer its own matrices, (in, out) views of (out, in) arrays as the model holds them, so
    # the weights stream from memory as in a forward rather than staying in the cache.
    layers = [[np.full((o, i), 0.01, dtype=np.float32).T for i, o in shapes] for _ in range(p.n_layers)]
    x = {i: np.full((PROMPT, i), 0.5, dtype=np.float32) for i, _ in shapes}
    best = float("inf")
    for _ in range(REPS):
        started = time.perf_counter()
        for layer in layers:
            for w in layer:
                x[w.shape[0]] @ w
        best = min(best, time.perf_counter() - started)
    return {"rows": PROMPT, "layers": p.n_layers, "products_ms": round(best * 1000, 1)}


def main() -> None:
    what = sys.argv[1:] or [""]
    if what[0] not in ("memory", "products"):
        raise SystemExit("usage: python -m bench.floors memory|products")
    print(json.dumps(memory() if what[0] == "memory" else products()))


if __name__ == "__main__":
    main()
