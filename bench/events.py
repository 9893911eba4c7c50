"""A run's time with no /events client, with CLIENTS reading every event, and with CLIENTS that never read.

`python -m bench.events [--model smollm2] [--stages 3] [--tokens 128] [--runs 1] [--clients 200] [--reps 3]`
starts `rlx-cluster serve` on loopback and times the same greedy generation (a model that takes no prompt:
RUNS runs of seq 4, one after the other) REPS times in each of three settings, taken in turn so a drift of
the machine hits all alike: alone; while CLIENTS streams of /events are open and read; while CLIENTS
streams are open whose clients never read (a small receive buffer, nothing read). It prints JSON: the
run's time as the coordinator records it (prefill + decode, median) and the wall time from the first POST
to the last run's end, per setting and as a ratio to alone; how many events each reading client got; and
the delay from publication to receipt (p50, p99) seen by SAMPLE of the reading clients. The other
readers count events without decoding them, so the client side costs the 2-core machine little beside
the coordinator it measures.
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
from contextlib import ExitStack, closing
from pathlib import Path

import aiohttp
import numpy as np

READY_TIMEOUT_S = 180.0
RUN_TIMEOUT_S = 600.0
PROMPT = "Write a short story about a lighthouse keeper."
SAMPLE = 10  # readers that decode every event, for its delay; the others count them
SMALL_RCVBUF = 4096
SETTINGS = ("alone", "reading", "stalled")


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


async def _listen(session: aiohttp.ClientSession, base: str, opened: asyncio.Event, last: int) -> list[float]:
    """Read /events, decoding every event, until run `last` finishes; each event's delay to receipt."""
    delays, buffer = [], b""
    async with session.get(base + "/events") as r:
        opened.set()
        async for chunk in r.content.iter_any():
            complete, _, buffer = (buffer + chunk).rpartition(b"\n\n")
            now = time.time()
            for frame in complete.split(b"\n\n"):
                if not (data := frame.partition(b"\ndata: ")[2]):
                    continue  # a keep-alive comment
                event = json.loads(data)
                delays.append(now - event["time"])
                if event["kind"] == "run_finished" and event["run"] == last:
                    return delays
    return delays


EVENT, END = b"\nevent: ", b"\nevent: run_finished"  # every frame follows a newline (chunked or not)


class _Counter(asyncio.Protocol):
    """A client of /events that reads every byte and counts the events, decoding none (cheap to run 200)."""

    def __init__(self, host: str, runs: int) -> None:
        self.host, self.runs = host, runs
        self.seen = {EVENT: 0, END: 0}
        # The last bytes of the read before, shorter than a marker: one split between two reads is found once.
        self.carry = {EVENT: b"", END: b""}
        self.done: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(f"GET /events HTTP/1.1\r\nHost: {self.host}\r\n\r\n".encode())

    def data_received(self, data: bytes) -> None:
        for marker in (EVENT, END):
            text = self.carry[marker] + data
            self.seen[marker] += text.count(marker)
            self.carry[marker] = text[-(len(marker) - 1) :]
        if self.seen[END] >= self.runs and not self.done.done():
            self.done.set_result(self.seen[EVENT])

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(self.seen[EVENT])


