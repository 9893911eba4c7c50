"""The worker's thread rule: how many kernel threads a stage's decode steps are measured fastest on."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from coordinator.launch.local import Launcher
from coordinator.stages.client import WorkerClient
from tests.conftest import worker_pids
from tests.support.tiny_gguf import TinyLlama, write_tiny_llama
from workers.protocol.info import BatchItem
from workers.protocol.report import LayerRange
from workers.threads import DECODE_ROWS, ThreadChoice, on_own_thread, rule_from_env

Cost = Callable[[int, int], float]  # (threads, rows) -> ms of one forward


def serve(choice: ThreadChoice, steps: int, cost: Cost, rows: int = 1) -> list[int]:
    """Time `steps` forwards of `rows` rows at `cost`; the thread count each ran on."""
    used = []
    for _ in range(steps):
        n = choice.threads()
        used.append(n)
        choice.timed(rows, cost(n, rows))
    return used


def idle(n: int, rows: int) -> float:
    """Free cores: 2 threads 1.38x faster than 1, as SmolLM2's decode measured in one process."""
    return 11.0 * rows / (1.38 if n >= 2 else 1.0)


def busy(n: int, rows: int) -> float:
    """Other processes on the cores: every product of 2 threads waits for both to be scheduled."""
    return 12.0 * rows * (3.0 if n >= 2 else 1.0)


def test_on_busy_cores_a_stage_settles_on_one_thread():
    choice = ThreadChoice(2)
    used = serve(choice, 200, busy)
    assert choice.current == 1
    assert used[-100:].count(2) <= choice.probe  # one try of 2 threads in the last hundred steps at most


def test_a_stage_starts_on_one_thread_and_a_much_slower_try_ends_at_its_first_step():
    choice = ThreadChoice(2)
    used = serve(choice, choice.first + 1, busy)
    assert used == [1] * choice.first + [2]  # the try of 2 threads took 3x as long: back to 1 at once
    assert choice.threads() == 1 and choice.interval == 2 * choice.first


def test_on_free_cores_a_stage_keeps_its_threads_and_tries_fewer_ever_less_often():
    choice = ThreadChoice(2)
    used = serve(choice, 2000, idle)
    assert choice.current == 2
    # Tries after 8, 16, 32 … steps up to 512: about ten of `probe` steps in 2,000.
    assert used.count(1) <= 12 * choice.probe
    assert choice.interval == choice.longest


def test_a_stage_goes_back_to_more_threads_once_the_cores_are_free_again():
    choice = ThreadChoice(2, longest=64)
    serve(choice, 200, busy)
    assert choice.current == 1
    used = serve(choice, 200, idle)
    assert choice.current == 2
    assert used[-64:].count(1) <= choice.probe


def test_batched_steps_are_compared_with_steps_of_as_many_rows():
    # Steps of 1 and of 8 rows alternate on free cores: a try's 1-row steps on 1 thread are faster
    # than the 8-row steps on 2 it would meet in a median of every size, and must not win by that.
    choice = ThreadChoice(2)
    used = []
    for _ in range(400):
        used += serve(choice, 1, idle, rows=1) + serve(choice, 1, idle, rows=8)
    assert choice.current == 2
    assert used.count(1) <= 12 * choice.probe


def test_prompts_are_not_measured_and_leave_the_count_as_it_is():
    choice = ThreadChoice(2)
    used = serve(choice, 100, busy, rows=DECODE_ROWS + 1)
    assert set(used) == {1} and choice.tries == 0  # where it started


def test_with_four_cores_a_stage_finds_the_count_between_by_halving_and_doubling():
    def cost(n: int, rows: int) -> float:  # 2 threads best: 4 wait on cores others hold
        return {1: 12.0, 2: 8.0, 4: 20.0}[n] * rows

    choice = ThreadChoice(4)
    serve(choice, 400, cost)
    assert choice.current == 2


def test_one_thread_at_most_is_never_tried_otherwise():
    choice = ThreadChoice(1)
    assert set(serve(choice, 100, busy)) == {1} and choice.tries == 0


def test_a_thread_choice_refuses_counts_below_one():
    with pytest.raises(ValueError, match="most, probe, first >= 1"):
        ThreadChoice(0)


def test_rlx_threads_fixes_the_count_unless_the_rule_says_measure(monkeypatch):
    monkeypatch.delenv("RLX_THREAD_RULE", raising=False)
    monkeypatch.delenv("RLX_THREADS", raising=False)
    assert rule_from_env() == "measured"
    monkeypatch.setenv("RLX_THREADS", "2")
    assert rule_from_env() == "fixed"
    monkeypatch.setenv("RLX_THREAD_RULE", "measured")  # as a launcher says for the share it gives
    assert rule_from_env() == "measured"
    monkeypatch.setenv("RLX_THREAD_RULE", "fast")
    with pytest.raises(ValueError, match="RLX_THREAD_RULE must be one of measured, fixed, got 'fast'"):
        rule_from_env()


def test_a_call_on_its_own_thread_returns_its_result_and_raises_its_error():
    assert on_own_thread(lambda: 42) == 42
    with pytest.raises(ZeroDivisionError):
        on_own_thread(lambda: 1 / 0)


# Matrices of 256 x 512 Q4_1 (82 KB) split between 2 threads, as a real model's do (CHUNK_MIN_BYTES).
SPLIT = TinyLlama(n_layers=2, hidden=256, n_heads=4, n_kv_heads=2, ffn=512, context_length=64)


async def threads_after_decode(path: Path, threads: int) -> int:
    """Threads of a worker serving `path` on `threads` kernel threads after a few decode steps."""
    env = {"RLX_THREADS": str(threads), "RLX_THREAD_RULE": "fixed"}
    launcher = Launcher(str(path), precision="packed", extra_env=env)
    try:
        w = await launcher.start(0, LayerRange(0, SPLIT.n_layers))
        client = await WorkerClient.connect(w.report.addr, launcher.token)
        try:
            for pos in range(8):
                item = BatchItem(np.array([1], np.int32), "decode", pos, last_only=True)
                await asyncio.to_thread(client.forward_now, item, timeout=30)
            return len(os.listdir(f"/proc/{w.pid}/task"))
        finally:
            await client.close()
    finally:
        await launcher.stop_all()


async def test_a_served_packed_stage_on_two_threads_keeps_one_pool_of_kernel_threads(tmp_path):
    # libgomp keeps a pool for each thread that starts parallel work; with two (the build's and the
    # server's) it counts more threads than cores and makes every product's threads sleep in between.
    path = tmp_path / "split.gguf"
    write_tiny_llama(path, SPLIT, blocks=True)
    one, two = [await threads_after_decode(path, n) for n in (1, 2)]
    assert two - one == 1, f"{two - one} kernel threads beside the serving thread's own, not 1"
    assert worker_pids(os.getpid()) == []
