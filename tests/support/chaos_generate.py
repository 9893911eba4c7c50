"""The chaos soak's generation phase: generation runs under worker kills, pauses and coordinator restarts.

A real coordinator serves a tiny llama (real kernels and KV caches, so a stage refilled wrongly changes the
tokens) on 3 launched stages, with a 1 s forward timeout so that a paused worker is lost and replaced. First
each request of REQUESTS is run undisturbed: its tokens are the reference. Then, for the phase's length,
clients POST those requests at random while workers are SIGKILLed, SIGSTOPped for longer than the forward
timeout, the coordinator is SIGKILLed and started again on the same file (it resumes what was accepted),
and once a stage is starved on purpose: killed each time it comes back until it is out of restarts, so the
runs waiting for it fail. Judged: every accepted run is stored and final (0 lost), every one ends ok with
its reference's tokens (0 token differences) but those that failed at the starved stage while it was held
down (counted, not a fault).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from coordinator.stages.node import RESTART_BUDGET
from tests.conftest import eventually, worker_pids
from tests.support.chaos import FINAL, Http, Log, stored_runs
from tests.support.serving import Serve

STAGES = 3
TOKENS = 24
# Greedy and seeded alike: a seeded draw depends on (seed, position) only, so a step taken again, or a run
# resumed by another coordinator, draws what it would have.
REQUESTS = [
    *({"prompt": p, "max_new_tokens": TOKENS} for p in ("abc", "zebra", "quiz", "cab")),
    *(
        {"prompt": p, "max_new_tokens": TOKENS, "temperature": 1.2, "seed": s}
        for p, s in (("abc", 3), ("bad", 7))
    ),
]
FORWARD_TIMEOUT_S = 1.0
# Seconds a paused worker stays stopped: past the forward timeout, so the forward on it is lost.
PAUSE_S = (1.5, 3.0)
START_S = 120  # a coordinator's start: the tiny model's first build compiles its kernels
SETTLE_S = 120


@dataclass
class Generated:
    """What the phase did and saw.

    requests: each accepted run's request (its index in REQUESTS). reference: each request's tokens.
    starved: (stage, from, until) of each stage held down on purpose. runs: each run as finally stored.
    """

    log: Log = field(default_factory=Log)
    requests: dict[int, int] = field(default_factory=dict)
    reference: list[list[int]] = field(default_factory=list)
    starved: list[tuple[int, float, float]] = field(default_factory=list)
    runs: dict[int, dict] = field(default_factory=dict)
    restarts: int = 0


class Phase:
    """The coordinator of the moment, its API, and the faults' shared state."""

    def __init__(self, args: tuple[str, ...], db: Path, seed: int, until: float) -> None:
        self.args, self.db, self.until = args, db, until
        self.rng = random.Random(seed)
        self.seen = Generated()
        self.serve: Serve | None = None
        self.http: Http | None = None
        self.calls = asyncio.Lock()  # held by each request, and by a coordinator's restart throughout
        self.paused: set[int] = set()  # pidfds of workers stopped now

    def going(self) -> bool:
        return time.monotonic() < self.until

    async def nap(self, low: float, high: float) -> bool:
        await asyncio.sleep(max(0.0, min(self.rng.uniform(low, high), self.until - time.monotonic())))
        return self.going()

    async def start(self) -> None:
        """Start a coordinator on the file, and wait until it is ready (the caller holds `calls`)."""
        self.serve = await Serve.start(*self.args)
        await self.serve.said("serving on", START_S)
        http = self.http = Http(self.serve.port, self.seen.log)

        async def healthy() -> bool:
            reply = await http.call("GET", "/healthz")
            return reply is not None and reply.status == 200

        await eventually(healthy, START_S, "the generation phase's coordinator to be ready")

    async def call(self, method: str, path: str, body: object = None):
        async with self.calls:
            assert self.http is not None
            return await self.http.call(method, path, body)

    async def nodes(self) -> list[dict]:
        reply = await self.call("GET", "/nodes")
        return reply.body["nodes"] if reply is not None and reply.status == 200 else []

    def signal(self, pid: int, sig: int) -> int | None:
        """`sig` to our coordinator's worker `pid` through a pidfd (no reused pid is hit); the pidfd."""
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return None
        if self.serve is None or pid not in worker_pids(self.serve.proc.pid):
            os.close(fd)
            return None
        signal.pidfd_send_signal(fd, sig)
        return fd

    async def stop(self) -> None:
        for fd in list(self.paused):
            with suppress(ProcessLookupError):
                signal.pidfd_send_signal(fd, signal.SIGCONT)
        if self.http is not None:
            await self.http.close()
        if self.serve is not None:
            await self.serve.stop()


