"""`make bench`: the model against llama.cpp, in one process and through 3 workers, side by side in one run.

Writes bench/results.json and prints the tables. Every single-process figure
(ours and llama.cpp's) comes from a fresh process started with its thread
variables set, so its resident set and thread pools are its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

from bench.concurrency import concurrent_chats
from bench.decode_parts import lines as decode_parts_lines
from bench.decode_parts import rounds as decode_parts
from bench.faults import faults
from bench.fidelity import lines as fidelity_lines
from bench.fidelity_parts import lines as fidelity_parts_lines
from bench.fresh import REPS, THREAD_VARS, THREADS, fresh, in_process_decode, llamacpp, thread_env
from bench.gemma3 import measure_gemma3, print_gemma3
from bench.load import load_while_running
from bench.model import MODEL
from bench.pipeline import hop_line, hop_overhead, through_workers
from bench.planner import even_vs_measured
from bench.quants import measure_quants, print_quants
from bench.recovery import lines as recovery_lines
from bench.served import served_decode
from bench.store import paging
from bench.tokenizer_load import spm_load
from coordinator.plan.split import split
from workers import models
from workers.models.footprint import footprint
from workers.models.weights import PRECISIONS

RESULTS = Path(__file__).with_name("results.json")
STAGES = 3
# A packed stage's resident budget: its packed bytes with 20% to spare, plus the interpreter and libraries.
BUDGET_FACTOR, BUDGET_FIXED = 1.2, 80e6
MB = 1e6
FIDELITY_MODELS = ("gemma3", "smollm2")


def single(precision: str, threads: int) -> dict:
    """bench.model.single_process in a fresh interpreter, best of REPS, with its thread pools."""
    code = (
        "import json; from bench.model import single_process, thread_pools; "
        f"print(json.dumps(single_process({precision!r}, reps={REPS}) | {{'pools': thread_pools()}}))"
    )
    return fresh(["-c", code], threads) | {"threads": threads}


def packed_decode() -> dict:
    """Packed decode in one process and served through a coordinator, at each thread count, alternated.

    REPS rounds, each: in one process then served on 1 thread, the same on 2, then served as the
    thread rule chooses (the worker's share of the cores, fewer while measured faster). Medians.
    """
    rule_env = {k: v for k, v in os.environ.items() if k not in (*THREAD_VARS, "RLX_THREAD_RULE")}
    runs: dict[str, dict[str, list[dict]]] = {}
    for _ in range(REPS):
        for threads in THREADS:
            by = runs.setdefault(str(threads), {"in_process": [], "served": []})
            step(f"packed decode, {threads} thread(s): one process, then served")
            by["in_process"].append(in_process_decode(threads))
            fixed = os.environ | thread_env(threads) | {"RLX_THREAD_RULE": "fixed"}
            by["served"].append(served_decode(fixed))
        step("packed decode served, threads as the rule chooses")
        runs.setdefault("rule", {"served": []})["served"].append(served_decode(rule_env))
    return {key: _medians(by) for key, by in runs.items()}


def _medians(by: dict[str, list[dict]]) -> dict:
    """Each way's median decode tokens/s (its runs beside it) and served over in one process."""
    out: dict = {}
    for way, rs in by.items():
        out[way] = {
            "decode_tok_s": statistics.median(r["decode_tok_s"] for r in rs),
            "runs_tok_s": [r["decode_tok_s"] for r in rs],
            "tokens": rs[0]["tokens"],
        }
        if way == "served":
            out[way]["prefill_tok_s"] = statistics.median(r["prefill_tok_s"] for r in rs)
            out[way]["prompt_tokens"] = rs[0]["prompt_tokens"]
            for k in ("cpu_ms_per_step", "run_delay_ms_per_step"):
                out[way][k] = {p: statistics.median(r[k][p] for r in rs) for p in rs[0][k]}
    if "in_process" in out:
        served, alone = out["served"]["decode_tok_s"], out["in_process"]["decode_tok_s"]
        out["served_over_in_process"] = round(served / alone, 2)
    return out


def fidelity() -> dict:
    """bench.fidelity in a fresh interpreter on 1 thread, for each of FIDELITY_MODELS."""
    return {m: fresh(["-m", "bench.fidelity", "--model", m, "--threads", "1"], 1) for m in FIDELITY_MODELS}


def fidelity_parts() -> dict:
    """bench.fidelity_parts in a fresh interpreter: the logits' error of each rounding alone."""
    return fresh(["-m", "bench.fidelity_parts"], 1)


def floors() -> dict:
    """bench.floors in fresh interpreters: a packed process before its weights, f32's products alone."""
    memory = fresh(["-m", "bench.floors", "memory"], 1)
    products = {str(t): fresh(["-m", "bench.floors", "products"], t) for t in THREADS}
    return {"memory": memory, "products": products}


def workers(precision: str, threads: int) -> dict:
    """STAGES workers of `precision`, each on `threads` threads, with each stage's weight bytes."""
    timed = asyncio.run(through_workers(STAGES, precision, reps=REPS, env=thread_env(threads)))
    held = footprint(MODEL, precision)
    ranges = split(models.describe(MODEL).n_layers, STAGES)
    return timed | {"threads": threads, "weight_bytes": [held.stage_bytes(r) for r in ranges]}


async def api_load() -> dict:
    """A coordinator process serving fake stages, loaded over loopback by this one."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "coordinator", "run", "--model", "fake:layers=4,delay_ms=20", "--stages", "2",
        "--db", ":memory:", "--serve", "--http", f"127.0.0.1:{port}",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        while b"serving on" not in await asyncio.wait_for(proc.stderr.readline(), 60):
            pass
        return await load_while_running(f"http://127.0.0.1:{port}", requests=5000, concurrency=64)
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 30)


def step(what: str) -> None:
    print(f"{what} …", file=sys.stderr, flush=True)


def measure_models() -> dict:
    """llama.cpp and every precision at each thread count, then packed (and the rest) through workers."""
    results: dict = {"llamacpp": {}, "single": {p: {} for p in PRECISIONS}, "pipeline": {}}
    for threads in THREADS:
        step(f"llama.cpp, {threads} thread(s)")
        results["llamacpp"][str(threads)] = llamacpp(threads)
        for precision in PRECISIONS:
            step(f"{precision}, one process, {threads} thread(s)")
            results["single"][precision][str(threads)] = single(precision, threads)
    # Decode runs one stage at a time, so a stage gets the cores to itself; 1 thread per worker is the
    # rule (cores // workers, at least 1), and 2 per worker shows what oversubscribing 2 cores costs.
    results["packed_decode"] = packed_decode()
    runs = [(p, 1) for p in PRECISIONS] + [("packed", 2)]
    for precision, threads in runs:
        step(f"{precision}, {STAGES} workers, {threads} thread(s) each")
        results["pipeline"][f"{precision}/{threads}"] = workers(precision, threads)
    step("floors: a packed process before its weights, the f32 prompt's products alone")
    results["floors"] = floors()
    return results


def compare(results: dict) -> dict:
    """Each figure over llama.cpp's at the same threads, and workers over one process at the same threads."""
    ratios: dict = {"vs_llamacpp": {}, "workers_vs_single": {}}
    for precision, by_threads in results.get("single", {}).items():
        for threads, a in by_threads.items():
            ratios["vs_llamacpp"][f"{precision}/{threads}"] = _over(a, results["llamacpp"][threads])
    for key, b in results.get("pipeline", {}).items():
        precision, threads = key.split("/")
        ratios["workers_vs_single"][key] = _over(b, results["single"][precision][threads])
    # Packed decode as a user gets it, served, is the figure that counts; in one process beside it.
    for threads, d in results.get("packed_decode", {}).items():
        ref = results["llamacpp"][threads if threads in results["llamacpp"] else str(max(THREADS))]
        entry = ratios["vs_llamacpp"].setdefault(f"packed/{threads}", {})
        entry["decode_served"] = round(d["served"]["decode_tok_s"] / ref["decode_tok_s"], 2)
        if "in_process" in d:
            entry["decode_in_process"] = round(d["in_process"]["decode_tok_s"] / ref["decode_tok_s"], 2)
            entry["decode"] = entry["decode_served"]
    return ratios


def _over(a: dict, b: dict) -> dict:
    """a's prefill and decode tokens/s over b's, and how many leading greedy tokens they share."""
    same = next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"], strict=False)) if x != y),
                min(len(a["tokens"]), len(b["tokens"])))  # fmt: skip
    return {
        "prefill": round(a["prefill_tok_s"] / b["prefill_tok_s"], 2),
        "decode": round(a["decode_tok_s"] / b["decode_tok_s"], 2),
        "same_tokens": f"{same}/{len(a['tokens'])}",
    }


