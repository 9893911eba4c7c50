"""The chaos soak's eyes: every HTTP answer recorded, /healthz samples judged against what was true.

All times are time.monotonic(), so answers, lock holds and samples line up.
"""

from __future__ import annotations

import asyncio
import re
import sqlite3
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from coordinator.store.history import RETRY_BUSY_S, RETRY_EVERY_S

FINAL = ("ok", "failed", "interrupted")
UNFINISHED = ("queued", "running")
REQUEST_TIMEOUT_S = 20
# Seconds a store problem may outlast the outside lock that caused it: the next retry, its wait, and slack.
STORE_RECOVERY_S = RETRY_EVERY_S + RETRY_BUSY_S + 2.0
# Documented 503 refusals by what their error says (checked in this order).
CAUSES = (
    ("too many connections", "connections"),
    ("run store", "store failing"),
    ("queue limit", "queue full"),
    ("stage", "stage not up"),
)
STAGE_NAMED = re.compile(r"stage (\d+) \(")


@dataclass
class Reply:
    """One HTTP answer, and when its request was sent and answered."""

    method: str
    path: str
    status: int
    body: Any
    headers: dict[str, str]
    started: float
    ended: float

    @property
    def error(self) -> str:
        return str(self.body.get("error", "")) if isinstance(self.body, dict) else ""

    @property
    def store_refusal(self) -> bool:
        """Whether this is a POST /runs refused because the run store is failing."""
        return self.status == 503 and "run store" in self.error


@dataclass
class Sample:
    """One /healthz answer between two looks at /nodes (each stage's state), and the store probe's verdict.

    store_probe: why reading the store failed when /healthz said 200, else None.
    """

    before: list[str]
    health: Reply
    after: list[str]
    store_probe: str | None = None


@dataclass
class Log:
    """What the soak saw: answers by status, refusals by cause, faults made, runs, and what went wrong.

    final: each run's final status as the API reported it.
    posts: every answered POST /runs, for bracketing /healthz samples.
    locks: (acquired, released) of each outside hold of the store's write lock.
    slowest: the longest wait for an answer, in seconds, by method and path (ids left out).
    """

    t0: float = field(default_factory=time.monotonic)
    statuses: Counter = field(default_factory=Counter)
    refusals: Counter = field(default_factory=Counter)
    counts: Counter = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    posted: list[int] = field(default_factory=list)
    final: dict[int, str] = field(default_factory=dict)
    posts: list[Reply] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    locks: list[tuple[float, float]] = field(default_factory=list)
    slowest: dict[str, float] = field(default_factory=dict)

    def at(self, when: float) -> str:
        return f"at {when - self.t0:.1f} s"

    def record(self, reply: Reply) -> None:
        """Count an answer, judge a 5xx, and note what it says of runs."""
        self.statuses[reply.status] += 1
        what = f"{reply.method} {reply.path.split('?')[0].rstrip('0123456789')}"
        self.slowest[what] = max(self.slowest.get(what, 0.0), round(reply.ended - reply.started, 2))
        if reply.status >= 500:
            self._server_error(reply)
        if reply.method == "POST" and reply.path == "/runs":
            self.posts.append(reply)
            if reply.status == 202:
                self.posted.append(reply.body["id"])
        elif reply.method == "GET" and reply.path.startswith(("/runs", "/run/")) and reply.status == 200:
            self.observe(reply.body)

    def _server_error(self, reply: Reply) -> None:
        """A 503 with Retry-After naming a documented cause, or /healthz's, is a refusal; others break it."""
        if reply.status == 503 and reply.path == "/healthz":
            self.refusals["healthz not ready"] += 1
            return
        cause = next((name for text, name in CAUSES if text in reply.error), None)
        if reply.status == 503 and "Retry-After" in reply.headers and cause is not None:
            self.refusals[cause] += 1
            return
        where = f"{reply.method} {reply.path} {self.at(reply.started)}"
        self.violations.append(f"{reply.status} from {where}: {str(reply.body)[:300]}")

    def observe(self, body: Any) -> None:
        """Note the final status of every run in a run view or a page of them."""
        runs = body.get("runs", [body]) if isinstance(body, dict) else []
        for run in runs:
            if isinstance(run, dict) and run.get("status") in FINAL and isinstance(run.get("id"), int):
                first = self.final.setdefault(run["id"], run["status"])
                if first != run["status"]:
                    self.violations.append(f"run {run['id']} was reported {first}, later {run['status']}")


class Http:
    """Requests to the coordinator's API, each answer recorded in the log; None when none came."""

    def __init__(self, port: int, log: Log) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.log = log
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S))

    async def close(self) -> None:
        await self.session.close()

    async def call(self, method: str, path: str, body: object = None) -> Reply | None:
        started = time.monotonic()
        try:
            async with self.session.request(method, self.base + path, json=body) as r:
                data = await r.json() if r.content_type == "application/json" else await r.text()
                reply = Reply(method, path, r.status, data, dict(r.headers), started, time.monotonic())
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            self.log.errors.append(f"{method} {path} {self.log.at(started)}: {type(exc).__name__}: {exc}")
            return None
        self.log.record(reply)
        return reply

    async def nodes(self) -> list[dict] | None:
        reply = await self.call("GET", "/nodes")
        return reply.body["nodes"] if reply is not None and reply.status == 200 else None


