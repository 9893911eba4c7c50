"""How fast the whole model runs in one process: prefill and decode tokens/s.

The baseline for the pipeline benchmark: the same stage code, all blocks in
this process, no sockets.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable

import numpy as np

from workers import models
from workers.models.footprint import footprint
from workers.models.tokenizer import load_tokenizer
from workers.protocol.report import LayerRange, resident_bytes

MODEL = "smollm2"
# forward(x, start_pos) -> the last position's logits
Forward = Callable[[np.ndarray, int], Awaitable[np.ndarray]]
# A short prompt's rows, then one row: both ways a forward's products go (a prompt's and a decode step's).
WARM_ROWS = 16
PROMPT_TEXT = (
    "The history of computing is a story of machines that grew smaller and faster each decade. "
    "Early computers filled whole rooms, used vacuum tubes and punched cards, and were programmed by hand. "
)


def prompt_ids(n: int, model: str = MODEL) -> np.ndarray:
    """A prompt of exactly n token ids (int32): BOS if the file's prompts start with it, real text repeated.

    Gemma's prompts start with BOS, as a served run's do: the model was trained on text that does.
    """
    tokenizer = load_tokenizer(models.gguf_path(model))
    bos = tokenizer.bos_id if tokenizer.add_bos else None
    return fill(tokenizer.encode(PROMPT_TEXT), n, bos)


def fill(ids: list[int], n: int, bos: int | None = None) -> np.ndarray:
    """n ids (int32): `bos` first if given, then `ids` repeated as needed."""
    head = [] if bos is None else [bos]
    return np.concatenate(
        [np.array(head, dtype=np.int32), np.resize(np.array(ids, dtype=np.int32), n - len(head))]
    )


async def greedy(forward: Forward, prompt: np.ndarray, new_tokens: int) -> dict:
    """Time one prefill of `prompt`, then `new_tokens` greedy one-token steps, through `forward`."""
    t0 = time.perf_counter()
    logits = await forward(prompt, 0)
    prefill_s = time.perf_counter() - t0
    token = int(np.argmax(logits[-1]))
    tokens = [token]
    t0 = time.perf_counter()
    for step in range(new_tokens):
        logits = await forward(np.array([token], dtype=np.int32), len(prompt) + step)
        token = int(np.argmax(logits[-1]))
        tokens.append(token)
    decode_s = time.perf_counter() - t0
    return {
        "prefill_ms": round(prefill_s * 1000, 2),
        "prefill_tok_s": round(len(prompt) / prefill_s, 1),
        "decode_ms": round(decode_s * 1000, 2),
        "decode_tok_s": round(new_tokens / decode_s, 1),
        "tokens": tokens,
    }


def single_process(
    precision: str = "f32", prompt_tokens: int = 128, new_tokens: int = 32, model: str = MODEL, reps: int = 1
) -> dict:
    """Build the whole model here, time one prefill (last position only) and greedy one-token decode steps.

    The best of `reps` runs by total time is kept. resident_bytes is this
    process's resident set after the build: compare precisions each in a
    fresh process. weight_bytes is what the stage's tensors take as held in
    `precision` (the packed blocks for packed).
    """
    info = models.describe(model)
    layers = LayerRange(0, info.n_layers)
    t0 = time.perf_counter()
    stage = models.build(model, layers, precision)
    build_s = time.perf_counter() - t0
    resident = resident_bytes()  # before the tokenizer is loaded, as in a worker
    ids = prompt_ids(prompt_tokens, model)
    # Warm (compile, page in) both paths a product may take, many rows and one row, before timing either.
    stage.forward(ids[:WARM_ROWS], session="warm-up", start_pos=0, last_only=True)
    stage.forward(ids[WARM_ROWS : WARM_ROWS + 1], session="warm-up", start_pos=WARM_ROWS, last_only=True)
    stage.reset("warm-up")

    async def forward(x: np.ndarray, start_pos: int) -> np.ndarray:
        return stage.forward(x, session="bench", start_pos=start_pos, last_only=True)

    best: dict | None = None
    for _ in range(reps):
        timed = asyncio.run(greedy(forward, ids, new_tokens))
        stage.reset("bench")
        if best is None or timed["prefill_ms"] + timed["decode_ms"] < best["prefill_ms"] + best["decode_ms"]:
            best = timed
    assert best is not None, "reps must be at least 1"
    return {
        "model": model,
        "precision": stage.precision,
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "build_ms": round(build_s * 1000, 1),
        "resident_bytes": resident,
        "weight_bytes": footprint(model, precision).stage_bytes(layers),
        "n_params": stage.n_params,
        "n_packed": stage.n_packed,
        **best,
    }


def thread_pools() -> list[dict]:
    """The thread pools loaded in this process and their sizes (BLAS, OpenMP, numba): what really ran."""
    from threadpoolctl import threadpool_info

    pools = [
        {k: p.get(k) for k in ("internal_api", "num_threads", "architecture", "version")}
        for p in threadpool_info()
    ]
    if "numba" in sys.modules:
        import numba

        pools.append({"internal_api": "numba", "num_threads": numba.get_num_threads()})
    return pools
