"""Products with SmolLM2's packed weights: each candidate kernel's time and error, as JSON.

Candidates, all on the file's own blocks (Q4_1 layers, Q8_0 token table):
- f32: the matrix dequantized once and kept as float32, then BLAS (the f32
  precision: fast, but 6.4x the memory);
- dequantize_blas: dequantized on every product, then BLAS (packed before
  the kernels);
- blocks: workers.models.kernels on the regrouped blocks, the rows rounded to
  8 bits per block and multiplied in integers (workers.models.kernels_q8; its
  error, ~5e-3, is that rounding's), with vpmaddubsw/vpmaddwd built as LLVM
  IR, each weight vector multiplied into up to 4 rows;
- previous: the kernels blocks replaced (bench.kernels_previous: the same
  products, bitwise, with int16 lanes, each row unpacking the weights again).
  Per decode step, all matmuls of SmolLM2 at 1 thread (Zen 1, AVX2), M rows:
  previous 23 / 38 / 69 ms for M = 1 / 2 / 4, blocks 18-21 / 26 / 38 ms
  (one row streams ~96 MB of blocks a step: memory bound more than compute);
- tiles_blas: workers.models.kernels dequantizing 8 MB tiles for BLAS;
- packed: what a packed stage runs (blocks up to KERNEL_MAX_ROWS rows, tiles after).

Per shape, the best of REPS timings for M input rows (wall ms, and CPU ms
of all threads: on a loaded machine the CPU time is the steadier), and the error as
max |y - y_f32| / max |y_f32| against the float32 product of the same
dequantized weights. `decode_token_ms` sweeps every matrix of the model once
with M rows (each its own weights, so they stream from memory as in decode;
M > 1 is a batched decode step of M chats). Each thread count runs in a
fresh process: OpenBLAS sizes its pool once. `portable` is blocks compiled
for a CPU without AVX2 (numba's NUMBA_CPU_FEATURES), what such a CPU runs.

Not measured here (each was tried and set aside): torch's int4 kernel (a 190 MB wheel,
bf16 activations, ~3e-3 error), ggml-python (a source build with cmake and a
compiler), ONNX Runtime's MatMulNBits (its 8-bit activations err by ~6e-3 at
its fast accuracy level, Q4_1's offsets need a correction term, and each
matrix is its own graph and session, built with the onnx package).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np

from bench.kernels_previous import Previous
from workers import models
from workers.models import kernels
from workers.models.arch import read_params
from workers.models.gguf_file import open_gguf

SHAPES = {  # (out, in) of the matrices of one block, and the head
    "attn_q 576x576": "blk.0.attn_q.weight",
    "attn_k 192x576": "blk.0.attn_k.weight",
    "ffn_up 1536x576": "blk.0.ffn_up.weight",
    "ffn_down 576x1536": "blk.0.ffn_down.weight",
    "head 49152x576": "token_embd.weight",
}
ROWS = (1, 2, 4, 128)
DECODE_ROWS = (1, 2, 4)
PLAIN_X86 = {"NUMBA_CPU_NAME": "x86-64", "NUMBA_CPU_FEATURES": "+64bit,+cmov,+cx8,+fxsr,+mmx,+sse,+sse2"}
THREADS = (1, 2)
REPS = 7
LAYER_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def best_ms(fn, reps: int = REPS) -> dict:
    """The fastest of `reps` calls, wall and CPU (all threads) ms: the least disturbed on a shared machine."""
    wall, cpu = [], []
    for _ in range(reps):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    return {"ms": round(min(wall) * 1000, 3), "cpu_ms": round(min(cpu) * 1000, 3)}


def error(y: np.ndarray, ref: np.ndarray) -> float:
    """Largest deviation from the float32 product, relative to its largest value."""
    return float(np.abs(y - ref).max() / np.abs(ref).max())


def candidates(file, name: str) -> dict:
    """Each candidate's product function for tensor `name`."""
    e, raw = file.entry(name), file.raw(name)
    w32 = np.ascontiguousarray(file.dequantize(name).T)
    packed = kernels.PackedMatrix(raw, e.qtype.name.lower(), e.shape)
    previous = Previous(packed)
    return {
        "f32": lambda x: x @ w32,
        "dequantize_blas": lambda x: x @ file.dequantize(name).T,
        "blocks": packed.kernel,
        "previous": previous.kernel,
        "tiles_blas": packed.blas,
        "packed": lambda x: x @ packed,
    }


