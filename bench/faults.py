"""Each fault provoked for real (`python -m bench.faults`): its detection on fake workers, and a
generation's recovery from it on SmolLM2 (3 packed stages, a 64-token greedy generation): the extra
wall time beyond an undisturbed run, split into waiting for the stage and replaying into it, and
whether the tokens are the undisturbed run's. Target: extra <= the stage's restart time + 1.2 x one
prefill of the replayed positions into that stage.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time

import numpy as np

from bench.coordinator_restart import coordinator_killed_mid_generation
from coordinator.cluster import Cluster, ClusterConfig, open_cluster
from coordinator.events import NodeChanged, StageForward, TokenGenerated
from coordinator.launch.base import LaunchError
from coordinator.launch.local import Launcher
from coordinator.plan.split import split
from coordinator.runs.requests import RunRequest
from coordinator.stages.chain import ForwardRequest
from coordinator.stages.pipeline import Pipeline, StageFailed
from coordinator.stages.supervisor import launch_pipeline
from workers.models import ModelSpecError, describe, smollm2_path
from workers.protocol.info import BatchItem
from workers.protocol.report import LayerRange

X = np.ones((2, 4), np.float32)
WAIT_S = 60.0  # the most any fault may take to show, or the coordinator to start


async def launch(model: str, stages: int = 2, **kw) -> Pipeline:
    info = describe(model)
    return await launch_pipeline(Launcher(model), info, split(info.n_layers, stages), **kw)


async def killed_mid_forward() -> dict:
    pipeline = await launch("fake:layers=4,delay_ms=3000,stage=2", recover_timeout=0)
    try:
        forward = asyncio.create_task(pipeline.forward(ForwardRequest(BatchItem(X, "s", 0))))
        await asyncio.sleep(0.5)  # into stage 1's 3 s forward
        killed = time.monotonic()
        os.kill(pipeline.nodes[1].report.pid, signal.SIGKILL)
        try:
            await asyncio.wait_for(forward, WAIT_S)
        except StageFailed:
            failed_ms = (time.monotonic() - killed) * 1000
        else:
            raise AssertionError("the forward succeeded although its stage was killed")
        async with asyncio.timeout(WAIT_S):
            while pipeline.nodes[1].state != "up":
                await asyncio.sleep(0.01)
        restarted_ms = (time.monotonic() - killed) * 1000
        return {"run_failed_ms": round(failed_ms, 1), "stage_restarted_ms": round(restarted_ms, 1)}
    finally:
        await pipeline.close()


async def hang(timeout_s: float = 1.0) -> dict:
    pipeline = await launch("fake:layers=4,hang_on=1,stage=2", forward_timeout=timeout_s, recover_timeout=0)
    try:
        started = time.monotonic()
        try:
            await pipeline.forward(ForwardRequest(BatchItem(X, "s", 0)))
        except StageFailed:
            failed_ms = (time.monotonic() - started) * 1000
            return {"forward_timeout_s": timeout_s, "run_failed_ms": round(failed_ms, 1)}
        raise AssertionError("the hang was not detected")
    finally:
        await pipeline.close()


async def launch_failure(knobs: str, build_timeout: float = 5.0) -> dict:
    started = time.monotonic()
    try:
        await Launcher(f"fake:layers=4,{knobs}", build_timeout=build_timeout).start(0, LayerRange(0, 4))
    except LaunchError as exc:
        return {"error_ms": round((time.monotonic() - started) * 1000, 1), "error": str(exc).splitlines()[0]}
    raise AssertionError(f"{knobs} was not detected")


async def coordinator_signal(sig: int) -> dict:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "coordinator", "serve", "--model", "fake:layers=4", "--stages", "2",
        "--db", ":memory:", "--http", "127.0.0.1:0",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        async with asyncio.timeout(WAIT_S):
            while b"serving on" not in (line := await proc.stderr.readline()):
                if not line:
                    status = await proc.wait()
                    raise AssertionError(f"the coordinator exited with status {status} before serving")
        workers = [int(p) for p in os.listdir("/proc") if p.isdigit() and _child_of(int(p), proc.pid)]
        sent = time.monotonic()
        proc.send_signal(sig)
        await asyncio.wait_for(proc.wait(), WAIT_S)
        exited_ms = (time.monotonic() - sent) * 1000
        async with asyncio.timeout(WAIT_S):
            while any(os.path.exists(f"/proc/{p}") and not _zombie(p) for p in workers):
                await asyncio.sleep(0.01)
        gone_ms = (time.monotonic() - sent) * 1000
        return {"coordinator_exit_ms": round(exited_ms, 1), "workers_gone_ms": round(gone_ms, 1)}
    finally:
        if proc.returncode is None:  # it did not start, or ignored the signal: a bench leaves nothing running
            proc.kill()
            await asyncio.wait_for(proc.wait(), WAIT_S)


def _child_of(pid: int, parent: int) -> bool:
    try:
        return f"--parent-pid\0{parent}\0".encode() in open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        return False


def _zombie(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


# Counting goes on: no end token within 64 (a sentence ends in one sooner).
GENERATION = RunRequest(prompt="1, 2, 3, 4, 5, 6, 7, 8,", max_new_tokens=64)
# Long enough that stage 2 is still computing it when stage 1 has replied.
LONG_PROMPT = RunRequest(prompt=" ".join(["The lighthouse keeper watched the sea."] * 24), max_new_tokens=64)


async def _kill_when(cluster: Cluster, accept, stage: int, sig: int) -> asyncio.Task:
    """Send `sig` to stage `stage`'s worker at the first event `accept` takes; ends (ms) once it is back."""
    events = cluster.bus.subscribe(accept=lambda e: accept(e) or isinstance(e, NodeChanged))

    async def watch() -> float:
        try:
            async with asyncio.timeout(WAIT_S):
                while not accept(await events.get()):
                    pass
                killed = time.monotonic()
                os.kill(cluster.pipeline.nodes[stage].process.proc.pid, sig)
                while not (
                    isinstance(e := await events.get(), NodeChanged) and e.stage == stage and e.state == "up"
                ):
                    pass
                return (time.monotonic() - killed) * 1000
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


