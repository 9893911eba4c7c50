"""The chaos soak (`make soak`): a real coordinator under worker kills and pauses, store lock contention and
HTTP abuse for a few minutes (RLX_CHAOS_S seconds, default 180), then checked end to end.

"Zero 5xx" is read strictly: no server error at all except the documented refusals, which
are 503s with Retry-After naming their cause (a run POSTed while a stage is not up, the store is failing or
the queue is full; a connection over the cap), and /healthz's own 503 (not ready, with its reasons). Those
are counted by cause and reported; any other 5xx, or a refusal without Retry-After, fails the soak.

/healthz is truthful when each sample, taken between two looks at /nodes, says 200 only while every stage
was up in at least one of those looks and the store could be read (through the API and from the file), and
never once the coordinator has refused a POST for its store during a hold of the write lock that still
goes on; and says 503 only naming stages not up in one of those looks, or the store while the soak held
its lock or had just let it go (within the store's retry time). The coordinator learns of an outside lock
only when a write waits out its busy timeout, so the soak POSTs during each hold until one is refused.

Two more phases follow, each on a coordinator of its own (tests/support/chaos_join.py, chaos_stop.py): one
whose workers join it, killed one at a time while squatters fill its join port, each vacancy to be held
again within a bound; and one SIGTERMed with runs queued and running, streamed /v1 chats and /events streams
that never read, to exit within its bound with no worker left and every accepted run stored final, listed
again by a coordinator started on the same file.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import random
import re
import signal
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import pytest

from coordinator.stages.node import RESTART_BUDGET
from coordinator.store.history import BUSY_TIMEOUT_S
from tests.conftest import eventually, worker_pids
from tests.support.chaos import (
    UNFINISHED,
    Http,
    Log,
    Reply,
    Sample,
    api_runs,
    judge,
    store_probe,
    stored_runs,
)
from tests.support.chaos_abuse import abuse
from tests.support.chaos_generate import SETTLE_S as GENERATE_SETTLE_S
from tests.support.chaos_generate import START_S as GENERATE_START_S
from tests.support.chaos_generate import Generated, generated_summary, generation_phase, judge_generated
from tests.support.chaos_join import (
    REFILL_S,
    SQUAT_SOURCES,
    Vacancy,
    join_phase,
    join_summary,
    judge_vacancies,
)
from tests.support.chaos_stop import EXIT_BOUND_S, Stop, judge_stop, sigterm_under_load, stop_summary
from tests.support.serving import Serve, serving
from tests.support.tiny_chat import write_tiny_chatml
from workers.protocol import auth

DURATION_ENV = "RLX_CHAOS_S"
# Seeds the choices of faults and requests (a random seed when unset; the summary gives it).
SEED_ENV = "RLX_CHAOS_SEED"
DEFAULT_DURATION_S = 180
MODEL = "fake:layers=6,delay_ms=5"
STAGES = 3
CLIENTS = 3
SAMPLE_EVERY_S = 0.5
# Seconds the cluster gets, after the chaos, to be healthy again and to finish every run.
SETTLE_S = 90
# The join phase's length, as a share of the chaos's (at least JOIN_MIN_S), and its workers' token.
JOIN_SHARE, JOIN_MIN_S = 0.5, 20.0
JOIN_TOKEN = "chaos-join-token"
# The generation phase's length, as a share of the chaos's (at least GENERATE_MIN_S).
GENERATE_SHARE, GENERATE_MIN_S = 0.5, 30.0
# Seconds for the SIGTERM phase: its tiny model's first build compiles kernels, two coordinators start.
STOP_PHASE_S = 240


def duration() -> float:
    """The chaos's length in seconds, from RLX_CHAOS_S (default 180)."""
    raw = os.environ.get(DURATION_ENV, str(DEFAULT_DURATION_S))
    try:
        seconds = float(raw)
    except ValueError:
        seconds = 0.0
    if not 5 <= seconds <= 3600:
        raise ValueError(f"{DURATION_ENV} must be seconds in 5..3600, got {raw!r}")
    return seconds


