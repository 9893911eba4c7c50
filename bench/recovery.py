"""A generation's recovery from a lost stage, timed (bench.faults): SmolLM2, 3 packed stages, 64 tokens.

Per case: the extra wall time beyond undisturbed runs of the same request on
the same cluster, split into waiting for the stage and replaying into it, and
whether the tokens are the undisturbed runs'; PAIRS faulted runs alternate
with undisturbed ones, and the medians over them decide. Target: extra <= the stage's
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
import statistics
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
# Faulted runs per case, alternated with undisturbed ones: their medians decide the target.
PAIRS = 3
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


async def _undisturbed(cluster: Cluster, req: RunRequest) -> tuple[ClusterRun, float]:
    """One undisturbed run of `req`, and its wall (ms); ValueError if it ends before max_new_tokens."""
    started = time.monotonic()
    run = await asyncio.wait_for(cluster.runner.run(req), WAIT_S)
    wall_ms = (time.monotonic() - started) * 1000
    if run.status != "ok" or len(run.tokens) < req.max_new_tokens:
        why = f"{run.status}: {run.error}" if run.error else "it ends there"
        raise ValueError(f"{req.prompt[:30]!r} gives {len(run.tokens)} tokens undisturbed ({why})")
    return run, wall_ms


async def _faulted(
    cluster: Cluster, req: RunRequest, stage: int, fault: Fault, at: Callable[[Event], bool]
) -> tuple[ClusterRun, float, float]:
    """One run of `req` with `fault` made at `stage` at the event `at` takes: the run, its wall and the
    stage's restart (ms, from the fault to the stage up again)."""
    faulty = await _fault_when(cluster, at, stage, fault)
    hit = cluster.pipeline.nodes[stage].report.pid
    started = time.monotonic()
    try:
        run = await asyncio.wait_for(cluster.runner.run(req), WAIT_S)
        wall_ms = (time.monotonic() - started) * 1000
        restart_ms = await asyncio.wait_for(faulty, WAIT_S)
    finally:
        _kill_if_stopped(hit)
    return run, wall_ms, restart_ms


async def recovered(
    cluster: Cluster, req: RunRequest, stage: int, fault: Fault, at: Callable[[Event], bool],
    pairs: int = PAIRS,
) -> dict:  # fmt: skip
    """`req` run undisturbed and with `fault` made at `stage` at the event `at` takes, alternately
    (undisturbed first and last, `pairs` faulted runs between): each faulted run's figures against the mean
    of the undisturbed runs either side of it, and their medians, which decide the target.

    One pair cannot: consecutive undisturbed runs of SmolLM2's 64 tokens on 3 stages of 2 cores differ by
    up to ~300 ms, more than the 50-150 ms the target allows beyond the restart.
    """
    alone, wall_ms = await _undisturbed(cluster, req)
    undisturbed = [wall_ms]
    each = []
    for _ in range(pairs):
        run, faulted_ms, restart_ms = await _faulted(cluster, req, stage, fault, at)
        after, wall_ms = await _undisturbed(cluster, req)
        baseline = (undisturbed[-1] + wall_ms) / 2
        undisturbed.append(wall_ms)
        each.append(await _pair(cluster, stage, alone, run, faulted_ms - baseline, restart_ms))
        alone = after
    median = {k: round(statistics.median(f[k] for f in each), 1) for k in MEDIANS}
    over = statistics.median(f["extra_ms"] - f["target_ms"] for f in each)
    failed = next((f for f in each if f["status"] != "ok"), None)
    return {
        "status": failed["status"] if failed else "ok", "error": failed["error"] if failed else None,
        "tokens_equal": all(f["tokens_equal"] for f in each), "pairs": each,
        "undisturbed_ms": [round(u, 1) for u in undisturbed], **median,
        "over_target_ms": round(over, 1), "within_target": over <= 0,
        "pairs_within": sum(f["within_target"] for f in each),
        "replayed_positions": statistics.median(f["replayed_positions"] for f in each),
    }  # fmt: skip


