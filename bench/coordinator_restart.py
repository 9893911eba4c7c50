"""A coordinator SIGKILLed mid-generation and restarted on the same --db: its runs finish (bench.faults).

`coordinator_killed_mid_generation`: SmolLM2 on 3 packed stages, 4 concurrent
64-token greedy generations, the coordinator SIGKILLed once the slowest has 20
tokens, a new one started on the same file: every run finishes, with the
tokens of the same 4 run undisturbed afterwards, and the time from the restart
to the last one finishing. `progress_write_cost`: what writing the tokens as
they come costs the store's thread, per token.
"""

from __future__ import annotations

import asyncio
import signal
import tempfile
import time
from pathlib import Path

from coordinator.stats import ClusterRun, StageTiming, StepTiming
from coordinator.store.history import RunStore
from coordinator.testing import RlxCluster
from coordinator.testing.process import wait_until
from workers.protocol.report import LayerRange

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
    "def fibonacci(n):",
]
TOKENS, KILL_AT, WAIT_S = 64, 20, 300.0


def _serve(db: Path) -> RlxCluster:
    argv = ["serve", "--model", "smollm2", "--stages", "3", "--precision", "packed", "--plan", "even"]
    argv += ["--db", str(db), "--max-active", str(len(PROMPTS)), "--http", "127.0.0.1:0"]
    return RlxCluster.launch(argv)


def _submit(c: RlxCluster) -> list[int]:
    return [c.post_run(prompt=p, max_new_tokens=TOKENS, temperature=0) for p in PROMPTS]


def coordinator_killed_mid_generation() -> dict:
    """Kill the coordinator at token KILL_AT of 4 generations, restart it, time the runs' finishing."""
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "runs.sqlite3"
        first = _serve(db)
        try:
            first.process.said("serving on", WAIT_S)
            ids = _submit(first)
            slowest = lambda: min(len(first.run(i).get("tokens", [])) for i in ids)  # noqa: E731
            wait_until(lambda: slowest() >= KILL_AT, WAIT_S, f"every run to reach token {KILL_AT}")
            at_kill = [len(first.run(i)["tokens"]) for i in ids]
            first.process.proc.send_signal(signal.SIGKILL)
            first.process.proc.wait(WAIT_S)
        finally:
            first.stop()
        restarted = time.monotonic()
        second = _serve(db)
        try:
            second.process.said("serving on", WAIT_S)
            serving = time.monotonic()
            resumed = [second.wait(i, "ok", WAIT_S) for i in ids]
            last = time.monotonic()
            again = _submit(second)
            undisturbed = [second.wait(i, "ok", WAIT_S) for i in again]
            began = min(r["created_at"] for r in undisturbed)
            undisturbed_s = max(r["finished_at"] for r in undisturbed) - began
        finally:
            second.stop()
    return {
        "runs": len(ids),
        "tokens_at_kill": at_kill,
        "tokens_resumed_from": [r["resumed"][0]["tokens"] for r in resumed],
        "all_finished": all(r["status"] == "ok" for r in resumed),
        "tokens_equal": [r["tokens"] == u["tokens"] for r, u in zip(resumed, undisturbed, strict=True)],
        "restart_to_last_finished_s": round(last - restarted, 2),
        "serving_to_last_finished_s": round(last - serving, 2),
        "undisturbed_4_runs_s": round(undisturbed_s, 2),
        "progress_write": progress_write_cost(),
    }


def _record(n_stages: int = 3) -> ClusterRun:
    """A generation's record as it is written while it runs: a prompt, KEPT_STEPS-sized step timings."""
    stage = StageTiming(addr="127.0.0.1:40000", layers=LayerRange(0, 10), device="cpu", build_ms=900,
                        forward_ms=12.0, resident_bytes=1 << 28, compute_ms=10.0)  # fmt: skip
    step = StepTiming(step=1, positions=1, start_ms=1.0, wall_ms=40.0, stage_start_ms=[1.0] * n_stages,
                      forward_ms=[12.0] * n_stages, compute_ms=[10.0] * n_stages)  # fmt: skip
    return ClusterRun(timings=[stage] * n_stages, total_forward_ms=0.0, output=[], status="running",
                      prompt=PROMPTS[0], text="", tokens=[], steps=[step] * 64)  # fmt: skip


async def _write_cost(ticks: int = 40, per_tick: int = 10) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        store = await RunStore.open(Path(tmp) / "runs.sqlite3")
        try:
            runs = [_record() for _ in PROMPTS]
            for run in runs:
                await store.create(run)
            spent = 0.0
            for _ in range(ticks):
                for run in runs:
                    run.tokens = [*run.tokens, *range(per_tick)]
                    run.text += "word " * per_tick
                started = time.perf_counter()
                await store.save_progress(runs)
                spent += time.perf_counter() - started
        finally:
            await store.close()
    tokens = ticks * per_tick * len(runs)
    return {
        "runs": len(runs), "tokens_per_write_per_run": per_tick, "writes": ticks,
        "ms_per_write": round(spent / ticks * 1000, 3), "us_per_token": round(spent / tokens * 1e6, 1),
    }  # fmt: skip


def progress_write_cost() -> dict:
    """Time the progress writes of 4 running generations, 10 new tokens each a write (20 tokens/s a run)."""
    return asyncio.run(_write_cost())