async def _recovered(cluster: Cluster, req: RunRequest, stage: int, sig: int, at) -> dict:
    """Run `req` undisturbed, then again with `sig` sent to `stage` at the event `at` takes: the figures."""
    started = time.monotonic()
    alone = await cluster.runner.run(req)
    undisturbed_ms = (time.monotonic() - started) * 1000
    if len(alone.tokens) < req.max_new_tokens:
        why = f"{alone.status}: {alone.error}" if alone.error else "it ends there"
        raise ValueError(f"{req.prompt[:30]!r} gives {len(alone.tokens)} tokens undisturbed ({why})")
    killer = await _kill_when(cluster, at, stage, sig)
    started = time.monotonic()
    run = await asyncio.wait_for(cluster.runner.run(req), WAIT_S)
    wall_ms = (time.monotonic() - started) * 1000
    restart_ms = await asyncio.wait_for(killer, WAIT_S)
    waited = sum(r.waited_ms for r in run.recoveries)
    replayed = sum(r.replayed_positions for r in run.recoveries)
    prefill = await _prefill_ms(cluster, stage, replayed)
    extra = wall_ms - undisturbed_ms
    return {
        "status": run.status, "error": run.error, "tokens_equal": run.tokens == alone.tokens,
        "tokens": len(run.tokens), "undisturbed_ms": round(undisturbed_ms, 1), "extra_ms": round(extra, 1),
        "waited_ms": round(waited, 1), "replay_ms": round(sum(r.replay_ms for r in run.recoveries), 1),
        "replayed_positions": replayed, "restart_ms": round(restart_ms, 1),
        "one_prefill_ms": round(prefill, 1), "target_ms": round(restart_ms + 1.2 * prefill, 1),
        "within_target": extra <= restart_ms + 1.2 * prefill, "recoveries": len(run.recoveries),
    }  # fmt: skip


async def generation_recovery() -> dict:
    """SmolLM2, 3 packed stages, 64 greedy tokens: stage 1 killed or stopped at token 20, stage 2 killed
    during the prompt."""
    try:
        smollm2_path()
    except ModelSpecError as exc:
        return {"skipped": str(exc)}
    config = ClusterConfig("smollm2", 3, precision="packed", forward_timeout=2.0, build_timeout=WAIT_S)
    at_token_20 = lambda e: isinstance(e, TokenGenerated) and e.index == 20  # noqa: E731
    in_prompt = lambda e: isinstance(e, StageForward) and e.step == 0 and e.stage == 1  # noqa: E731
    async with open_cluster(config) as cluster:
        return {
            "stage1_sigkill_at_token_20": await _recovered(
                cluster, GENERATION, 1, signal.SIGKILL, at_token_20
            ),
            "stage1_sigstop_at_token_20": await _recovered(
                cluster, GENERATION, 1, signal.SIGSTOP, at_token_20
            ),
            "stage2_sigkill_in_prompt": await _recovered(cluster, LONG_PROMPT, 2, signal.SIGKILL, in_prompt),
        }


async def all_faults() -> dict:
    return {
        "generation_recovery": await generation_recovery(),
        "worker_sigkill_mid_forward": await killed_mid_forward(),
        "worker_hangs": await hang(),
        "exits_before_report": await launch_failure("exit_before_report=1"),
        "invalid_report": await launch_failure("bad_report=1"),
        "never_reports": await launch_failure("late_ms=60000", build_timeout=5.0),
        "coordinator_sigterm": await coordinator_signal(signal.SIGTERM),
        "coordinator_sigint": await coordinator_signal(signal.SIGINT),
        "coordinator_sigkill": await coordinator_signal(signal.SIGKILL),
        "coordinator_sigkill_mid_generation": await asyncio.to_thread(coordinator_killed_mid_generation),
    }


def faults() -> dict:
    """Provoke each fault once and time its detection."""
    return asyncio.run(all_faults())


if __name__ == "__main__":
    print(json.dumps(faults(), indent=1))