@dataclass
class Chaos:
    """One soak: the coordinator, the API, the log, the store's file, and until when faults are made."""

    serve: Serve
    http: Http
    log: Log
    db: Path
    until: float
    seed: int

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def going(self) -> bool:
        return time.monotonic() < self.until

    async def nap(self, low: float, high: float) -> bool:
        """Wait a random while (never past the end); whether the chaos still goes on."""
        await asyncio.sleep(max(0.0, min(self.rng.uniform(low, high), self.until - time.monotonic())))
        return self.going()

    def signal(self, pid: int, sig: int) -> int | None:
        """Send `sig` to our coordinator's worker `pid` through a pidfd (no reused pid is hit); the pidfd."""
        try:
            fd = os.pidfd_open(pid)
        except OSError:  # gone already
            return None
        # Checked after the fd pins the process: it is still our coordinator's live worker.
        if pid not in worker_pids(self.serve.proc.pid):
            os.close(fd)
            return None
        signal.pidfd_send_signal(fd, sig)
        return fd


async def clients(chaos: Chaos) -> None:
    """A user's loop: start a run, look at the history, the latest run, the nodes and some run."""
    http, rng = chaos.http, chaos.rng
    while await chaos.nap(0.05, 0.3):
        await http.call("POST", "/runs", {"seq": rng.randint(1, 64), "seed": rng.randrange(1000)})
        await http.call("GET", "/runs?limit=20")
        await http.call("GET", rng.choice(("/run/latest", "/run/latest/table", "/run/latest?output=1")))
        await http.call("GET", "/nodes")
        if chaos.log.posted:
            await http.call("GET", f"/runs/{rng.choice(chaos.log.posted)}")


async def sampler(chaos: Chaos) -> None:
    """Ask /healthz every SAMPLE_EVERY_S between two looks at /nodes; probe the store when it says 200."""
    while chaos.going():
        due = time.monotonic() + SAMPLE_EVERY_S
        before = await chaos.http.nodes()
        health = await chaos.http.call("GET", "/healthz")
        after = await chaos.http.nodes()
        if before is not None and health is not None and after is not None:
            sample = Sample([n["state"] for n in before], health, [n["state"] for n in after])
            if health.status == 200:
                sample.store_probe = await store_probe(chaos.http, chaos.db)
            chaos.log.samples.append(sample)
        await asyncio.sleep(max(0.0, due - time.monotonic()))


async def recover(chaos: Chaos, stage: int) -> None:
    """Bring a failed stage back as a user would: POST /nodes/{stage}/restart."""
    reply = await chaos.http.call("POST", f"/nodes/{stage}/restart")
    chaos.log.counts["manual restarts"] += 1
    if reply is None or reply.status != 200 or reply.body.get("state") != "up":
        chaos.log.violations.append(f"restarting failed stage {stage} by hand: {reply and reply.body}")


async def killer(chaos: Chaos) -> None:
    """SIGKILL a random up worker every few seconds, within each stage's restart budget; once, exhaust one."""
    log = chaos.log
    exhaust_at = time.monotonic() + 0.4 * (chaos.until - time.monotonic())
    while await chaos.nap(2, 5):
        nodes = await chaos.http.nodes() or []
        for node in nodes:
            if node["state"] == "failed":
                await recover(chaos, node["stage"])
        if not log.counts["stages exhausted"] and time.monotonic() >= exhaust_at:
            await exhaust(chaos, chaos.rng.randrange(STAGES))
            continue
        # One kill short of the budget: the last restart in the window is the exhausting run's to spend.
        ready = [n for n in nodes if n["state"] == "up" and n["restarts_in_window"] < RESTART_BUDGET - 1]
        if ready and (fd := chaos.signal(chaos.rng.choice(ready)["pid"], signal.SIGKILL)) is not None:
            os.close(fd)
            log.counts["kills"] += 1


