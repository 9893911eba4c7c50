"""SmolLM2 re-quantized by llama.cpp beside its shipped Q4_1 file: llama.cpp, ours alone and ours served.

The shipped Q4_1 file is re-quantized with llama-cpp-python's
`llama_model_quantize` (Q4_K_M, and Q8_0 beside it) into a cache under the
temporary directory, made once per source file and llama.cpp version, never
committed. For each file, at 1 and 2 threads, REPS rounds alternate llama.cpp,
ours in one process and ours served (`POST /runs` on a running coordinator,
1 packed stage), each a fresh process timing one run after a warm-up;
medians of the rounds. The served figures are the ones that count.

A file's resident bound: the Q4_1 file's stage resident set plus the
difference of the two files' tensor bytes (their GGUF tables).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from bench.fresh import CHILD_TIMEOUT, REPS, THREADS, in_process_decode, llamacpp, thread_env
from bench.served import served_decode
from workers import models

SHIPPED = "Q4_1"
REQUANTIZED = ("Q4_K_M", "Q8_0")
CACHE = Path(tempfile.gettempdir()) / "rlx-bench"
WAYS = ("llamacpp", "in_process", "served")
MB = 1e6


def requantized(ftype: str, source: Path | None = None) -> Path:
    """A file (SmolLM2's shipped one by default) re-quantized to llama.cpp's `ftype` (Q4_K_M, F32, …).

    Made once into CACHE; F32 dequantizes every tensor (the model the file stores, nothing rounded).
    """
    import llama_cpp

    source = source or models.smollm2_path()
    stat = source.stat()
    made = CACHE / f"{source.stem.rsplit('.', 1)[0]}.{ftype}.{stat.st_size}-{llama_cpp.__version__}.gguf"
    if made.is_file():
        return made
    CACHE.mkdir(parents=True, exist_ok=True)
    partial = made.with_suffix(f".{os.getpid()}.part")
    # In a process of its own: llama.cpp writes a line per tensor to the C stderr, kept for an error.
    code = (
        "import ctypes, sys, llama_cpp; p = llama_cpp.llama_model_quantize_default_params(); "
        f"p.ftype = llama_cpp.LLAMA_FTYPE_{'ALL' if ftype == 'F32' else 'MOSTLY'}_{ftype}; "
        "p.allow_requantize = True; "
        "src, dst = (a.encode() for a in sys.argv[1:]); "
        "sys.exit(llama_cpp.llama_model_quantize(src, dst, ctypes.byref(p)))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(source), str(partial)], capture_output=True,
                         text=True, timeout=CHILD_TIMEOUT, check=False)  # fmt: skip
    if out.returncode != 0:
        partial.unlink(missing_ok=True)
        tail = "\n".join(out.stderr.strip().splitlines()[-10:])
        raise SystemExit(f"re-quantizing {source.name} to {ftype} failed:\n{tail}")
    partial.replace(made)  # whole or absent: a bench stopped midway leaves no half file behind
    return made


def type_mix(path: Path) -> dict:
    """The file's tensor bytes from its GGUF table, and how many tensors and bytes each stored type holds."""
    from workers.models.gguf_file import open_gguf

    count: Counter[str] = Counter()
    held: Counter[str] = Counter()
    for e in open_gguf(path).tensors.values():
        count[e.qtype.name] += 1
        held[e.qtype.name] += e.n_bytes
    types = {t: {"tensors": count[t], "bytes": held[t]} for t, _ in held.most_common()}
    return {"tensor_bytes": sum(held.values()), "types": types}


def measure_quants() -> dict:
    """Every file at each thread count, REPS rounds of llama.cpp, in one process and served, alternated."""
    files = {SHIPPED: models.smollm2_path()}
    for ftype in REQUANTIZED:
        step(f"re-quantizing SmolLM2 to {ftype} (cached in {CACHE})")
        files[ftype] = requantized(ftype)
    timed = alternate({name: str(path) for name, path in files.items()})
    out = {
        name: {"file": str(path), **type_mix(path), "threads": timed[name]} for name, path in files.items()
    }
    for name in files:
        _bound(out, name)
    return out


def alternate(specs: dict[str, str], prompt_tokens: int = 128) -> dict:
    """REPS rounds, at each thread count, of llama.cpp, ours in one process and ours served on each model.

    specs: a name for each model (a model name or a path to a GGUF file); the result: each name's
    `_summary` at each thread count. Each run is a fresh process timing one run after a warm-up.
    """
    runs = {name: {str(t): {way: [] for way in WAYS} for t in THREADS} for name in specs}
    for round_ in range(REPS):
        for threads in THREADS:
            fixed = os.environ | thread_env(threads) | {"RLX_THREAD_RULE": "fixed"}
            for name, model in specs.items():
                step(f"round {round_ + 1}/{REPS}, {name}, {threads} thread(s): llama.cpp, alone, served")
                by = runs[name][str(threads)]
                by["llamacpp"].append(llamacpp(threads, model, reps=1, prompt_tokens=prompt_tokens))
                by["in_process"].append(in_process_decode(threads, model, prompt_tokens))
                by["served"].append(served_decode(fixed, prompt_tokens, model=model))
    return {name: {t: _summary(by) for t, by in runs[name].items()} for name in specs}


def _summary(by: dict[str, list[dict]]) -> dict:
    """Each way's medians (runs beside them), ours over llama.cpp's, served over in one process."""
    out: dict = {}
    for way, rs in by.items():
        held = "worker_resident_bytes" if way == "served" else "resident_bytes"
        out[way] = {k: statistics.median(r[k] for r in rs) for k in ("prefill_tok_s", "decode_tok_s")}
        out[way] |= {
            "runs_decode_tok_s": [r["decode_tok_s"] for r in rs],
            "runs_prefill_tok_s": [r["prefill_tok_s"] for r in rs],
            "resident_bytes": int(statistics.median(r[held] for r in rs)),
            "tokens": rs[0]["tokens"],
        }
    ref = out["llamacpp"]
    for way in ("in_process", "served"):
        out[way]["over_llamacpp"] = {k: round(out[way][f"{k}_tok_s"] / ref[f"{k}_tok_s"], 2)
                                     for k in ("prefill", "decode")}  # fmt: skip
        out[way]["same_tokens_as_llamacpp"] = _same(out[way]["tokens"], ref["tokens"])
    served, alone = out["served"], out["in_process"]
    out["served_over_in_process"] = {
        k: round(served[f"{k}_tok_s"] / alone[f"{k}_tok_s"], 2) for k in ("prefill", "decode")
    }
    return out


def _same(a: list[int], b: list[int]) -> str:
    """How many leading greedy tokens two runs share, of how many."""
    same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return f"{same}/{len(a)}"


def _bound(out: dict, name: str) -> None:
    """Each resident set's bound: the Q4_1 file's stage (same threads, way) + the tensor bytes' difference."""
    extra = out[name]["tensor_bytes"] - out[SHIPPED]["tensor_bytes"]
    for t, summary in out[name]["threads"].items():
        for way in ("in_process", "served"):
            bound = out[SHIPPED]["threads"][t][way]["resident_bytes"] + extra
            figures = summary[way]
            figures["resident_bound_bytes"] = bound
            figures["resident_within_bound"] = figures["resident_bytes"] <= bound


def step(what: str) -> None:
    print(f"{what} …", file=sys.stderr, flush=True)


def _mix_line(name: str, q: dict) -> str:
    mix = ", ".join(f"{t} {v['tensors']} ({v['bytes'] / MB:.1f} MB)" for t, v in q["types"].items())
    return f"{name}: {q['tensor_bytes'] / MB:.1f} MB of tensors: {mix}"


def print_quants(quants: dict) -> None:
    """One row per file and thread count: llama.cpp, ours in one process and served, resident sets."""
    print()
    for name, q in quants.items():
        print(_mix_line(name, q))
    print()
    row("file", "threads", "llama.cpp prefill / decode tok/s", "1 process prefill / decode tok/s",
        "× llama.cpp", "served prefill / decode tok/s", "served × llama.cpp", "served × 1 process",
        "resident MB llama.cpp / 1 process / served worker", "bound MB (served)",
        "greedy = llama.cpp")  # fmt: skip
    row(*["---"] * 11)
    for name, q in quants.items():
        for t, s in q["threads"].items():
            ref, alone, served = s["llamacpp"], s["in_process"], s["served"]
            mark = "ok" if served["resident_within_bound"] else "over"
            row(name, t, _pair(ref), _pair(alone), _pair(alone["over_llamacpp"], "{}"), _pair(served),
                _pair(served["over_llamacpp"], "{}"), _pair(s["served_over_in_process"], "{}"),
                " / ".join(f"{s[w]['resident_bytes'] / MB:.0f}" for w in WAYS),
                f"{served['resident_bound_bytes'] / MB:.0f} ({mark})",
                served["same_tokens_as_llamacpp"])  # fmt: skip
    print("× is prefill / decode; medians of rounds alternating the three; the served figures count")


def _pair(d: dict, fmt: str = "{:.1f}") -> str:
    keys = ("prefill", "decode") if "prefill" in d else ("prefill_tok_s", "decode_tok_s")
    return " / ".join(fmt.format(d[k]) for k in keys)


def row(*cells: object) -> None:
    print("| " + " | ".join(map(str, cells)) + " |")