async def references(phase: Phase) -> None:
    """Each request run alone, undisturbed: the tokens every run of it must end with."""
    for body in REQUESTS:
        reply = await phase.call("POST", "/runs", body)
        assert reply is not None and reply.status == 202, reply and reply.body
        run = await finished(phase, reply.body["id"])
        assert run["status"] == "ok" and not run["recoveries"], run
        phase.seen.reference.append(run["tokens"])


async def finished(phase: Phase, run_id: int) -> dict:
    async def done():
        reply = await phase.call("GET", f"/runs/{run_id}")
        return reply.body if reply is not None and reply.body.get("status") in FINAL else None

    return await eventually(done, SETTLE_S, f"run {run_id} to finish")


async def client(phase: Phase) -> None:
    """POST a random request now and then; note which one each accepted run is."""
    while await phase.nap(0.2, 1.0):
        which = phase.rng.randrange(len(REQUESTS))
        reply = await phase.call("POST", "/runs", REQUESTS[which])
        if reply is not None and reply.status == 202:
            phase.seen.requests[reply.body["id"]] = which


def spare_budget(node: dict) -> bool:
    """Up, and more than one restart short of its budget: a fault here must not exhaust it by chance."""
    return node["state"] == "up" and node["restarts_in_window"] < RESTART_BUDGET - 1


async def killer(phase: Phase) -> None:
    """SIGKILL a random worker every few seconds."""
    while await phase.nap(2, 5):
        ready = [n for n in await phase.nodes() if spare_budget(n)]
        if ready and (fd := phase.signal(phase.rng.choice(ready)["pid"], signal.SIGKILL)) is not None:
            os.close(fd)
            phase.seen.log.counts["kills"] += 1


async def pauser(phase: Phase) -> None:
    """SIGSTOP a random worker past the forward timeout every few seconds, then SIGCONT it."""
    while await phase.nap(3, 7):
        ready = [n for n in await phase.nodes() if spare_budget(n)]
        if not ready or (fd := phase.signal(phase.rng.choice(ready)["pid"], signal.SIGSTOP)) is None:
            continue
        phase.paused.add(fd)
        phase.seen.log.counts["pauses"] += 1
        try:
            await asyncio.sleep(phase.rng.uniform(*PAUSE_S))
        finally:
            phase.paused.discard(fd)
            with suppress(ProcessLookupError):
                signal.pidfd_send_signal(fd, signal.SIGCONT)
            os.close(fd)


async def restarter(phase: Phase) -> None:
    """SIGKILL the coordinator twice in the phase, each time starting another on the same file."""
    for share in (0.3, 0.65):
        left = phase.until - time.monotonic()
        await asyncio.sleep(max(0.0, share * left))
        if not phase.going():
            return
        async with phase.calls:  # no request in flight: none goes unanswered for the kill
            assert phase.serve is not None and phase.http is not None
            for fd in list(phase.paused):  # a stopped worker would outlive its coordinator
                with suppress(ProcessLookupError):
                    signal.pidfd_send_signal(fd, signal.SIGCONT)
            phase.serve.proc.send_signal(signal.SIGKILL)
            await phase.serve.exit_code()
            await phase.http.close()
            await phase.serve.stop()
            await phase.start()
        phase.seen.restarts += 1


