"""A generation's recovery from a lost stage, timed (bench.faults): SmolLM2, 3 packed stages, 64 tokens.

Per case: the extra wall time beyond an undisturbed run of the same request on
the same cluster, split into waiting for the stage and replaying into it, and
whether the tokens are the undisturbed run's. Target: extra <= the stage's
restart time (from the fault to the stage up again) + 1.2 x one prefill of the
replayed positions into that stage. Three faults (FAULTS: stage 1 SIGKILLed
at token 20; SIGSTOPped at token 20, found out by the 2 s forward timeout;
stage 2 SIGKILLed during the prompt), each met by launched workers, by joined
workers (a spare joined beforehand, or a new worker joining 2 s after the
fault) and by Ray actors (the stage's worker, a child of its actor, signalled;
Ray's replacement taking its place).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from pathlib import Path

import numpy as np

from coordinator.cluster import Cluster, ClusterConfig, open_cluster
from coordinator.events import Event, NodeChanged, StageForward, TokenGenerated
from coordinator.launch.base import local_env
from coordinator.runs.requests import RunRequest
from coordinator.stats import ClusterRun
from workers.models import ModelSpecError, smollm2_path
from workers.protocol import auth
from workers.protocol.info import BatchItem

WAIT_S = 120.0  # the most a fault may take to show, a stage to come back, or a run to end
STAGES = 3
# A joiner that arrives after the kill arrives this long after it.
LATE_JOINER_S = 2.0
TOKEN = "bench-recovery-token"
TERM_GRACE_S, KILL_WAIT_S = 3.0, 5.0
# Counting goes on: no end token within 64 (a sentence ends in one sooner).
GENERATION = RunRequest(prompt="1, 2, 3, 4, 5, 6, 7, 8,", max_new_tokens=64)
# Long enough that stage 2 is still computing it when stage 1 has replied.
LONG_PROMPT = RunRequest(prompt=" ".join(["The lighthouse keeper watched the sea."] * 24), max_new_tokens=64)
# How a fault is made: given the cluster and the stage, do it (a signal, and what follows it).
Fault = Callable[[Cluster, int], Awaitable[None]]


def at_token_20(e: Event) -> bool:
    return isinstance(e, TokenGenerated) and e.index == 20


def in_prompt(e: Event) -> bool:
    return isinstance(e, StageForward) and e.step == 0 and e.stage == 1


def signal_worker(sig: int) -> Fault:
    """Send `sig` to the stage's worker process (launched, joined, a Ray actor's child: its report's pid)."""

    async def send(cluster: Cluster, stage: int) -> None:
        os.kill(cluster.pipeline.nodes[stage].report.pid, sig)

    return send


def _kill_if_stopped(pid: int) -> None:
    """SIGKILL process `pid` if it is stopped: a stopped worker cannot see its parent (a Ray actor) go."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return
    if state == "T":
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


# Each fault: the request it meets, the stage it hits, how, and at which event.
FAULTS: dict[str, tuple[RunRequest, int, Fault, Callable[[Event], bool]]] = {
    "stage1_sigkill_at_token_20": (GENERATION, 1, signal_worker(signal.SIGKILL), at_token_20),
    "stage1_sigstop_at_token_20": (GENERATION, 1, signal_worker(signal.SIGSTOP), at_token_20),
    "stage2_sigkill_in_prompt": (LONG_PROMPT, 2, signal_worker(signal.SIGKILL), in_prompt),
}


async def kill_ray_actor(cluster: Cluster, stage: int) -> None:
    """SIGKILL the Ray actor whose child the stage's worker is: the worker dies with it."""
    stat = Path(f"/proc/{cluster.pipeline.nodes[stage].report.pid}/stat").read_text()
    os.kill(int(stat.rsplit(")", 1)[1].split()[1]), signal.SIGKILL)


async def _fault_when(
    cluster: Cluster, accept: Callable[[Event], bool], stage: int, fault: Fault
) -> asyncio.Task:
    """Make `fault` at stage `stage` at the first event `accept` takes; ends (ms) once the stage is back."""
    events = cluster.bus.subscribe(accept=lambda e: accept(e) or isinstance(e, NodeChanged))

    async def watch() -> float:
        try:
            async with asyncio.timeout(WAIT_S):
                while not accept(await events.get()):
                    pass
                made = time.monotonic()
                await fault(cluster, stage)
                while not (
                    isinstance(e := await events.get(), NodeChanged) and e.stage == stage and e.state == "up"
                ):
                    pass
                return (time.monotonic() - made) * 1000
        finally:
            events.close()

    return asyncio.create_task(watch())


async def _prefill_ms(cluster: Cluster, stage: int, positions: int) -> float:
    """One prefill of `positions` into stage `stage` alone, from position 0, in a throw-away session."""
    if positions == 0:
        return 0.0
    node, info = cluster.pipeline.nodes[stage], cluster.pipeline.info
    rng = np.random.default_rng(0)
    x = rng.integers(0, info.vocab, positions).astype(np.int32) if stage == 0 else (
        rng.standard_normal((positions, info.hidden)).astype(np.float32))  # fmt: skip
    started = time.monotonic()
    await asyncio.to_thread(node.client.forward_now, BatchItem(x, "bench-prefill", 0, last_only=True), WAIT_S)
    took = (time.monotonic() - started) * 1000
    await node.client.reset("bench-prefill")
    return took


