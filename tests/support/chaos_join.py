"""The chaos soak's join phase: a coordinator whose workers join, killed while squatters hold its join port.

Each round the squatters (as many silent connections as the join port's bounds per peer and overall let
in, twice over, the workers' own address among them, each opened again once closed) hold the port until the
server has pushed some of them out; then one joined worker is SIGKILLed and a new one started. The new
worker must get past the squatters and take exactly the vacancy within REFILL_S, while runs are POSTed
throughout; after the phase every run the API accepted must be in the store with a final status.
"""

from __future__ import annotations

import asyncio
import functools
import random
import re
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import eventually
from tests.support.chaos import UNFINISHED, Http, Log, stored_runs
from tests.support.joiners import Joiners
from tests.support.serving import Serve, serving
from tests.support.squatters import Squatters
from workers.join import MAX_RETRY_S
from workers.protocol.gate import HANDSHAKE_TIMEOUT, MAX_PER_PEER, MAX_UNAUTHENTICATED

JOIN_MODEL = "fake:layers=6,delay_ms=5"
JOIN_STAGES = 3
# Seconds a vacancy may last: a new worker's process start and imports on two busy cores (~5 s), its
# longest pause between tries (MAX_RETRY_S), one squatter's window ahead of it, and its build.
REFILL_S = 5.0 + MAX_RETRY_S + HANDSHAKE_TIMEOUT + 5.0
# The workers' own address first: a bound per peer alone would let no worker in.
SQUAT_SOURCES = ["127.0.0.1"] + [f"127.0.0.{i}" for i in range(2, 2 + MAX_UNAUTHENTICATED // MAX_PER_PEER)]
SQUAT_PER_SOURCE = 2 * MAX_PER_PEER
# Seconds the cluster gets after the phase to be ready and to finish its runs.
JOIN_SETTLE_S = 60


@dataclass
class Vacancy:
    """One stage emptied by a kill while squatters held the join port, and when it was held again.

    refilled: when /nodes first showed the stage up with a worker other than the one killed; None if never.
    squatters_closed: how many squatters' connections the server had closed by then (the port was contested).
    """

    stage: int
    killed_pid: int
    killed: float
    refilled: float | None = None
    refilled_pid: int | None = None
    squatters_closed: int = 0

    @property
    def took(self) -> float | None:
        return None if self.refilled is None else self.refilled - self.killed


@dataclass
class JoinPhase:
    """The join coordinator, its joiners, the phase's log and the vacancies it made."""

    serve: Serve
    join_addr: str
    token: str
    joiners: Joiners
    http: Http
    log: Log
    rng: random.Random
    until: float
    vacancies: list[Vacancy] = field(default_factory=list)

    def going(self) -> bool:
        return time.monotonic() < self.until

    async def join(self) -> None:
        await self.joiners.start(self.join_addr, JOIN_MODEL, self.token)


async def ready(http: Http) -> bool:
    reply = await http.call("GET", "/healthz")
    return reply is not None and reply.status == 200


async def poster(phase: JoinPhase) -> None:
    """POST a run every little while, and look at one now and then, until the phase ends."""
    while phase.going():
        body = {"seq": phase.rng.randint(1, 32), "seed": phase.rng.randrange(99)}
        await phase.http.call("POST", "/runs", body)
        if phase.log.posted and phase.rng.random() < 0.3:
            await phase.http.call("GET", f"/runs/{phase.rng.choice(phase.log.posted)}")
        await asyncio.sleep(phase.rng.uniform(0.1, 0.4))


async def refilled(phase: JoinPhase, vacancy: Vacancy) -> None:
    """Note when the vacant stage is up again with another worker (waiting REFILL_S and as long again)."""

    async def held() -> bool:
        nodes = await phase.http.nodes() or []
        node = nodes[vacancy.stage] if len(nodes) > vacancy.stage else {}
        if node.get("state") == "up" and node.get("pid") not in (None, vacancy.killed_pid):
            vacancy.refilled, vacancy.refilled_pid = time.monotonic(), node["pid"]
        return vacancy.refilled is not None

    with suppress(AssertionError):  # the judge says so, with the figures
        await eventually(held, 2 * REFILL_S, f"stage {vacancy.stage} to be held again")


def contested(squatters: Squatters) -> bool:
    """Whether the server has pushed out (closed) at least one squatter per source: its bounds are met."""
    return squatters.closed >= len(SQUAT_SOURCES)


async def squat_and_kill(phase: JoinPhase) -> None:
    """Round after round: squat the join port, kill one joined worker, start another; note the vacancy."""
    while phase.going():
        await asyncio.sleep(phase.rng.uniform(1, 3))
        try:
            await eventually(lambda: ready(phase.http), JOIN_SETTLE_S, "the join cluster to be ready")
            async with Squatters(phase.join_addr, SQUAT_SOURCES, SQUAT_PER_SOURCE) as squatters:
                await eventually(
                    functools.partial(contested, squatters), 10, "squatters past the bounds to go"
                )
                await kill_one(phase, squatters)
        except AssertionError as exc:
            phase.log.violations.append(f"join phase: {exc}")
            return


async def kill_one(phase: JoinPhase, squatters: Squatters) -> None:
    """SIGKILL the worker of a random up stage, start a new one, and wait for the stage to be held again."""
    held = {n["pid"]: n["stage"] for n in await phase.http.nodes() or [] if n["state"] == "up"}
    ours = [j for j in phase.joiners.started if j.pid in held and j.proc.returncode is None]
    if not ours:
        return
    victim = phase.rng.choice(ours)
    victim.kill()
    vacancy = Vacancy(held[victim.pid], victim.pid, time.monotonic())
    phase.vacancies.append(vacancy)
    phase.log.counts["join kills"] += 1
    await phase.join()
    await refilled(phase, vacancy)
    vacancy.squatters_closed = squatters.closed
    phase.log.counts["squatters closed"] += squatters.closed


def judge_vacancies(vacancies: list[Vacancy], bound: float = REFILL_S) -> list[str]:
    """Every vacancy that was not refilled, or not within `bound` seconds, or not past any squatter."""
    wrong = []
    for v in vacancies:
        what = f"stage {v.stage} vacated by killing pid {v.killed_pid}"
        if v.took is None:
            wrong.append(f"{what} was never held again")
        elif v.took > bound:
            wrong.append(f"{what} was held again after {v.took:.1f} s, past its bound of {bound:g} s")
        if v.squatters_closed < len(SQUAT_SOURCES):
            wrong.append(f"{what}: only {v.squatters_closed} squatters pushed out: the port was not full")
    return wrong


def check_join_store(db: Path, log: Log) -> dict[str, int]:
    """Violations for each accepted run missing from the file or unfinished there; the runs by status."""
    stored, disagree = stored_runs(db)
    log.violations += disagree
    log.violations += [f"join phase: run {i} is {s} in the file"
                       for i, s in stored.items() if s in UNFINISHED]  # fmt: skip
    log.violations += [f"join phase: run {i} was accepted but is not in the file"
                       for i in log.posted if i not in stored]  # fmt: skip
    by_status: dict[str, int] = {}
    for status in stored.values():
        by_status[status] = by_status.get(status, 0) + 1
    return by_status


async def settle_join(phase: JoinPhase) -> None:
    """After the phase: the cluster ready and every posted run finished, as the API says."""

    async def finished() -> bool:
        for run_id in [i for i in phase.log.posted if i not in phase.log.final][:20]:
            await phase.http.call("GET", f"/runs/{run_id}")
        return all(i in phase.log.final for i in phase.log.posted)

    for check, what in ((lambda: ready(phase.http), "the join cluster to be ready"),
                        (finished, "every run posted in the join phase to finish")):  # fmt: skip
        try:
            await eventually(check, JOIN_SETTLE_S, f"{what} after the join phase")
        except AssertionError as exc:
            phase.log.violations.append(str(exc))


def join_summary(phase: JoinPhase, by_status: dict[str, int]) -> dict:
    """The join phase's figures, as the soak prints them."""
    took = sorted(round(v.took, 2) for v in phase.vacancies if v.took is not None)
    return {
        "vacancies": len(phase.vacancies), "refilled": len(took), "refill_bound_s": REFILL_S,
        "refill_s": took, "squatters": len(SQUAT_SOURCES) * SQUAT_PER_SOURCE,
        "squatters_closed": phase.log.counts["squatters closed"], "runs_posted": len(phase.log.posted),
        "runs_by_status": by_status, "violations": len(phase.log.violations),
    }  # fmt: skip


async def join_phase(db: Path, token: str, seed: int, seconds: float) -> tuple[JoinPhase, dict[str, int]]:
    """Serve with --join on `db`, make the phase's chaos for `seconds`, settle; the phase and runs by status.

    `token`: the workers' token, in the environment the coordinator inherits already.
    """
    args = ("--model", JOIN_MODEL, "--stages", str(JOIN_STAGES), "--join", "127.0.0.1:0", "--db", str(db))
    joiners, log = Joiners(), Log()
    try:
        async with serving(*args) as serve:
            await serve.said("serving on", 60)
            [addr] = re.findall(r"waiting for \d+ worker\(s\) to join at (\S+) ", serve.stderr)
            http = Http(serve.port, log)
            phase = JoinPhase(serve, addr, token, joiners, http, log, random.Random(seed), 0.0)
            try:
                for _ in range(JOIN_STAGES):
                    await phase.join()
                await eventually(lambda: ready(http), JOIN_SETTLE_S, "the joiners to make the cluster ready")
                phase.until = time.monotonic() + seconds
                await asyncio.gather(squat_and_kill(phase), poster(phase), poster(phase))
                await settle_join(phase)
            finally:
                await http.close()
    finally:
        await joiners.close()
    return phase, check_join_store(db, log)
