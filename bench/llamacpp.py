"""llama.cpp on the same GGUF file and the same prompt token ids: the figure to beat.

Run in a fresh process per thread count (`python -m bench.llamacpp --threads N`,
prints one JSON line), with the thread variables set before anything imports
(bench.__main__ does that). Tokens are fed as ids, never as text, so both
sides see exactly the same input; neither adds a BOS token.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from bench.model import MODEL, prompt_ids
from workers import models
from workers.protocol.report import resident_bytes

REPS = 3
CONTEXT = 512  # the prompt, the decoded tokens and room to spare; one batch holds the whole prompt


def _load(threads: int, model: str = MODEL):
    """A llama-cpp-python model of the model's GGUF file, on `threads` threads for prefill and decode."""
    try:
        from llama_cpp import Llama
    except ImportError as exc:
        raise SystemExit(
            "llama-cpp-python is not installed in this environment: `make bench` installs the bench extra "
            "(pip install -e '.[bench]'; it compiles llama.cpp, ~10 minutes on 2 cores)"
        ) from exc
    return Llama(
        model_path=str(models.gguf_path(model)),
        n_ctx=CONTEXT,
        n_batch=CONTEXT,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )


def _last_logits(llm) -> np.ndarray:
    """The logits of the last token evaluated (llama.cpp computes only that row)."""
    import llama_cpp

    row = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(row, shape=(llm.n_vocab(),))


def _greedy(llm, ids: list[int], new_tokens: int) -> dict:
    """Time one prefill of `ids`, then `new_tokens` greedy one-token steps, from an empty cache."""
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    prefill_s = time.perf_counter() - t0
    token = int(np.argmax(_last_logits(llm)))
    tokens = [token]
    t0, cpu = time.perf_counter(), time.process_time()
    for _ in range(new_tokens):
        llm.eval([token])
        token = int(np.argmax(_last_logits(llm)))
        tokens.append(token)
    decode_s, decode_cpu_s = time.perf_counter() - t0, time.process_time() - cpu
    return {
        "prefill_ms": round(prefill_s * 1000, 2),
        "prefill_tok_s": round(len(ids) / prefill_s, 1),
        "decode_ms": round(decode_s * 1000, 2),
        "decode_tok_s": round(new_tokens / decode_s, 1),
        # CPU time of every thread of the process: on a shared machine, beside the wall time that
        # counts the waits for a core too.
        "decode_cpu_ms": round(decode_cpu_s * 1000, 2),
        "tokens": tokens,
    }


def run(
    threads: int, prompt_tokens: int = 128, new_tokens: int = 32, reps: int = REPS, model: str = MODEL
) -> dict:
    """llama.cpp's prefill and decode on the bench prompt, best of `reps` by total time."""
    import llama_cpp

    ids = [int(i) for i in prompt_ids(prompt_tokens, model)]
    t0 = time.perf_counter()
    llm = _load(threads, model)
    build_s = time.perf_counter() - t0
    _greedy(llm, ids[:8], 1)  # warm-up: first-use allocations and page faults of the mapped file
    best = min((_greedy(llm, ids, new_tokens) for _ in range(reps)),
               key=lambda r: r["prefill_ms"] + r["decode_ms"])  # fmt: skip
    return {
        "engine": f"llama-cpp-python {llama_cpp.__version__}",
        "model": model,
        "threads": threads,
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "build_ms": round(build_s * 1000, 1),
        # The file is mapped: pages of it that were read count here, as they would for any reader.
        "resident_bytes": resident_bytes(),
        **best,
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.llamacpp", description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads for prefill and decode")
    parser.add_argument("--reps", type=int, default=REPS, help="runs to take the best of")
    parser.add_argument("--model", default=MODEL, help="smollm2, gemma3 or a path to a .gguf file")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="the prompt's length in token ids")
    args = parser.parse_args()
    if args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    if args.prompt_tokens < 1:
        parser.error(f"--prompt-tokens must be at least 1, got {args.prompt_tokens}")
    print(json.dumps(run(args.threads, args.prompt_tokens, reps=args.reps, model=args.model)))


if __name__ == "__main__":
    main()