def budget(resident: int, weight_bytes: int) -> str:
    """Whether a packed stage's resident set is within its budget, as 'ok' or 'over'."""
    return "ok" if resident <= BUDGET_FACTOR * weight_bytes + BUDGET_FIXED else "over"


def row(*cells: object) -> None:
    print("| " + " | ".join(map(str, cells)) + " |")


def megabytes(values: list[int]) -> str:
    return " / ".join(f"{v / MB:.0f}" for v in values)


def print_models(results: dict, ratios: dict) -> None:
    """The model tables, every figure next to llama.cpp's at the same thread count."""
    print()
    row("one process", "threads", "prefill tok/s", "× llama.cpp", "decode tok/s", "× llama.cpp",
        "resident MB", "weights MB", "greedy = llama.cpp")  # fmt: skip
    row(*["---"] * 9)
    for threads in map(str, THREADS):
        ref = results["llamacpp"][threads]
        row(ref["engine"], threads, ref["prefill_tok_s"], 1, ref["decode_tok_s"], 1,
            megabytes([ref["resident_bytes"]]), "—", "")  # fmt: skip
    for precision, by_threads in results["single"].items():
        for threads, a in by_threads.items():
            r = ratios["vs_llamacpp"][f"{precision}/{threads}"]
            name = precision if a["precision"] == precision else f"{precision} ({a['precision']})"
            held = megabytes([a["weight_bytes"]])
            if precision == "packed":
                held += f" ({budget(a['resident_bytes'], a['weight_bytes'])})"
            row(f"rlx-cluster {name}", threads, a["prefill_tok_s"], r["prefill"], a["decode_tok_s"],
                r["decode"], megabytes([a["resident_bytes"]]), held, r["same_tokens"])  # fmt: skip
    print()
    row(f"{STAGES} workers", "threads each", "prefill tok/s", "decode tok/s", "decode × 1 process",
        "decode × llama.cpp", "resident per stage MB", "weights per stage MB")  # fmt: skip
    row(*["---"] * 8)
    rule = max(1, (os.cpu_count() or 1) // STAGES)
    for key, b in results["pipeline"].items():
        precision, threads = key.split("/")
        versus = b["decode_tok_s"] / results["llamacpp"][threads]["decode_tok_s"]
        held = megabytes(b["weight_bytes"])
        if precision == "packed":
            held += " (" + " / ".join(map(budget, b["resident_bytes"], b["weight_bytes"])) + ")"
        note = " (oversubscribed)" if int(threads) > rule else ""
        row(precision, threads + note, b["prefill_tok_s"], b["decode_tok_s"],
            ratios["workers_vs_single"][key]["decode"], f"{versus:.2f}", megabytes(b["resident_bytes"]),
            held)  # fmt: skip
    print(
        f"\n× 1 process: over one process at the same threads. (ok): a packed stage's resident set is "
        f"≤ {BUDGET_FACTOR} × its weights + {BUDGET_FIXED / MB:.0f} MB."
    )
    print_floors(results)
    print_served(results, ratios)


def print_served(results: dict, ratios: dict) -> None:
    """Packed decode in one process and served, side by side, each over llama.cpp's."""
    print()
    row("packed decode", "threads", "one process tok/s", "served tok/s", "served × 1 process",
        "served × llama.cpp", "1 process × llama.cpp", "CPU ms/step coord / worker",
        "run delay ms/step coord / worker")  # fmt: skip
    row(*["---"] * 9)
    for threads, d in results["packed_decode"].items():
        r, served = ratios["vs_llamacpp"][f"packed/{threads}"], d["served"]
        cpu, delay = served["cpu_ms_per_step"], served["run_delay_ms_per_step"]
        alone = d.get("in_process", {}).get("decode_tok_s", "—")
        row("SmolLM2 Q4_1", threads, alone, served["decode_tok_s"], d.get("served_over_in_process", "—"),
            r["decode_served"], r.get("decode_in_process", "—"), f"{cpu['coordinator']} / {cpu['worker']}",
            f"{delay['coordinator']} / {delay['worker']}")  # fmt: skip
    print("rule: served with no thread variables set: the worker's share of the cores, fewer while faster")


def print_floors(results: dict) -> None:
    """What a packed process holds before its weights; f32's prompt products against 2 × llama.cpp."""
    m = {step: b / MB for step, b in results["floors"]["memory"].items()}
    numba, jit = m["numba"] - m["libraries"], m["first_kernel"] - m["numba"]
    rest = m["all_kernels"] - m["first_kernel"]
    print(
        f"a packed process before any weight: Python and the libraries {m['libraries']:.0f} MB, numba "
        f"+{numba:.0f}, its JIT loading the first cached kernel +{jit:.0f}, the other kernels +{rest:.0f}: "
        f"{m['all_kernels']:.0f} MB, where the budget leaves {BUDGET_FIXED / MB:.0f} MB beside the weights"
    )
    for threads, f in results["floors"]["products"].items():
        allowed = f["rows"] / (2 * results["llamacpp"][threads]["prefill_tok_s"]) * 1000
        print(
            f"f32 prompt of {f['rows']} rows, {threads} thread(s): its {7 * f['layers']} products alone "
            f"(BLAS) take {f['products_ms']} ms; 2 × llama.cpp's prefill allows "
            f"{allowed:.0f} ms for the whole forward"
        )


def print_rest(results: dict) -> None:
    """One line for each of the other sections that ran."""
    for name, hop in results.get("hop", {}).items():
        print(hop_line(name, hop))
    if s := results.get("store"):
        p50, p99 = s["list_p50_ms"], s["list_p99_ms"]
        print(f"store: /runs page of 50 over {s['runs']} runs: p50 {p50} ms, p99 {p99} ms")
    if h := results.get("api_load"):
        print(f"api: {h['requests']} requests, {h['concurrency']} concurrent: ", end="")
        print(f"{h['errors']} errors, p99 {h['p99_ms']} ms")
    for key in ("plan", "plan_gemma3"):
        plan = results.get(key)
        for name in ("even", "measured") if plan else ():
            f = plan[name]
            print(f"{key} {name}: {', '.join(f['ranges'])}: compute ms/token {f['compute_ms']}, "
                  f"slowest/mean {f['slowest_over_mean']} "
                  f"(predicted {f['predicted_slowest_over_mean']}; target ≤ 1.10)")  # fmt: skip
    for precision, c in results.get("concurrency", {}).items():
        print(f"{c['chats']} concurrent chats ({precision}, {c['stages']} workers): "
              f"{c['concurrent_tok_s']} tok/s vs {c['one_at_a_time_tok_s']} one at a time: "
              f"× {c['ratio']} (target ≥ {c['target_ratio']}) with {c['lanes']} decode lanes, "
              f"{c['one_lane_tok_s']} tok/s with one; same tokens: {c['same_tokens_as_alone']}; "
              f"{c['cpu_s_together']} CPU-s, {c['cores_busy_together']} cores busy, "
              f"× {c['ratio_with_every_core_busy']} had every core been busy")  # fmt: skip
    if d := results.get("decode_parts"):
        print("\n".join(decode_parts_lines(d)))
    for f in results.get("fidelity", {}).values():
        print("\n".join(fidelity_lines(f)))
    if f := results.get("fidelity_parts"):
        print("\n".join(fidelity_parts_lines(f)))
    for name, figures in results.get("faults", {}).items():
        if name == "generation_recovery":
            print("\n".join(recovery_lines(figures)))
            continue
        print(f"fault {name}: " + ", ".join(f"{k} {v}" for k, v in figures.items() if k != "error"))


def measure_served() -> dict:
    """llama.cpp at each thread count, then packed decode in one process and served (packed_decode)."""
    reference = {}
    for threads in THREADS:
        step(f"llama.cpp, {threads} thread(s)")
        reference[str(threads)] = llamacpp(threads)
    return {"llamacpp": reference, "packed_decode": packed_decode()}


SECTIONS = {
    "models": measure_models,
    "served": measure_served,
    "q4_k_m": lambda: {"quants": measure_quants()},
    "gemma3": lambda: {"gemma3": measure_gemma3()},
    "fidelity": lambda: {"fidelity": fidelity()},
    "fidelity_parts": lambda: {"fidelity_parts": fidelity_parts()},
    "decode_parts": lambda: {"decode_parts": decode_parts("gemma3", 110)},
    "hop": lambda: {
        "hop": {"fake_6ms": asyncio.run(hop_overhead(6.0)), "fake_0ms": asyncio.run(hop_overhead(0.0))}
    },
    "store": lambda: {"store": paging(10_000)},
    "tokenizer": lambda: {"tokenizer": {"spm_gemma3_size": spm_load()}},
    "api": lambda: {"api_load": asyncio.run(api_load())},
    "faults": lambda: {"faults": faults()},
    "plan": lambda: {
        "plan": asyncio.run(even_vs_measured(precision="packed")),
        # Gemma 3's head is most of a step: its plan is the one that must cut the head's rows.
        "plan_gemma3": asyncio.run(even_vs_measured(3, "packed", 110, model="gemma3", env=thread_env(1))),
    },
    "concurrency": lambda: {
        "concurrency": {p: asyncio.run(concurrent_chats(precision=p)) for p in ("packed", "f32")}
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("sections", nargs="*", help=f"what to run, of {', '.join(SECTIONS)} (default: all)")
    chosen = parser.parse_args().sections or list(SECTIONS)
    if unknown := [name for name in chosen if name not in SECTIONS]:
        parser.error(f"no section {', '.join(map(repr, unknown))}; the sections are {', '.join(SECTIONS)}")
    started = time.monotonic()
    results: dict = {}
    for name in chosen:
        step(name)
        results |= SECTIONS[name]()
    if "models" in chosen or "served" in chosen:
        results["ratio"] = compare(results)
    results["wall_s"] = round(time.monotonic() - started, 1)
    results["load_average"] = os.getloadavg()
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results))
    if "models" in chosen:
        print_models(results, results["ratio"])
    elif "served" in chosen:
        print_served(results, results["ratio"])
    if "quants" in results:
        print_quants(results["quants"])
    if "gemma3" in results:
        print_gemma3(results["gemma3"])
    print_rest(results)
    print(f"wall {results['wall_s']} s, load average {' '.join(f'{x:.2f}' for x in results['load_average'])}")


if __name__ == "__main__":
    main()
