"""Events delivered to concurrent SSE clients during a generation, and the run's time with and without them.

`python -m bench.events [--model smollm2] [--stages 3] [--tokens 64] [--clients 10] [--reps 3]` starts
`rlx-cluster serve` on loopback, runs the same greedy generation REPS times with no one listening, then
REPS times while CLIENTS streams of /events are open (each reading every event), alternating the two so
a drift of the machine hits both alike. It prints JSON: the run's time as the coordinator records it
(prefill + decode, median) side by side, how many events each client got, the events delivered per second
(all clients together, over the run's wall time), and the delay from publication to receipt (p50, p99).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import sys
import time

import aiohttp
import numpy as np

READY_TIMEOUT_S = 120.0
RUN_TIMEOUT_S = 300.0
PROMPT = "Write a short story about a lighthouse keeper."


async def _serve(model: str, stages: int) -> tuple[asyncio.subprocess.Process, str]:
    """A `rlx-cluster serve` process on a free loopback port, once it says it serves."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "coordinator", "serve", "--model", model, "--stages", str(stages),
        "--db", ":memory:", "--http", f"127.0.0.1:{port}",
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    async with asyncio.timeout(READY_TIMEOUT_S):
        while b"serving on" not in (line := await proc.stderr.readline()):
            if not line:
                raise RuntimeError(f"the coordinator exited with status {await proc.wait()}")
    return proc, f"http://127.0.0.1:{port}"


async def _listen(session: aiohttp.ClientSession, base: str, opened: asyncio.Event, got: list) -> None:
    """Read /events until a run finishes, noting each event's delay from publication to receipt."""
    async with session.get(base + "/events") as r:
        opened.set()
        async for raw in r.content:
            if raw.startswith(b"data: "):
                event = json.loads(raw[6:])
                got.append(time.time() - event["time"])
                if event["kind"] == "run_finished":
                    return


async def _run(session: aiohttp.ClientSession, base: str, tokens: int, clients: int) -> dict:
    """One generation with `clients` streams open; its stored times and what the streams got."""
    received: list[list[float]] = [[] for _ in range(clients)]
    opened = [asyncio.Event() for _ in range(clients)]
    pairs = zip(opened, received, strict=True)
    listeners = [asyncio.ensure_future(_listen(session, base, o, got)) for o, got in pairs]
    await asyncio.gather(*(o.wait() for o in opened))
    started = time.monotonic()
    body = {"prompt": PROMPT, "chat": True, "max_new_tokens": tokens}
    async with session.post(base + "/runs", json=body) as r:
        run_id = (await r.json())["id"]
    while True:
        async with session.get(f"{base}/runs/{run_id}") as r:
            run = await r.json()
        if run["status"] not in ("queued", "running"):
            break
        await asyncio.sleep(0.02)
    wall_s = time.monotonic() - started
    await asyncio.gather(*listeners)
    assert run["status"] == "ok", run
    run_ms = run["total_forward_ms"] + (run["decode"]["total_forward_ms"] if run.get("decode") else 0.0)
    return {"run_ms": run_ms, "wall_s": wall_s, "tokens": len(run["tokens"]), "received": received}


async def measure(model: str, stages: int, tokens: int, clients: int, reps: int) -> dict:
    """Alone and watched, alternately, `reps` times each; the figures the module docstring names."""
    proc, base = await _serve(model, stages)
    drain = asyncio.ensure_future(proc.stderr.read())  # a full stderr pipe would block the coordinator
    alone: list[dict] = []
    watched: list[dict] = []
    try:
        timeout = aiohttp.ClientTimeout(total=RUN_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            await _run(session, base, tokens, 0)  # warm up: first forwards pay for caches
            for _ in range(reps):
                alone.append(await _run(session, base, tokens, 0))
                watched.append(await _run(session, base, tokens, clients))
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 30)
        await asyncio.wait_for(drain, 30)
    delays = np.asarray([d for w in watched for got in w["received"] for d in got]) * 1000
    per_client = [len(got) for w in watched for got in w["received"]]
    delivered_per_s = [sum(len(got) for got in w["received"]) / w["wall_s"] for w in watched]
    return {
        "model": model, "stages": stages, "tokens": alone[0]["tokens"], "clients": clients, "reps": reps,
        "run_ms_alone": round(statistics.median(r["run_ms"] for r in alone), 1),
        "run_ms_with_clients": round(statistics.median(r["run_ms"] for r in watched), 1),
        "events_per_client": min(per_client),
        "events_delivered_per_s": round(statistics.median(delivered_per_s), 1),
        "delay_ms_p50": round(float(np.percentile(delays, 50)), 2),
        "delay_ms_p99": round(float(np.percentile(delays, 99)), 2),
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.events", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    print(json.dumps(asyncio.run(measure(a.model, a.stages, a.tokens, a.clients, a.reps))))


if __name__ == "__main__":
    main()
