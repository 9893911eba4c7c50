"""Each fault provoked for real (`python -m bench.faults`): its detection on fake workers, and a
generation's recovery from it on SmolLM2 (bench.recovery: 3 packed stages, a 64-token greedy
generation, on launched, joined and Ray workers): the extra wall time beyond an undisturbed run, split
into waiting for the stage and replaying into it, and whether the tokens are the undisturbed run's.
Target: extra <= the stage's restart time + 1.2 x one prefill of the replayed positions into that stage.

`python -m bench.faults recovery` runs the generation's recovery alone.
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
from bench.recovery import generation_recovery, lines
from coordinator.launch.base import LaunchError
from coordinator.launch.local import Launcher
from coordinator.plan.split import split
from coordinator.stages.chain import ForwardRequest
from coordinator.stages.pipeline import Pipeline, StageFailed
from coordinator.stages.supervisor import launch_pipeline
from workers.models import describe
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
    results = asyncio.run(generation_recovery()) if sys.argv[1:] == ["recovery"] else faults()
    print(json.dumps(results, indent=1))
    print("\n".join(lines(results.get("generation_recovery", results))), file=sys.stderr)
