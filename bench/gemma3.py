"""Gemma 3 270M (its shipped Q4_K_M file) beside llama.cpp on the same prompt ids, and the targets to meet.

At 1 and 2 threads, REPS rounds alternate llama.cpp, ours in one process and
ours served (`POST /runs` on a coordinator serving 1 packed stage), each a
fresh process (bench.quants.alternate): prefill of a PROMPT_TOKENS prompt,
decode of 32 tokens, the resident set of one process; medians. Then through
STAGES workers of 1 thread each: decode beside the one-process figure at 1
thread, and the measured plan's slowest stage over its mean stage
(bench.planner). The served figures are the ones that count.
"""

from __future__ import annotations

import asyncio
import sys

from bench.fresh import REPS, thread_env
from bench.pipeline import through_workers
from bench.planner import even_vs_measured
from bench.quants import alternate, type_mix
from workers import models

MODEL = "gemma3"
PROMPT_TOKENS = 110
STAGES = 3
WAYS = ("in_process", "served")
# What the figures must reach: ours over llama.cpp's at the same threads (resident: at most), STAGES
# workers' decode over one process's at 1 thread, and the measured plan's slowest stage over the mean.
TARGETS = {
    "prefill": 1.0,
    "decode": 1.0,
    "decode_stretch": 1.3,
    "resident": 1.1,
    "workers_decode": 0.9,
    "slowest_over_mean": 1.10,
}
MB = 1e6


def measure_gemma3(model: str = MODEL) -> dict:
    """Every figure of the section on `model` (gemma3 or a path), with their ratios and the targets."""
    path = models.gguf_path(model)
    out: dict = {"file": str(path), **type_mix(path), "prompt_tokens": PROMPT_TOKENS}
    out["threads"] = alternate({model: model}, PROMPT_TOKENS)[model]
    step(f"{model}: {STAGES} workers, 1 thread each")
    out["workers"] = asyncio.run(
        through_workers(STAGES, "packed", PROMPT_TOKENS, model=model, reps=REPS, env=thread_env(1))
    )
    step(f"{model}: even and measured plans of {STAGES} stages, 1 thread each")
    out["plan"] = asyncio.run(
        even_vs_measured(STAGES, "packed", PROMPT_TOKENS, model=model, env=thread_env(1))
    )
    return out | {"ratios": ratios(out)}


def ratios(out: dict) -> dict:
    """Ours over llama.cpp's per thread count and way, workers over one process, the plan's balance.

    Each figure beside whether it meets its target (`met`); decode's stretch target apart.
    """
    by_threads: dict = {}
    for threads, s in out["threads"].items():
        ref = s["llamacpp"]
        by_threads[threads] = {}
        for way in WAYS:
            ours = s[way]
            figures = {
                "prefill": round(ours["prefill_tok_s"] / ref["prefill_tok_s"], 2),
                "decode": round(ours["decode_tok_s"] / ref["decode_tok_s"], 2),
                "resident": round(ours["resident_bytes"] / ref["resident_bytes"], 2),
            }
            figures["met"] = {
                "prefill": figures["prefill"] >= TARGETS["prefill"],
                "decode": figures["decode"] >= TARGETS["decode"],
                "decode_stretch": figures["decode"] >= TARGETS["decode_stretch"],
                "resident": figures["resident"] <= TARGETS["resident"],
            }
            by_threads[threads][way] = figures
    alone = out["threads"]["1"]["in_process"]["decode_tok_s"]
    workers = round(out["workers"]["decode_tok_s"] / alone, 2)
    balance = out["plan"]["measured"]["slowest_over_mean"]
    return {
        "vs_llamacpp": by_threads,
        "workers_decode_over_one_process": workers,
        "slowest_over_mean": balance,
        "slowest_over_mean_floor": balance_floor(
            out["plan"]["layer_ms"], out["plan"]["stage_ms"], STAGES, out["plan"].get("head_ms", 0.0)
        ),
        "met": {
            "workers_decode": workers >= TARGETS["workers_decode"],
            "slowest_over_mean": balance <= TARGETS["slowest_over_mean"],
        },
    }