async def api_runs(http: Http) -> dict[int, str]:
    """Every run's status as the API lists it, page by page."""
    runs: dict[int, str] = {}
    path = "/runs?limit=1000"
    while path:
        reply = await http.call("GET", path)
        assert reply is not None and reply.status == 200, f"GET {path}: {reply and reply.body}"
        runs.update((r["id"], r["status"]) for r in reply.body["runs"])
        after = reply.body["next_before"]
        path = f"/runs?limit=1000&before={after}" if after else ""
    return runs


def read_count(db: Path) -> int:
    """How many runs the file holds, read by a connection of our own (WAL readers wait for no writer)."""
    conn = sqlite3.connect(db, timeout=1.0)
    try:
        return conn.execute("SELECT count(*) FROM runs").fetchone()[0]
    finally:
        conn.close()


async def store_probe(http: Http, db: Path) -> str | None:
    """Why the store cannot be read, through the API and from the file, or None when both work."""
    reply = await http.call("GET", "/runs?limit=1")
    if reply is None or reply.status != 200:
        return f"GET /runs?limit=1 answered {reply and reply.status}"
    try:
        await asyncio.to_thread(read_count, db)
    except sqlite3.Error as exc:
        return f"reading {db.name} failed: {exc}"
    return None


def stored_runs(db: Path) -> tuple[dict[int, str], list[str]]:
    """Every run's status as the file holds it, and where its status column and its record disagree."""
    conn = sqlite3.connect(db)
    try:
        rows = conn.execute("SELECT id, status, run FROM runs").fetchall()
    finally:
        conn.close()
    disagree = [f"run {i} is {s} in its column, {r} in its record"
                for i, s, meta in rows if (r := msgspec.json.decode(meta)["status"]) != s]  # fmt: skip
    return {i: s for i, s, _ in rows}, disagree


def judge(log: Log) -> list[str]:
    """Every /healthz sample that told something other than the truth, and why."""
    known = store_known_failing(log)
    lies: list[str] = []
    for sample in log.samples:
        h = sample.health
        if h.status == 200:
            found = _healthy_lies(sample, known, log)
        elif h.status == 503:
            found = _unhealthy_lies(sample, log)
        else:
            found = [f"answered {h.status}"]
        lies += [f"/healthz {log.at(h.started)}: {lie}" for lie in found]
    return lies


def store_known_failing(log: Log) -> list[tuple[float, float]]:
    """When the coordinator surely knew its store was failing: from its first refusal of a POST for the
    store during an outside hold of the write lock until the lock was released (no retry succeeds before)."""
    known = []
    for held, released in log.locks:
        told = [p.ended for p in log.posts if p.store_refusal and held <= p.ended <= released]
        if told:
            known.append((min(told), released))
    return known


def _healthy_lies(sample: Sample, known: list[tuple[float, float]], log: Log) -> list[str]:
    """A 200 lies when a stage was not up both just before and just after it, or the store was failing."""
    h, lies = sample.health, []
    body = h.body if isinstance(h.body, dict) else {}
    if not (body.get("ok") is True and body.get("nodes_up") == body.get("nodes") == len(sample.after)
            and body.get("store") == "ok"):  # fmt: skip
        lies.append(f"200 with a body that says otherwise: {body}")
    down = [f"stage {i} {a}/{b}" for i, (a, b) in enumerate(zip(sample.before, sample.after, strict=True))
            if a != "up" and b != "up"]  # fmt: skip
    if down:
        lies.append(f"200 while /nodes showed {', '.join(down)} before and after it")
    if sample.store_probe is not None:
        lies.append(f"200 while the store probe failed: {sample.store_probe}")
    for told, released in known:
        if told <= h.started and h.ended <= released:
            when = f"a POST refused for it {log.at(told)}, the lock held until {log.at(released)}"
            lies.append(f"200 while the store was failing: {when}")
    return lies


def _unhealthy_lies(sample: Sample, log: Log) -> list[str]:
    """A 503 lies when a reason names no real problem: a stage up before and after, a store nobody locked."""
    h, lies = sample.health, []
    reasons = h.body.get("reasons", []) if isinstance(h.body, dict) else []
    if not reasons:
        lies.append(f"503 naming no reason: {h.body}")
    for reason in reasons:
        part, _, why = reason.partition(": ")
        if part == "stages":
            named = [int(i) for i in STAGE_NAMED.findall(why)]
            up = [i for i in named if i >= len(sample.before) or sample.before[i] == sample.after[i] == "up"]
            if not named or up:
                lies.append(f"503 for stages up before and after it ({up or 'none named'}): {why}")
        elif part == "store":
            since = h.started - STORE_RECOVERY_S
            if not any(held <= h.ended and released >= since for held, released in log.locks):
                lies.append(f"503 for a store nobody had locked: {why}")
        elif part == "run loop":
            lies.append(f"the run loop stopped: {why}")
        else:
            lies.append(f"503 for an unknown reason: {reason}")
    return lies