async def recovered(cluster: Cluster, req: RunRequest, stage: int, fault: Fault, at) -> dict:
    """Run `req` undisturbed, then again with `fault` made at `stage` at the event `at` takes: the figures."""
    started = time.monotonic()
    alone = await cluster.runner.run(req)
    undisturbed_ms = (time.monotonic() - started) * 1000
    if len(alone.tokens) < req.max_new_tokens:
        why = f"{alone.status}: {alone.error}" if alone.error else "it ends there"
        raise ValueError(f"{req.prompt[:30]!r} gives {len(alone.tokens)} tokens undisturbed ({why})")
    faulty = await _fault_when(cluster, at, stage, fault)
    hit = cluster.pipeline.nodes[stage].report.pid
    started = time.monotonic()
    try:
        run = await asyncio.wait_for(cluster.runner.run(req), WAIT_S)
        wall_ms = (time.monotonic() - started) * 1000
        restart_ms = await asyncio.wait_for(faulty, WAIT_S)
    finally:
        _kill_if_stopped(hit)
    waited = sum(r.waited_ms for r in run.recoveries)
    replayed = sum(r.replayed_positions for r in run.recoveries)
    prefill = await _prefill_ms(cluster, stage, replayed)
    extra = wall_ms - undisturbed_ms
    slower = _slower_steps(alone, run, stage)
    return {
        "status": run.status, "error": run.error, "tokens_equal": run.tokens == alone.tokens,
        "tokens": len(run.tokens), "undisturbed_ms": round(undisturbed_ms, 1), "extra_ms": round(extra, 1),
        "waited_ms": round(waited, 1), "replay_ms": round(sum(r.replay_ms for r in run.recoveries), 1),
        "replayed_positions": replayed, "restart_ms": round(restart_ms, 1),
        "one_prefill_ms": round(prefill, 1), "target_ms": round(restart_ms + 1.2 * prefill, 1),
        "within_target": extra <= restart_ms + 1.2 * prefill, "recoveries": len(run.recoveries),
        "rest_ms": round(extra - waited - sum(r.replay_ms for r in run.recoveries), 1), **slower,
    }  # fmt: skip


def _slower_steps(alone: ClusterRun, run: ClusterRun, stage: int) -> dict:
    """Where the time beyond the wait and the replay went: the faulted stage's forward in the retried step
    (undisturbed, then retried), and its forwards and the steps' walls after it, against the same steps
    undisturbed (positive: slower after the fault).

    Both records keep the prefill and the same last decode steps, so steps pair by (step, positions).
    """
    before = {(s.step, s.positions): s for s in alone.steps}
    retried = min((s.step for s in run.steps if s.replayed), default=None)
    if retried is None:
        return {}
    pairs = [(before[s.step, s.positions], s) for s in run.steps if (s.step, s.positions) in before]
    first = next(((a, b) for a, b in pairs if b.step == retried), None)
    after = [(a, b) for a, b in pairs if b.step > retried]
    return {
        "retried_step": retried,
        "retried_stage_forward_ms": [round(t.forward_ms[stage], 1) for t in first] if first else [],
        "stage_forward_after_ms": round(sum(b.forward_ms[stage] - a.forward_ms[stage] for a, b in after), 1),
        "step_wall_after_ms": round(sum(b.wall_ms - a.wall_ms for a, b in after), 1),
    }


def _config(**kw) -> ClusterConfig:
    return ClusterConfig(
        "smollm2", STAGES, precision="packed", forward_timeout=2.0, build_timeout=WAIT_S, **kw
    )


async def launched() -> dict:
    """Launched workers: each fault in turn on one cluster (the supervisor restarts the stage)."""
    async with open_cluster(_config()) as cluster:
        return {case: await recovered(cluster, req, stage, fault, at) for case, (req, stage, fault, at) in
                FAULTS.items()}  # fmt: skip


class Joiners:
    """`python -m workers --join` processes for one case, each given its share of the cores; all stopped."""

    def __init__(self, addr: str, logs: Path) -> None:
        self.addr, self.logs = addr, logs
        self.procs: list[asyncio.subprocess.Process] = []
        self.env = os.environ | local_env(STAGES) | {auth.WORKER_TOKEN_ENV: TOKEN}

    async def start(self) -> None:
        # Its stderr to a file nobody needs to read as it goes (a pipe unread would fill and block it).
        log = os.open(self.logs / f"joiner-{len(self.procs)}.log", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            self.procs.append(await asyncio.create_subprocess_exec(
                sys.executable, "-m", "workers", "--join", self.addr, "--model", "smollm2",
                "--parent-pid", str(os.getpid()),
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=log, env=self.env,
            ))  # fmt: skip
        finally:
            os.close(log)

    async def start_later(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        await self.start()

    async def stop(self) -> None:
        """Terminate, wait, kill, wait: every one, concurrently (a stopped one is let go on first)."""

        async def one(proc: asyncio.subprocess.Process) -> None:
            if proc.returncode is not None:
                return
            with suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), TERM_GRACE_S)
            except TimeoutError:
                with suppress(ProcessLookupError):
                    proc.kill()
                await asyncio.wait_for(proc.wait(), KILL_WAIT_S)

        await asyncio.gather(*(one(p) for p in self.procs))