def _stalled(base: str) -> socket.socket:
    """A client that opens /events and never reads it."""
    host, _, port = base.removeprefix("http://").partition(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_RCVBUF)
    sock.connect((host, int(port)))
    sock.sendall(f"GET /events HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    return sock


def _cpu_s(pid: int) -> float:
    """A process's CPU time so far (user + system), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _runs(session: aiohttp.ClientSession, base: str, body: dict, runs: int) -> list[dict]:
    """`runs` runs of `body`, one after the other; their stored records."""
    done = []
    for _ in range(runs):
        async with session.post(base + "/runs", json=body) as r:
            run_id = (await r.json())["id"]
        while True:
            async with session.get(f"{base}/runs/{run_id}") as r:
                run = await r.json()
            if run["status"] not in ("queued", "running"):
                break
            await asyncio.sleep(0.02)
        assert run["status"] == "ok", run
        done.append(run)
    return done


async def _readers(
    base: str, session: aiohttp.ClientSession, clients: int, runs: int, last: int, stack: ExitStack
):
    """Open `clients` readers of /events (SAMPLE of them decoding); return their results, once they end."""
    host, _, port = base.removeprefix("http://").partition(":")
    loop = asyncio.get_running_loop()
    counters = [_Counter(host, runs) for _ in range(clients - SAMPLE)]
    for counter in counters:
        transport, _ = await loop.create_connection(lambda c=counter: c, host, int(port))
        stack.callback(transport.close)
    opened = [asyncio.Event() for _ in range(min(SAMPLE, clients))]
    sampled = [asyncio.ensure_future(_listen(session, base, o, last)) for o in opened]
    await asyncio.gather(*(o.wait() for o in opened))
    return asyncio.gather(asyncio.gather(*(c.done for c in counters)), asyncio.gather(*sampled))


async def _measure_one(
    session: aiohttp.ClientSession, base: str, pid: int, body: dict, runs: int, setting: str, clients: int,
    next_id: int,
) -> dict:  # fmt: skip
    """One measurement in `setting`: the runs' stored times, what the readers got, the CPU time taken."""
    counts: list[int] = []
    delays: list[float] = []
    with ExitStack() as stack:
        if setting == "stalled":
            for _ in range(clients):
                stack.enter_context(closing(_stalled(base)))
        elif setting == "reading":
            reading = await _readers(base, session, clients, runs, next_id + runs - 1, stack)
        await asyncio.sleep(0.5)  # the streams are open and idle before the runs begin
        started, cpu, own = time.monotonic(), _cpu_s(pid), time.process_time()
        done = await _runs(session, base, body, runs)
        wall_s = time.monotonic() - started
        if setting == "reading":
            counts, sampled = await asyncio.wait_for(reading, RUN_TIMEOUT_S)
            delays = [d for got in sampled for d in got]
            counts = [*counts, *(len(got) for got in sampled)]
        cpu, own = _cpu_s(pid) - cpu, time.process_time() - own
    run_ms = sum(
        r["total_forward_ms"] + (r["decode"]["total_forward_ms"] if r.get("decode") else 0.0) for r in done
    )
    tokens = len(done[0]["tokens"])
    return {"run_ms": run_ms, "wall_s": wall_s, "tokens": tokens, "got": counts, "delays": delays,
            "coordinator_cpu_s": cpu, "client_cpu_s": own}  # fmt: skip


async def measure(model: str, stages: int, tokens: int, runs: int, clients: int, reps: int) -> dict:
    """Each setting `reps` times, in turn; the figures the module docstring names."""
    proc, base = await _serve(model, stages)
    drain = asyncio.ensure_future(proc.stderr.read())  # a full stderr pipe would block the coordinator
    took: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    try:
        timeout = aiohttp.ClientTimeout(total=RUN_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            takes_prompt = not model.startswith(("fake", "synthetic"))
            body = {"prompt": PROMPT, "chat": True, "max_new_tokens": tokens} if takes_prompt else {"seq": 4}
            next_id = 1 + len(await _runs(session, base, body, 1))  # warm up: first forwards pay for caches
            for _ in range(reps):
                for setting in SETTINGS:
                    took[setting].append(
                        await _measure_one(session, base, proc.pid, body, runs, setting, clients, next_id)
                    )
                    next_id += runs
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 60)
        await asyncio.wait_for(drain, 30)
    return _summary(model, stages, runs, clients, reps, took)


def _summary(
    model: str, stages: int, runs: int, clients: int, reps: int, took: dict[str, list[dict]]
) -> dict:
    def median(field: str, setting: str) -> float:
        return statistics.median(m[field] for m in took[setting])

    figures: dict = {"model": model, "stages": stages, "tokens": took["alone"][0]["tokens"], "runs": runs}
    figures |= {"clients": clients, "reps": reps}
    for field, digits in (("run_ms", 1), ("wall_s", 3), ("coordinator_cpu_s", 2), ("client_cpu_s", 2)):
        figures |= {f"{field}_{s}": round(median(field, s), digits) for s in SETTINGS}
    for field in ("run_ms", "wall_s"):
        figures |= {
            f"{field}_ratio_{s}": round(median(field, s) / median(field, "alone"), 3) for s in SETTINGS[1:]
        }
    delays = np.asarray([d for m in took["reading"] for d in m["delays"]] or [0.0]) * 1000
    figures["events_per_reader"] = min((g for m in took["reading"] for g in m["got"]), default=0)
    figures["delay_ms_p50"] = round(float(np.percentile(delays, 50)), 2)
    figures["delay_ms_p99"] = round(float(np.percentile(delays, 99)), 2)
    return figures


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.events", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--clients", type=int, default=200)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    print(json.dumps(asyncio.run(measure(a.model, a.stages, a.tokens, a.runs, a.clients, a.reps))))


if __name__ == "__main__":
    main()