async def starver(phase: Phase) -> None:
    """Once, kill a stage each time it comes back until it is failed; hold it so a while; restart it."""
    await asyncio.sleep(0.45 * (phase.until - time.monotonic()))
    stage, began = phase.rng.randrange(STAGES), time.monotonic()

    async def failed() -> bool:
        nodes = await phase.nodes()
        node = nodes[stage] if nodes else {}
        if node.get("state") == "up" and (fd := phase.signal(node["pid"], signal.SIGKILL)) is not None:
            os.close(fd)
        return node.get("state") == "failed"

    try:
        await eventually(failed, 60, f"stage {stage} to be failed")
    except AssertionError as exc:
        phase.seen.log.violations.append(str(exc))
        return
    await asyncio.sleep(2.0)  # runs waiting for it, and runs POSTed meanwhile, see it failed
    reply = await phase.call("POST", f"/nodes/{stage}/restart")
    phase.seen.starved.append((stage, began, time.monotonic()))
    if reply is None or reply.status != 200:
        phase.seen.log.violations.append(f"restarting the starved stage {stage}: {reply and reply.body}")


async def settle(phase: Phase) -> None:
    """Every accepted run final, each as the last coordinator stored it."""
    for run_id in phase.seen.requests:
        phase.seen.runs[run_id] = await finished(phase, run_id)


def starved_run(seen: Generated, run: dict) -> bool:
    """Whether a failed run failed at a stage held down on purpose, for being out of restarts."""
    error = run.get("error") or ""
    return "out of automatic restarts" in error and any(f"stage {s} (" in error for s, _, _ in seen.starved)


def judge_generated(seen: Generated, db: Path) -> list[str]:
    """Lost runs, runs failed other than at the starved stage, and token differences from the reference."""
    stored, violations = stored_runs(db)
    for run_id, which in seen.requests.items():
        run = seen.runs.get(run_id, {})
        if run_id not in stored:
            violations.append(f"run {run_id} was accepted but is not in the file")
        elif stored[run_id] not in ("ok", "failed"):
            violations.append(f"run {run_id} is {stored[run_id]} in the file")
        if run.get("status") == "failed" and starved_run(seen, run):
            seen.log.counts["starved runs failed"] += 1
        elif run.get("status") != "ok":
            violations.append(f"run {run_id} ({REQUESTS[which]}) is {run.get('status')}: {run.get('error')}")
        elif run["tokens"] != seen.reference[which]:
            got, want = run["tokens"], seen.reference[which]
            first = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), len(want))
            violations.append(f"run {run_id} ({REQUESTS[which]}) differs from its reference at token {first}")
    return violations


async def generation_phase(model: Path, db: Path, seed: int, seconds: float) -> Generated:
    """The whole phase: references, the faults for `seconds`, the settling, the judging."""
    args = ("--model", str(model), "--stages", str(STAGES), "--plan", "even", "--db", str(db),
            "--forward-timeout", str(FORWARD_TIMEOUT_S))  # fmt: skip
    phase = Phase(args, db, seed, time.monotonic() + START_S + seconds)
    try:
        async with phase.calls:
            await phase.start()
        await references(phase)
        phase.until = time.monotonic() + seconds
        await asyncio.gather(
            client(phase), client(phase), killer(phase), pauser(phase), restarter(phase), starver(phase)
        )
        await settle(phase)
    finally:
        await phase.stop()
    phase.seen.log.violations += judge_generated(phase.seen, db)
    return phase.seen


def generated_summary(seen: Generated) -> dict:
    """The phase's figures, as the soak prints them."""
    by_status: dict[str, int] = {}
    for run in seen.runs.values():
        by_status[run.get("status", "?")] = by_status.get(run.get("status", "?"), 0) + 1
    recovered = sum(1 for run in seen.runs.values() if run.get("recoveries"))
    resumed = sum(1 for run in seen.runs.values() if run.get("resumed"))
    return {
        "runs_accepted": len(seen.requests), "runs_by_status": by_status, "runs_recovered": recovered,
        "runs_resumed": resumed, "coordinator_restarts": seen.restarts, "starved_stages": len(seen.starved),
        **{k.replace(" ", "_"): v for k, v in sorted(seen.log.counts.items())},
        "violations": len(seen.log.violations),
    }  # fmt: skip