async def exhaust(chaos: Chaos, stage: int) -> None:
    """Kill one stage each time it comes back until it is failed; check it says so; restart it by hand."""
    log = chaos.log

    async def failed() -> bool:
        node = (await chaos.http.nodes() or [{}] * STAGES)[stage]
        if node.get("state") == "up" and (fd := chaos.signal(node["pid"], signal.SIGKILL)) is not None:
            os.close(fd)
            log.counts["kills"] += 1
        return node.get("state") == "failed"

    try:
        await eventually(failed, 60, f"stage {stage} to be failed after a kill each time it came back")
    except AssertionError as exc:
        log.violations.append(str(exc))
        return
    log.counts["stages exhausted"] += 1
    post = await chaos.http.call("POST", "/runs", {"seq": 4})
    if post is None or post.status != 503 or f"/nodes/{stage}/restart" not in post.error:
        log.violations.append(f"a POST while stage {stage} is failed: {post and (post.status, post.body)}")
    await recover(chaos, stage)


async def pauser(chaos: Chaos) -> None:
    """SIGSTOP a random up worker for 1-3 s every few seconds, then SIGCONT it."""
    while await chaos.nap(3, 8):
        up = [n for n in await chaos.http.nodes() or [] if n["state"] == "up"]
        if not up or (fd := chaos.signal(chaos.rng.choice(up)["pid"], signal.SIGSTOP)) is None:
            continue
        chaos.log.counts["pauses"] += 1
        try:
            await asyncio.sleep(chaos.rng.uniform(1, 3))
        finally:
            with suppress(ProcessLookupError):
                signal.pidfd_send_signal(fd, signal.SIGCONT)
            os.close(fd)