def balance_floor(layer_ms: list[float], stage_ms: float, stages: int, head_ms: float = 0.0) -> float:
    """The least slowest-over-mean any split into `stages` can reach: its costliest layer on a stage alone.

    head_ms: the head, timed apart from the last layer (Gemma's 262144 × 640 is most of a step), whose
    rows a plan may cut across stages; 0 when the last layer's cost holds it, which no split divides.
    """
    total = sum(layer_ms) + head_ms + stages * stage_ms
    return round(max(max(layer_ms) + stage_ms, total / stages) * stages / total, 3)


def step(what: str) -> None:
    print(f"{what} …", file=sys.stderr, flush=True)


def row(*cells: object) -> None:
    print("| " + " | ".join(map(str, cells)) + " |")


def _mark(ratio: float, met: bool) -> str:
    return f"{ratio} ({'ok' if met else 'short'})"


def print_gemma3(g: dict) -> None:
    """One row per way and thread count, each figure over llama.cpp's with its target; then the workers."""
    t = TARGETS
    mix = ", ".join(f"{k} {v['tensors']} ({v['bytes'] / MB:.1f} MB)" for k, v in g["types"].items())
    print(f"\ngemma3: {g['file']}: {g['tensor_bytes'] / MB:.1f} MB of tensors: {mix}")
    print(f"prompt of {g['prompt_tokens']} ids, 32 decoded; medians of {REPS} alternated rounds\n")
    row("gemma3", "threads", "prefill tok/s", "× llama.cpp", "decode tok/s", "× llama.cpp",
        "resident MB", "× llama.cpp", "greedy = llama.cpp")  # fmt: skip
    row(*["---"] * 9)
    for threads, s in g["threads"].items():
        ref = s["llamacpp"]
        row("llama.cpp", threads, ref["prefill_tok_s"], 1, ref["decode_tok_s"], 1,
            f"{ref['resident_bytes'] / MB:.0f}", 1, "")  # fmt: skip
        for way in ("served", "in_process"):
            ours, r = s[way], g["ratios"]["vs_llamacpp"][threads][way]
            name = "ours served (counts)" if way == "served" else "ours in one process"
            row(name, threads, ours["prefill_tok_s"], _mark(r["prefill"], r["met"]["prefill"]),
                ours["decode_tok_s"], _mark(r["decode"], r["met"]["decode"]),
                f"{ours['resident_bytes'] / MB:.0f}", _mark(r["resident"], r["met"]["resident"]),
                ours["same_tokens_as_llamacpp"])  # fmt: skip
    print(f"targets: prefill ≥ {t['prefill']}×, decode ≥ {t['decode']}× (stretch {t['decode_stretch']}×), "
          f"resident ≤ {t['resident']}× llama.cpp's at the same threads")  # fmt: skip
    w, r = g["workers"], g["ratios"]
    measured = g["plan"]["measured"]
    print(
        f"{STAGES} workers, 1 thread each: decode {w['decode_tok_s']} tok/s, "
        f"{_mark(r['workers_decode_over_one_process'], r['met']['workers_decode'])} one process "
        f"(target ≥ {t['workers_decode']}); forward ms per token per stage "
        f"{[round(ms / w['new_tokens'], 1) for ms in w['decode_stage_ms']]}; resident MB "
        f"{' / '.join(f'{b / MB:.0f}' for b in w['resident_bytes'])}"
    )
    print(
        f"measured plan {' '.join(measured['ranges'])}: compute ms/token {measured['compute_ms']}, "
        f"slowest / mean {_mark(r['slowest_over_mean'], r['met']['slowest_over_mean'])} "
        f"(target ≤ {t['slowest_over_mean']}; even: {g['plan']['even']['slowest_over_mean']}; by the "
        f"layers' calibrated costs no split of whole layers goes below {r['slowest_over_mean_floor']}: "
        "the last holds the head)"
    )