# The figures of a case that are medians over its pairs.
MEDIANS = ("extra_ms", "target_ms", "restart_ms", "waited_ms", "replay_ms", "one_prefill_ms", "rest_ms")


async def _pair(
    cluster: Cluster, stage: int, alone: ClusterRun, run: ClusterRun, extra: float, restart_ms: float
) -> dict:
    """One faulted run's figures: `extra` ms beyond the undisturbed, and what it was spent on."""
    waited = sum(r.waited_ms for r in run.recoveries)
    replay = sum(r.replay_ms for r in run.recoveries)
    replayed = sum(r.replayed_positions for r in run.recoveries)
    prefill = await _prefill_ms(cluster, stage, replayed)
    target = restart_ms + 1.2 * prefill
    return {
        "status": run.status, "error": run.error, "tokens_equal": run.tokens == alone.tokens,
        "tokens": len(run.tokens), "extra_ms": round(extra, 1), "waited_ms": round(waited, 1),
        "replay_ms": round(replay, 1), "replayed_positions": replayed, "restart_ms": round(restart_ms, 1),
        "one_prefill_ms": round(prefill, 1), "target_ms": round(target, 1), "within_target": extra <= target,
        "recoveries": len(run.recoveries), "rest_ms": round(extra - waited - replay, 1),
        **_slower_steps(alone, run, stage),
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
    """Launched workers (the supervisor restarts the stage): each fault on a cluster of its own, so that its
    PAIRS restarts stay within a stage's restart budget."""
    figures = {}
    for case, (req, stage, fault, at) in FAULTS.items():
        async with open_cluster(_config()) as cluster:
            figures[case] = await recovered(cluster, req, stage, fault, at)
    return figures


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
    """Joined workers, each fault on a cluster of its own: with spares joined beforehand (one takes each
    vacancy), and with none, a new worker joining LATE_JOINER_S after each fault."""
    figures = {}
    for case, (req, stage, fault, at) in FAULTS.items():
        async with joined(STAGES + PAIRS) as (cluster, _):
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
    cases = {"ray_stage1_actor_sigkill_at_token_20": (GENERATION, 1, kill_ray_actor, at_token_20)}
    cases |= {f"ray_{case}": made for case, made in FAULTS.items()}
    figures = {}
    for case, (req, stage, fault, at) in cases.items():  # a cluster each, as launched() says why
        async with open_cluster(_config(launcher="ray", ray_cpus=0.5)) as cluster:
            figures[case] = await recovered(cluster, req, stage, fault, at)
    return figures


# Another process that builds stage 1's layers, as a restart's worker does, then waits to be stopped.
BUILDER = (
    "import sys\nfrom workers.models import build\nfrom workers.protocol.report import LayerRange\n"
    "stage = build('smollm2', LayerRange.parse(sys.argv[1]), 'packed')\nprint('built', flush=True)\n"
    "sys.stdin.read()\n"
)
# The decode steps compared before and after a build: those after the token a fault is made at.
AFTER_TOKEN = 24


async def _decode_after(cluster: Cluster, req: RunRequest) -> tuple[float, list[float]]:
    """One undisturbed run: the wall (ms) of its steps after AFTER_TOKEN, and each stage's mean forward."""
    events = cluster.bus.subscribe(accept=lambda e: isinstance(e, (StageForward, TokenGenerated)))
    seen: list[tuple[float, Event]] = []

    async def pump() -> None:
        while True:
            seen.append((time.monotonic(), await events.get()))

    pumping = asyncio.create_task(pump())
    try:
        await _undisturbed(cluster, req)
        await asyncio.sleep(0.05)  # the last events on their way
    finally:
        pumping.cancel()
        events.close()
    tokens = [t for t, e in seen if isinstance(e, TokenGenerated) and e.index >= AFTER_TOKEN]
    forwards = [e for _, e in seen if isinstance(e, StageForward) and e.step > AFTER_TOKEN]
    means = [statistics.mean(e.forward_ms for e in forwards if e.stage == s) for s in range(STAGES)]
    return (tokens[-1] - tokens[0]) * 1000, [round(m, 2) for m in means]


async def after_a_build(rounds: int = PAIRS) -> dict:
    """What a stage's build costs the runs after it with no fault at all: on launched workers, a run
    before and a run after another process has built stage 1's layers (it then waits), in turn.

    A restart builds a stage, so a recovered run's steps after it pay this as well as the target's
    restart and replay; here nothing is lost, replayed or waited for.
    """
    before, after = [], []
    async with open_cluster(_config()) as cluster:
        layers = str(cluster.pipeline.nodes[1].layers)
        await _undisturbed(cluster, GENERATION)  # the first run's one-off costs, as the cases pay none
        for _ in range(rounds):
            before.append(await _decode_after(cluster, GENERATION))
            builder = await asyncio.create_subprocess_exec(
                sys.executable, "-c", BUILDER, layers, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, env=os.environ | local_env(STAGES),
            )  # fmt: skip
            try:
                assert builder.stdout is not None
                said = await asyncio.wait_for(builder.stdout.readline(), WAIT_S)
                if said.strip() != b"built":
                    raise RuntimeError(f"the builder said {said!r}, not that it built {layers}")
                after.append(await _decode_after(cluster, GENERATION))
            finally:
                with suppress(ProcessLookupError):
                    builder.kill()
                await builder.wait()
    return {
        "layers_built": layers, "steps_after_token": AFTER_TOKEN,
        "steps_ms_before": [round(b[0], 1) for b in before],
        "steps_ms_after": [round(a[0], 1) for a in after],
        "stage_forward_ms_before": [b[1] for b in before], "stage_forward_ms_after": [a[1] for a in after],
        "slower_ms_median": round(statistics.median(a[0] - b[0] for a, b in zip(after, before, strict=True)),
                                  1),
    }  # fmt: skip


async def generation_recovery() -> dict:
    """Every case, launched, joined and through Ray; and what a build alone costs the runs after it."""
    try:
        smollm2_path()
    except ModelSpecError as exc:
        return {"skipped": str(exc)}
    return {**await launched(), **await through_joins(), **await through_ray(),
            "after_a_build": await after_a_build()}  # fmt: skip


def lines(figures: dict) -> list[str]:
    """One line per case: the extra time beside its target, what it was spent on, the tokens' equality."""
    if "skipped" in figures:
        return [f"generation recovery: skipped ({figures['skipped']})"]
    out = []
    for case, f in figures.items():
        if case == "after_a_build":
            out.append(
                f"after a build of layers {f['layers_built']} by another process, no fault: the steps after "
                f"token {f['steps_after_token']} took {f['steps_ms_after']} ms against "
                f"{f['steps_ms_before']} before it (median {f['slower_ms_median']:+.0f} ms); each stage's "
                f"forwards {f['stage_forward_ms_after']} against {f['stage_forward_ms_before']} ms"
            )
            continue
        if "skipped" in f or f.get("status") != "ok":
            out.append(f"recovery {case}: {f.get('skipped') or f.get('status')}: {f.get('error')}")
            continue
        over = [round(p["extra_ms"] - p["target_ms"]) for p in f["pairs"]]
        retried = [p.get("retried_stage_forward_ms") for p in f["pairs"]]
        out.append(
            f"recovery {case}: extra {f['extra_ms']:.0f} ms, target ≤ {f['target_ms']:.0f} ms (restart "
            f"{f['restart_ms']:.0f} + 1.2 × prefill {f['one_prefill_ms']:.0f} of {f['replayed_positions']} "
            f"positions), medians of {len(over)} pairs: {'within' if f['within_target'] else 'OVER'} by "
            f"{abs(f['over_target_ms']):.0f} ms ({f['pairs_within']} of {len(over)} pairs within; extra − "
            f"target per pair {over} ms); waited {f['waited_ms']:.0f} ms, replayed in "
            f"{f['replay_ms']:.0f} ms; "
            f"rest {f['rest_ms']:.0f} ms (retried forward undisturbed → retried, per pair: {retried} ms); "
            f"tokens equal: {'yes' if f['tokens_equal'] else 'NO'}"
        )
    return out