def hold_write_lock(db: Path, seconds: float, release: threading.Event, held: Callable[[], None]) -> tuple:
    """Hold the store's write lock (BEGIN IMMEDIATE) on a connection of our own; (taken, last held) or ()."""
    conn = sqlite3.connect(db, timeout=BUSY_TIMEOUT_S, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        taken = time.monotonic()
        held()
        release.wait(seconds)
        last = time.monotonic()  # before the rollback: surely held until then
        conn.execute("ROLLBACK")
        return taken, last
    except sqlite3.OperationalError:
        return ()
    finally:
        conn.close()


async def locker(chaos: Chaos) -> None:
    """Now and then hold the store's write lock for longer than its busy timeout, and POST until refused."""
    loop = asyncio.get_running_loop()
    while await chaos.nap(6, 14):
        release, held = threading.Event(), asyncio.Event()
        seconds = BUSY_TIMEOUT_S + chaos.rng.uniform(3, 6)
        tell = functools.partial(loop.call_soon_threadsafe, held.set)
        holding = asyncio.ensure_future(asyncio.to_thread(hold_write_lock, chaos.db, seconds, release, tell))
        try:
            await make_known(chaos, holding, held)
            lock = await asyncio.wait_for(asyncio.shield(holding), seconds + 2 * BUSY_TIMEOUT_S)
        finally:
            release.set()
        if lock:
            chaos.log.locks.append(lock)
        chaos.log.counts["lock holds" if lock else "lock holds missed"] += 1


async def make_known(chaos: Chaos, holding: asyncio.Future, held: asyncio.Event) -> None:
    """POST runs while the lock is held until one is refused for the store: from then on the coordinator
    knows its store is failing, and must say so until the lock goes."""
    while not holding.done():
        if held.is_set():
            reply = await chaos.http.call("POST", "/runs", {"seq": 4})
            if reply is not None and reply.store_refusal:
                chaos.log.counts["store failures made known"] += 1
                return
        await asyncio.wait([holding], timeout=0.5 if held.is_set() else 0.05)


async def settle(chaos: Chaos) -> None:
    """After the chaos: the cluster healthy again (failed stages restarted by hand) and every run finished."""
    http, log = chaos.http, chaos.log

    async def healthy() -> bool:
        for node in await http.nodes() or []:
            if node["state"] == "failed":
                await recover(chaos, node["stage"])
        reply = await http.call("GET", "/healthz")
        return reply is not None and reply.status == 200

    async def finished() -> bool:
        for run_id in [i for i in log.posted if i not in log.final][:20]:
            await http.call("GET", f"/runs/{run_id}")
        done = all(i in log.final for i in log.posted)
        if not done:
            await asyncio.sleep(0.5)  # the runs left take time: look again later, not at once
        return done

    for check, what in ((healthy, "/healthz to say 200"), (finished, "every posted run to finish")):
        try:
            await eventually(check, SETTLE_S, f"{what} after the chaos")
        except AssertionError as exc:
            log.violations.append(str(exc))


async def make_chaos(chaos: Chaos) -> None:
    """Run every actor until the chaos's end; each ends by itself then."""
    actors = [*(clients(chaos) for _ in range(CLIENTS)), sampler(chaos), killer(chaos), pauser(chaos),
              locker(chaos), abuse(chaos.serve.port, chaos.log, chaos.rng, chaos.nap)]  # fmt: skip
    await asyncio.gather(*actors)


async def shut_down(serve: Serve, log: Log) -> int:
    """SIGTERM the coordinator; its exit status, with a traceback or a surviving worker as violations."""
    serve.proc.send_signal(signal.SIGTERM)
    code = await serve.exit_code()
    if "Traceback" in serve.stderr:
        log.violations.append(f"a traceback on the coordinator's stderr:\n{serve.stderr[-4000:]}")
    try:
        await eventually(lambda: worker_pids(serve.proc.pid) == [], 10, "the workers to exit")
    except AssertionError as exc:
        log.violations.append(str(exc))
    return code


def check_store(db: Path, log: Log, listed: dict[int, str]) -> Counter:
    """Compare the file with what the API said; the runs by status as stored."""
    stored, disagree = stored_runs(db)
    log.violations += disagree
    log.violations += [f"run {i} is {s} in the file" for i, s in stored.items() if s in UNFINISHED]
    log.violations += [f"run {i} is {s} in the API's list" for i, s in listed.items() if s in UNFINISHED]
    for run_id, status in log.final.items():
        if stored.get(run_id) != status:
            log.violations.append(f"run {run_id} was reported {status}, the file has {stored.get(run_id)}")
    log.violations += [f"run {i} was accepted but is not in the file" for i in log.posted if i not in stored]
    return Counter(stored.values())


def summary(chaos: Chaos, seconds: float, wall_s: float, code: int, by_status: Counter) -> dict:
    """What the soak did and saw, as printed at its end."""
    log = chaos.log
    other_5xx = sum(n for status, n in log.statuses.items() if status >= 500) - sum(log.refusals.values())
    return {
        "seed": chaos.seed, "chaos_s": seconds, "wall_s": round(wall_s, 1), "exit_status": code,
        "runs_by_status": dict(by_status), "runs_posted": len(log.posted),
        "requests": sum(log.statuses.values()), "statuses": dict(sorted(log.statuses.items())),
        "refusals_503": dict(log.refusals), "other_5xx": other_5xx,
        "no_answer": len(log.errors), "healthz_samples": dict(Counter(s.health.status for s in log.samples)),
        "store_lock_s": round(sum(b - a for a, b in log.locks), 1), "slowest_s": log.slowest,
        **{k.replace(" ", "_").replace(":", ""): v for k, v in sorted(log.counts.items())},
        "violations": len(log.violations),
    }  # fmt: skip


def by_kind(violations: list[str]) -> str:
    """Violations grouped by their text with the numbers left out: how many of each, and the first."""
    kinds: dict[str, list[str]] = {}
    for v in violations:
        kinds.setdefault(re.sub(r"\d+(\.\d+)?", "#", v)[:80], []).append(v)
    return "\n".join(f"{len(vs)} × {vs[0][:1500]}" for vs in kinds.values())


def seed() -> int:
    """The seed of the soak's choices: RLX_CHAOS_SEED, else a fresh one."""
    raw = os.environ.get(SEED_ENV, "")
    if not raw:
        return random.randrange(2**32)
    if not (raw.isascii() and raw.isdigit()):
        raise ValueError(f"{SEED_ENV} must be a whole number >= 0, got {raw!r}")
    return int(raw)


@pytest.mark.soak
@pytest.mark.timeout(duration() * (1 + JOIN_SHARE) + JOIN_MIN_S + SETTLE_S * 4 + 240 + STOP_PHASE_S)
async def test_under_kills_pauses_store_locks_and_abuse_no_run_is_lost_or_stuck_and_nothing_lies(
    tmp_path, monkeypatch
):
    seconds, started, log = duration(), time.monotonic(), Log()
    db = tmp_path / "runs.sqlite3"
    async with serving("--model", MODEL, "--stages", str(STAGES), "--db", str(db)) as serve:
        await serve.said("serving on", 60)
        http = Http(serve.port, log)
        try:
            chaos = Chaos(serve, http, log, db, time.monotonic() + seconds, seed())
            await make_chaos(chaos)
            await settle(chaos)
            listed = await api_runs(http)
        finally:
            await http.close()
        code = await shut_down(serve, log)
    by_status = check_store(db, log, listed)
    log.violations += judge(log)

    monkeypatch.setenv(auth.WORKER_TOKEN_ENV, JOIN_TOKEN)
    join_s = max(JOIN_MIN_S, JOIN_SHARE * seconds)
    joined, joined_by_status = await join_phase(tmp_path / "joined.sqlite3", JOIN_TOKEN, chaos.seed, join_s)
    log.violations += joined.log.violations + judge_vacancies(joined.vacancies)
    log.errors += joined.log.errors
    write_tiny_chatml(model := tmp_path / "tiny-chatml.gguf", context_length=1024)
    stop_log = Log()
    stop = await sigterm_under_load(model, tmp_path / "stopped.sqlite3", stop_log)
    log.violations += stop_log.violations + judge_stop(stop)
    log.errors += stop_log.errors

    figures = summary(chaos, seconds, time.monotonic() - started, code, by_status)
    figures["join_phase"] = join_summary(joined, joined_by_status)
    figures["sigterm_under_load"] = stop_summary(stop)
    figures["violations"] = len(log.violations)
    print(json.dumps(figures, indent=1))
    assert code == 128 + signal.SIGTERM, f"exit status {code} on SIGTERM; stderr:\n{serve.stderr[-4000:]}"
    assert not log.errors, f"{len(log.errors)} requests got no answer: {log.errors[:10]}"
    assert not log.violations, f"{len(log.violations)} violations, by kind:\n{by_kind(log.violations)}"
    assert log.samples and log.counts["kills"] and log.counts["abuse requests"], "the chaos did not happen"
    assert joined.vacancies and joined.log.posted, "the join phase made no vacancy or no run"


@pytest.mark.soak
@pytest.mark.timeout(
    max(GENERATE_MIN_S, GENERATE_SHARE * duration()) + 4 * GENERATE_START_S + GENERATE_SETTLE_S
)
async def test_generation_runs_under_kills_pauses_and_coordinator_restarts_end_with_their_undisturbed_tokens(
    tmp_path,
):
    write_tiny_chatml(model := tmp_path / "tiny-chatml.gguf", context_length=1024)
    seconds = max(GENERATE_MIN_S, GENERATE_SHARE * duration())
    seen = await generation_phase(model, tmp_path / "generated.sqlite3", seed(), seconds)
    print(json.dumps(generated_summary(seen), indent=1))
    assert not seen.log.errors, f"{len(seen.log.errors)} requests got no answer: {seen.log.errors[:10]}"
    assert not seen.log.violations, f"{len(seen.log.violations)} violations:\n{by_kind(seen.log.violations)}"
    assert seen.log.counts["kills"] and seen.log.counts["pauses"] and seen.starved, "the chaos did not happen"
    assert seen.restarts == 2 and any(r.get("resumed") for r in seen.runs.values()), "no run was resumed"


# The soak's judge, on made-up evidence: it must be able to find each lie the soak looks for.

UP = ["up"] * STAGES


def answer_at(
    at: float, status: int, body: dict, path: str = "/healthz", took: float = 0.01, **head
) -> Reply:
    return Reply("POST" if path == "/runs" else "GET", path, status, body, head, at, at + took)


def health(at: float, reasons: tuple[str, ...] = (), before: list[str] = UP, after: list[str] = UP) -> Sample:
    body = {"ok": not reasons, "reasons": list(reasons), "nodes_up": STAGES, "nodes": STAGES, "store": "ok"}
    return Sample(list(before), answer_at(at, 503 if reasons else 200, body), list(after))


def store_refusal(at: float, took: float = 0.01) -> Reply:
    body = {"error": "the run store cannot save runs now: runs.sqlite3: database is locked"}
    return answer_at(at, 503, body, "/runs", took, **{"Retry-After": "5"})


def lies(
    *samples: Sample, posts: tuple[Reply, ...] = (), locks: tuple[tuple[float, float], ...] = ()
) -> list[str]:
    log = Log(t0=0.0)
    log.samples, log.posts, log.locks = list(samples), list(posts), list(locks)
    return judge(log)


DOWN_1 = ["up", "down", "up"]
STAGE_1 = "stages: 1 of 3 stages are not up: stage 1 (127.0.0.1:4001, layers 2..4) is down: exited"


def test_the_judge_calls_a_200_a_lie_when_a_stage_was_down_just_before_and_just_after_it():
    assert "stage 1 down/down" in lies(health(5.0, before=DOWN_1, after=DOWN_1))[0]
    assert lies(health(5.0, after=DOWN_1)) == [], "a stage that went down after the answer is no lie"


def test_the_judge_calls_a_503_a_lie_when_the_stage_it_names_was_up_before_and_after_it():
    assert "[1]" in lies(health(5.0, (STAGE_1,)))[0]
    assert lies(health(5.0, (STAGE_1,), before=DOWN_1)) == []


def test_the_judge_calls_a_503_for_the_store_a_lie_unless_the_soak_held_its_lock_lately():
    store = "store: runs.sqlite3: cannot save run 3: database is locked"
    assert "nobody had locked" in lies(health(20.0, (store,)), locks=((1.0, 8.0),))[0]
    assert lies(health(9.0, (store,)), locks=((1.0, 8.0),)) == []


def test_the_judge_calls_a_200_a_lie_after_a_post_was_refused_for_the_store_while_the_lock_is_held():
    posts, locks = (store_refusal(4.0),), ((1.0, 8.0),)
    assert "store was failing" in lies(health(5.0), posts=posts, locks=locks)[0]
    assert lies(health(3.0), posts=posts, locks=locks) == [], "before a write fails none can know"
    assert lies(health(8.5), posts=posts, locks=locks) == [], "once the lock is gone the store may work again"


def test_the_judge_calls_a_stopped_run_loop_or_a_reason_it_does_not_know_a_problem():
    found = lies(health(5.0, ("run loop: the run loop stopped: RuntimeError()", "disk: full")))
    assert "run loop stopped" in found[0] and "unknown reason" in found[1]


def test_the_log_counts_documented_refusals_by_cause_and_any_other_5xx_as_a_violation():
    log = Log(t0=0.0)
    log.record(store_refusal(1.0))
    log.record(answer_at(1.0, 503, {"error": "stage 0 (a, layers 0..2) is down: exited"}, "/runs"))
    log.record(answer_at(1.0, 500, {"error": "internal error; see the coordinator log"}, "/runs"))
    log.record(answer_at(1.0, 503, {"reasons": ["store: locked"]}))
    assert log.refusals == {"store failing": 1, "healthz not ready": 1}
    assert len(log.violations) == 2, "a 503 without Retry-After and a 500 both break the soak"


def test_the_log_calls_a_run_reported_with_two_different_final_statuses_a_violation():
    log = Log(t0=0.0)
    log.observe({"id": 7, "status": "ok"})
    log.observe({"runs": [{"id": 7, "status": "failed"}, {"id": 8, "status": "running"}]})
    assert log.final == {7: "ok"} and log.violations == ["run 7 was reported ok, later failed"]


def vacancy(took: float | None, closed: int = len(SQUAT_SOURCES)) -> Vacancy:
    return Vacancy(1, 4242, 10.0, None if took is None else 10.0 + took, 4343, closed)


def test_the_join_judge_calls_a_vacancy_never_held_again_or_held_past_its_bound_a_violation():
    assert "never held again" in judge_vacancies([vacancy(None)])[0]
    assert "past its bound" in judge_vacancies([vacancy(REFILL_S + 0.5)])[0]
    assert judge_vacancies([vacancy(REFILL_S - 0.5)]) == []


def test_the_join_judge_calls_a_kill_while_the_join_port_was_not_full_of_squatters_no_test_of_them():
    assert "port was not full" in judge_vacancies([vacancy(1.0, closed=len(SQUAT_SOURCES) - 1)])[0]


def stopped(**change) -> Stop:
    """Evidence of a SIGTERM that went right, with `change` made to it."""
    stop = Stop(took=1.0, code=128 + signal.SIGTERM, busy={1: "running", 2: "queued"}, workers=[70, 71],
                accepted=[1, 2], stored={1: "interrupted", 2: "interrupted"},
                listed={1: "interrupted", 2: "interrupted"},
                chat_ends=[[{"error": {"message": "run 1 ended interrupted"}}, "[DONE]"]])  # fmt: skip
    for name, value in change.items():
        setattr(stop, name, value)
    return stop


def test_the_stop_judge_passes_a_sigterm_that_went_right():
    assert judge_stop(stopped()) == []


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"took": EXIT_BOUND_S + 0.1}, "past its bound"),
        ({"code": 0}, "exit status 0"),
        ({"code": None}, "exit status None"),
        ({"busy": {1: "running", 2: "ok"}}, "not under load"),
        ({"busy": {1: "queued"}}, "not under load"),
        ({"workers": []}, "no worker was seen"),
        ({"alive": [71]}, "worker 71 outlived"),
        (
            {"stored": {1: "interrupted"}, "listed": {1: "interrupted"}},
            "run 2 was accepted but is not in the file",
        ),
        (
            {"stored": {1: "interrupted", 2: "running"}, "listed": {1: "interrupted", 2: "running"}},
            "run 2 is running",
        ),
        ({"stored": {1: "interrupted", 2: "ok", 3: "queued"}}, "run 3 is queued in the file"),
        ({"listed": {1: "interrupted"}}, "run 2 is interrupted in the file, None once restarted"),
        ({"listed": {1: "interrupted", 2: "ok"}}, "run 2 is interrupted in the file, ok once restarted"),
        ({"chat_ends": [[{"choices": [{"finish_reason": "length"}]}, "[DONE]"]]}, "did not end interrupted"),
        ({"chat_ends": [[{"error": {"message": "interrupted"}}]]}, "did not end interrupted"),
    ],
)
def test_the_stop_judge_finds_each_way_a_sigterm_under_load_can_go_wrong(change, says):
    found = judge_stop(stopped(**change))
    assert any(says in lie for lie in found), found