@asynccontextmanager
async def joined(workers: int) -> AsyncIterator[tuple[Cluster, Joiners]]:
    """A cluster whose STAGES stages `workers` joined workers fill (spares beyond them), once all are up."""
    with tempfile.TemporaryDirectory(prefix="rlx-joiners-") as logs:
        async with open_cluster(_config(join="127.0.0.1:0", worker_token=TOKEN)) as cluster:
            assert cluster.joins is not None
            joiners = Joiners(cluster.joins.addr, Path(logs))
            try:
                for _ in range(workers):
                    await joiners.start()
                async with asyncio.timeout(WAIT_S):
                    while cluster.pipeline.unready() is not None or len(cluster.joins.members) < workers:
                        await asyncio.sleep(0.05)
                yield cluster, joiners
            finally:
                await joiners.stop()


async def through_joins() -> dict:
    """Joined workers, each fault on a cluster of its own: with a spare joined beforehand (it takes the
    vacancy), and with none, a new worker joining LATE_JOINER_S after the fault."""
    figures = {}
    for case, (req, stage, fault, at) in FAULTS.items():
        async with joined(STAGES + 1) as (cluster, _):
            figures[f"join_spare_{case}"] = await recovered(cluster, req, stage, fault, at)
        async with joined(STAGES) as (cluster, joiners):
            late: list[asyncio.Task] = []
            then_join = _then_joining(fault, joiners, late)
            figures[f"join_new_2s_later_{case}"] = await recovered(cluster, req, stage, then_join, at)
            await asyncio.gather(*late)
    return figures


def _then_joining(fault: Fault, joiners: Joiners, late: list[asyncio.Task]) -> Fault:
    """`fault`, then a new worker joining LATE_JOINER_S later (its task in `late`)."""

    async def made(cluster: Cluster, stage: int) -> None:
        await fault(cluster, stage)
        late.append(asyncio.create_task(joiners.start_later(LATE_JOINER_S)))

    return made


async def through_ray() -> dict:
    """Ray actors (half a CPU each, so that 3 fit on 2 cores): stage 1's actor killed at token 20, then each
    fault made to a stage's worker, the actor's child."""
    # A local instance bound to loopback (Ray reads this when it is imported).
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        import ray  # noqa: F401
    except ImportError as exc:
        return {"ray": {"skipped": f"Ray is not installed ({exc})"}}
    async with open_cluster(_config(launcher="ray", ray_cpus=0.5)) as cluster:
        figures = {"ray_stage1_actor_sigkill_at_token_20": await recovered(
            cluster, GENERATION, 1, kill_ray_actor, at_token_20
        )}  # fmt: skip
        for case, (req, stage, fault, at) in FAULTS.items():
            figures[f"ray_{case}"] = await recovered(cluster, req, stage, fault, at)
        return figures


async def generation_recovery() -> dict:
    """Every case, launched, joined and through Ray."""
    try:
        smollm2_path()
    except ModelSpecError as exc:
        return {"skipped": str(exc)}
    return {**await launched(), **await through_joins(), **await through_ray()}


def lines(figures: dict) -> list[str]:
    """One line per case: the extra time beside its target, what it was spent on, the tokens' equality."""
    if "skipped" in figures:
        return [f"generation recovery: skipped ({figures['skipped']})"]
    out = []
    for case, f in figures.items():
        if "skipped" in f or f.get("status") != "ok":
            out.append(f"recovery {case}: {f.get('skipped') or f.get('status')}: {f.get('error')}")
            continue
        out.append(
            f"recovery {case}: extra {f['extra_ms']:.0f} ms, target ≤ {f['target_ms']:.0f} ms (restart "
            f"{f['restart_ms']:.0f} + 1.2 × prefill {f['one_prefill_ms']:.0f} of {f['replayed_positions']} "
            f"positions): {'within' if f['within_target'] else 'OVER'}; waited {f['waited_ms']:.0f} ms, "
            f"replayed in {f['replay_ms']:.0f} ms; rest {f['rest_ms']:.0f} ms (retried forward "
            f"{f.get('retried_stage_forward_ms')} ms; the stage's forwards after it "
            f"{f.get('stage_forward_after_ms', 0):+.0f} ms, steps' walls "
            f"{f.get('step_wall_after_ms', 0):+.0f} ms); "
            f"tokens equal: {'yes' if f['tokens_equal'] else 'NO'}"
        )
    return out
