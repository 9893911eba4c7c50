"""`make bench`: the model in one process vs through 3 workers, side by side in one run.

Writes bench/results.json and prints a table. Each single-process figure comes
from a fresh process so its resident set is its own.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

from bench.faults import faults
from bench.load import load_while_running
from bench.pipeline import hop_overhead, through_workers
from bench.store import paging

RESULTS = Path(__file__).with_name("results.json")
PRECISIONS = ("f32", "f16", "packed")
REPS = 3


def single(precision: str) -> dict:
    """bench.model.single_process in a fresh interpreter, best of REPS by total time."""
    code = (
        "import json; from bench.model import single_process; "
        f"print(json.dumps(min((single_process({precision!r}) for _ in range({REPS})), "
        "key=lambda r: r['prefill_ms'] + r['decode_ms'])))"
    )
    command = [sys.executable, "-c", code]
    out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


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


def main() -> None:
    started = time.monotonic()
    results: dict = {"single": {}, "pipeline": {}, "ratio": {}}
    for precision in PRECISIONS:
        print(f"precision {precision}: single process …", file=sys.stderr, flush=True)
        results["single"][precision] = single(precision)
        print(f"precision {precision}: 3 workers …", file=sys.stderr, flush=True)
        results["pipeline"][precision] = asyncio.run(through_workers(3, precision, reps=REPS))
        a, b = results["single"][precision], results["pipeline"][precision]
        results["ratio"][precision] = {
            "prefill_time_b_over_a": round(b["prefill_ms"] / a["prefill_ms"], 3),
            "decode_time_b_over_a": round(b["decode_ms"] / a["decode_ms"], 3),
        }
    print("hop floor …", file=sys.stderr, flush=True)
    results["hop"] = {"fake_6ms": asyncio.run(hop_overhead(6.0)), "fake_0ms": asyncio.run(hop_overhead(0.0))}
    print("store paging …", file=sys.stderr, flush=True)
    results["store"] = paging(10_000)
    print("HTTP load …", file=sys.stderr, flush=True)
    results["api_load"] = asyncio.run(api_load())
    print("faults …", file=sys.stderr, flush=True)
    results["faults"] = faults()
    results["wall_s"] = round(time.monotonic() - started, 1)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")

    resident = "resident per stage (MB)"
    print(f"{'precision':<10}{'':<10}{'prefill tok/s':>14}{'decode tok/s':>14}{resident:>30}")
    for precision in PRECISIONS:
        a, b, r = results["single"][precision], results["pipeline"][precision], results["ratio"][precision]
        single_mb = f"{a['resident_bytes'] / 1e6:.0f}"
        print(f"{precision:<10}{'1 proc':<10}{a['prefill_tok_s']:>14}{a['decode_tok_s']:>14}{single_mb:>30}")
        stages = " / ".join(f"{x / 1e6:.0f}" for x in b["resident_bytes"])
        print(f"{'':<10}{'3 workers':<10}{b['prefill_tok_s']:>14}{b['decode_tok_s']:>14}{stages:>30}")
        print(f"{'':<10}{'b/a time':<10}{r['prefill_time_b_over_a']:>14}{r['decode_time_b_over_a']:>14}")
    for name, hop in results["hop"].items():
        p50, mean = hop["hop_ms_p50"], hop["hop_ms_mean"]
        print(f"hop ({name}): forward_ms - compute_ms per stage p50 {p50} ms, mean {mean} ms")
    s, h = results["store"], results["api_load"]
    print(
        f"store: /runs page of 50 over {s['runs']} runs: p50 {s['list_p50_ms']} ms, p99 {s['list_p99_ms']} ms"
    )
    print(
        f"api: {h['requests']} requests, {h['concurrency']} concurrent: "
        f"{h['errors']} errors, p99 {h['p99_ms']} ms"
    )
    for name, figures in results["faults"].items():
        print(f"fault {name}: " + ", ".join(f"{k} {v}" for k, v in figures.items() if k != "error"))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