def test_the_generation_judge_finds_a_lost_run_a_failure_not_starved_and_a_token_difference(tmp_path):
    db = tmp_path / "runs.sqlite3"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE runs (id INTEGER PRIMARY KEY, status TEXT, run BLOB)")
        conn.executemany("INSERT INTO runs VALUES (?, ?, ?)", [
            (i, s, json.dumps({"status": s})) for i, s in ((1, "ok"), (2, "ok"), (3, "failed"), (4, "failed"))
        ])  # fmt: skip
    conn.close()
    starved = "stage 2 (127.0.0.1:4002, layers 4..6) is failed: out of automatic restarts (5 allowed in 60 s)"
    seen = Generated(reference=[[5, 6, 7]], starved=[(2, 1.0, 9.0)], requests={i: 0 for i in range(1, 6)})
    seen.runs = {
        1: {"status": "ok", "tokens": [5, 6, 7]},
        2: {"status": "ok", "tokens": [5, 6, 8]},  # a token differs
        3: {"status": "failed", "error": starved},  # starved on purpose: counted, not a fault
        4: {"status": "failed", "error": "stage 1 (127.0.0.1:4001, layers 2..4) is down: not back in time"},
        5: {"status": "ok", "tokens": [5, 6, 7]},  # accepted, never stored
    }
    found = judge_generated(seen, db)
    assert len(found) == 3, found
    assert "run 2" in found[0] and "at token 2" in found[0]
    assert "run 4" in found[1] and "not back in time" in found[1]
    assert found[2] == "run 5 was accepted but is not in the file"
    assert seen.log.counts["starved runs failed"] == 1
