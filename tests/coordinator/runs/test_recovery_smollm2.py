"""SmolLM2 through the packed kernels on 3 stages: a stage killed mid-generation is refilled exactly."""

from __future__ import annotations

import asyncio
import os
import signal

from coordinator.events import TokenGenerated
from coordinator.runs.requests import RunRequest

TIMEOUT_S = 120
GREEDY = RunRequest(prompt="The capital of France is", max_new_tokens=24)


async def test_smollm2_packed_with_stage_1_killed_at_token_10_gives_the_tokens_of_an_undisturbed_run(
    cluster, smollm2
):
    opened = await cluster("smollm2", 3, precision="packed", build_timeout=120.0)
    undisturbed = await asyncio.wait_for(opened.runner.run(GREEDY), TIMEOUT_S)
    assert undisturbed.status == "ok" and len(undisturbed.tokens) == 24, undisturbed.error
    tokens = opened.bus.subscribe(accept=lambda e: isinstance(e, TokenGenerated) and e.index >= 10)
    running = asyncio.create_task(opened.runner.run(GREEDY))
    async with asyncio.timeout(TIMEOUT_S):
        assert await tokens.get() is not None
    tokens.close()
    os.kill(opened.pipeline.nodes[1].process.proc.pid, signal.SIGKILL)
    run = await asyncio.wait_for(running, TIMEOUT_S)
    assert run.status == "ok", run.error
    [recovery] = run.recoveries
    assert recovery.stage == 1 and recovery.replayed_positions >= len(undisturbed.tokens) // 2
    # Stage 1's new worker rebuilt its cache in one prefill where the old one had a prefill and one
    # decode step a token; this rests on the packed kernels computing a row alike in either (batch
    # invariance, as a prompt's logits do not depend on how it is cut): the tokens are compared
    # exactly, no tolerance.
    assert run.tokens == undisturbed.tokens