def shapes(file) -> dict:
    """Time and error of every candidate, shape and row count."""
    rng = np.random.default_rng(0)
    out: dict = {}
    for label, name in SHAPES.items():
        fns = candidates(file, name)
        for m in ROWS:
            x = rng.standard_normal((m, file.entry(name).shape[1]), dtype=np.float32)
            ref = fns["f32"](x)
            reps = 2 if name.startswith("token") and m > 4 else REPS
            out[f"{label} M={m}"] = {
                c: best_ms(lambda f=f, x=x: f(x), reps) | {"error": error(f(x), ref)} for c, f in fns.items()
            }
    return out


def decode_token(file, portable: bool = False) -> dict:
    """ms for M rows through every layer matrix and the head, each once: the matmuls of a decode step."""
    p = read_params(file)
    names = [f"blk.{i}.{m}.weight" for i in range(p.n_layers) for m in LAYER_MATRICES] + ["token_embd.weight"]
    x = np.random.default_rng(1).standard_normal((max(DECODE_ROWS), p.ffn), dtype=np.float32)
    entries = [file.entry(n) for n in names]
    blocks = [kernels.PackedMatrix(file.raw(e.name), e.qtype.name.lower(), e.shape) for e in entries]

    def sweep(products, m: int) -> None:
        for product, w in zip(products, blocks, strict=True):
            product(x[:m, : w.shape[1]])

    candidates = {"blocks": [w.kernel for w in blocks]}
    if not portable:
        candidates["previous"] = [Previous(w).kernel for w in blocks]
        f32 = [np.ascontiguousarray(file.dequantize(n).T) for n in names]  # 540 MB, freed after the timing
        candidates["f32"] = [w.__rmatmul__ for w in f32]
    result = {f"M={m}": {c: best_ms(lambda f=f, m=m: sweep(f, m), 5) for c, f in candidates.items()}
              for m in DECODE_ROWS}  # fmt: skip
    if not portable:
        candidates.clear()
        f32.clear()
        result["M=1"]["dequantize_blas"] = best_ms(
            lambda: [x[:1, : file.entry(n).shape[1]] @ file.dequantize(n).T for n in names], 1
        )
    return result


def run(threads: int, portable: bool) -> dict:
    """Everything at `threads` threads (set in this process's environment before numpy loaded)."""
    kernels.warm_up()
    file = open_gguf(models.smollm2_path())
    if portable:
        return {"threads": kernels.threads(), "decode_token_ms": decode_token(file, portable=True)}
    return {"threads": kernels.threads(), "shapes": shapes(file), "decode_token_ms": decode_token(file)}


def child(threads: int, portable: bool = False) -> dict:
    """run() in a fresh process with `threads` threads everywhere (and numba's target without AVX2)."""
    names = ("RLX_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS")
    env = os.environ | dict.fromkeys(names, str(threads))
    args = [sys.executable, "-m", "bench.kernels", "--threads", str(threads)]
    if portable:
        env, args = env | PLAIN_X86, [*args, "--portable"]
    done = subprocess.run(args, env=env, capture_output=True, text=True, check=True, timeout=1800)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    """Run each thread count, and the portable kernels, in a fresh process and print one JSON document."""
    if len(sys.argv) >= 3 and sys.argv[1] == "--threads":
        print(json.dumps(run(int(sys.argv[2]), "--portable" in sys.argv[3:])))
        return
    results = {"uptime": os.getloadavg(), "rows_kernel_max": kernels.KERNEL_MAX_ROWS, "by_threads": {}}
    for n in THREADS:
        results["by_threads"][str(n)] = child(n)
    results["portable"] = child(1, portable=True)
    results["load_after"] = os.getloadavg()
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
