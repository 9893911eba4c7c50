"""Benchmarked processes, each fresh with its thread pools sized before anything loads.

Every single-process figure (ours and llama.cpp's) comes from a new interpreter
started with its thread variables set, so its resident set and thread pools are
its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from bench.model import MODEL

REPS = 3
THREADS = (1, 2)
CHILD_TIMEOUT = 900
# Read once, when a pool starts: set for each benchmarked process before numpy, numba or llama.cpp load.
# RLX_THREADS sizes the packed kernels of a stage (workers.models.kernels).
THREAD_VARS = (
    "RLX_THREADS",
    "OPENBLAS_NUM_THREADS",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "NUMBA_NUM_THREADS",
)


def thread_env(threads: int) -> dict[str, str]:
    """The variables that size every thread pool of a process to `threads`."""
    return dict.fromkeys(THREAD_VARS, str(threads))


def fresh(args: list[str], threads: int) -> dict:
    """Run `python args…` in a new process on `threads` threads; the JSON its last stdout line holds."""
    env = os.environ | thread_env(threads)
    out = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, timeout=CHILD_TIMEOUT, check=False
    )
    if out.returncode != 0:
        tail = "\n".join(out.stderr.strip().splitlines()[-15:])
        raise SystemExit(f"`python {' '.join(args)}` on {threads} thread(s) failed:\n{tail}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def llamacpp(threads: int, model: str = MODEL, reps: int = REPS, prompt_tokens: int = 128) -> dict:
    """bench.llamacpp in a fresh interpreter: llama.cpp on the model's file and the same prompt ids."""
    args = ["-m", "bench.llamacpp", "--threads", str(threads), "--reps", str(reps), "--model", model,
            "--prompt-tokens", str(prompt_tokens)]  # fmt: skip
    return fresh(args, threads)


def in_process_decode(threads: int, model: str = MODEL, prompt_tokens: int = 128) -> dict:
    """One packed prefill and decode in a fresh interpreter on `threads` threads (bench.model)."""
    code = (
        "import json; from bench.model import single_process; "
        f"print(json.dumps(single_process('packed', model={model!r}, prompt_tokens={prompt_tokens})))"
    )
    return fresh(["-c", code], threads)
