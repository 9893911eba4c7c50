"""A long prompt goes through the stages in chunks: none outlasts the forward timeout, a cancel stops
it at the next chunk, and the tokens are those of one forward. Real workers, real HTTP."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import numpy as np
import pytest

from coordinator.events import StageForward
from coordinator.runs.generation import spans
from coordinator.runs.requests import RunRequest
from coordinator.runs.runner import Runner
from coordinator.stages.supervisor import attach_pipeline
from coordinator.store.history import RunStore
from tests.coordinator.conftest import Api
from tests.support.serving import served
from tests.support.slow_link import SlowLink
from tests.support.tiny_chat import LETTERS, write_tiny_chat
from workers.models.tokenizer import load_tokenizer

CONTEXT = 1024
# Bytes a second through the link to stage 0: a millisecond for each token id (4 bytes) it is sent.
RATE = 4000.0
FORWARD_TIMEOUT = 0.5
CHUNK = 100  # ~0.1 s through the link: well inside the timeout
LONG = 800  # tokens: ~0.8 s through the link at once, over the timeout


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny chat llama with a context of 1024 and a ChatML template."""
    path = tmp_path_factory.mktemp("tiny") / "tiny-chat.gguf"
    write_tiny_chat(path, context_length=CONTEXT, chat=True)
    return path


def letters(n: int, seed: int = 0) -> str:
    """n letters drawn at random, no "a" among them (so no "ab" is merged: a token each)."""
    return "".join(np.random.default_rng(seed).choice([c for c in LETTERS if c != "a"], n))


@asynccontextmanager
async def slow_first_stage(launch, model: Path, tmp_path: Path) -> AsyncIterator[Api]:
    """Two real stages, stage 0 behind a slow link, served with chunks of CHUNK positions."""
    launched = await launch(str(model), 2)
    addrs = [node.report.addr for node in launched.nodes]
    async with AsyncExitStack() as stack:
        link = await SlowLink.open(addrs[0], RATE)
        stack.push_async_callback(link.close)
        store = await RunStore.open(tmp_path / "runs.sqlite3")
        stack.push_async_callback(store.close)
        token = launched.supervisor.token
        attached = await attach_pipeline(launched.info, [link.addr, addrs[1]], token, FORWARD_TIMEOUT)
        stack.push_async_callback(attached.close)
        async with served(attached, store, tokenizer=load_tokenizer(model), prefill_chunk=CHUNK) as api:
            yield api


async def chat(api: Api, content: str) -> tuple[int, dict]:
    body = {"model": api.cluster.info.name, "messages": [{"role": "user", "content": content}],
            "max_tokens": 3, "temperature": 0}  # fmt: skip
    async with api.session.post(api.url("/v1/chat/completions"), json=body) as r:
        return r.status, await r.json()


async def test_a_prompt_too_long_for_one_forward_in_time_completes_in_chunks_and_the_stage_stays_up(
    launch, tiny_chat, tmp_path
):
    async with slow_first_stage(launch, tiny_chat, tmp_path) as api:
        status, answer = await chat(api, letters(LONG))
        assert status == 200, answer
        assert answer["choices"][0]["finish_reason"] == "length"
        run = await api.cluster.store.get(answer["rlx"]["run"])
        assert run is not None and run.status == "ok"
        assert run.seq == answer["usage"]["prompt_tokens"] > LONG  # the letters, the template's markers
        prefill = [s for s in run.steps if s.step == 0]
        # 9 chunks of at most 100 positions, each a forward, together the whole prompt.
        assert [s.positions for s in prefill] == [b - a for a, b in spans(run.seq, CHUNK)]
        assert len(prefill) == 9 and sum(s.positions for s in prefill) == run.seq
        assert max(max(s.forward_ms) for s in prefill) < FORWARD_TIMEOUT * 1000
        # The prefill's figures are the whole prompt's: each stage's forwards summed over the chunks.
        assert [t.stage for t in run.timings] == [0, 1]
        summed = [sum(s.forward_ms[i] for s in prefill) for i in range(2)]
        assert [t.forward_ms for t in run.timings] == pytest.approx(summed)
        assert run.timings[0].forward_ms > LONG * 4 / RATE * 1000  # the link's time, every byte of it
        _, nodes, _ = await api.get("/nodes")
        assert [(n["state"], n["error"]) for n in nodes["nodes"]] == [("up", None), ("up", None)]
        status, again = await chat(api, letters(20, seed=1))
        assert status == 200 and again["choices"][0]["finish_reason"] == "length", again


async def test_a_cancel_during_a_long_prompt_stops_it_at_the_next_chunk(launch, tiny_chat, tmp_path):
    async with slow_first_stage(launch, tiny_chat, tmp_path) as api:
        sub = api.cluster.bus.subscribe(accept=lambda e: isinstance(e, StageForward))
        run_id = await api.submit({"prompt": letters(LONG), "max_new_tokens": 3})
        async with asyncio.timeout(10):
            while (await sub.get()).run != run_id:
                pass
        async with api.session.delete(api.url(f"/runs/{run_id}")) as r:
            assert r.status == 200
        assert (await api.finished(run_id))["status"] == "cancelled"
        run = await api.cluster.store.get(run_id)
        assert run is not None and run.tokens == [] and run.finish_reason == "cancelled"
        # Told as chunk 1's first stage replied: chunk 2, sent by then at the latest, is the last.
        assert 1 <= len(run.steps) <= 2 and all(s.step == 0 for s in run.steps)
        _, nodes, _ = await api.get("/nodes?live=1")
        assert [n["live"]["sessions"] for n in nodes["nodes"]] == [0, 0]
        again = await api.submit({"prompt": "cde", "max_new_tokens": 2})
        assert (await api.finished(again))["status"] == "ok"


async def test_a_prompt_in_chunks_gives_the_tokens_of_the_prompt_in_one_forward(launch, tiny_chat, tmp_path):
    pipeline = await launch(str(tiny_chat), 2)
    tokenizer = load_tokenizer(tiny_chat)
    request = RunRequest(prompt=letters(600, seed=2), max_new_tokens=16)
    runs = {}
    for chunk in (CONTEXT, 64, 7):
        store = await RunStore.open(tmp_path / f"runs-{chunk}.sqlite3")
        runner = Runner(pipeline, store, tokenizer, prefill_chunk=chunk)
        await runner.start()
        try:
            runs[chunk] = await asyncio.wait_for(runner.run(request), 30)
        finally:
            await runner.close()
            await store.close()
    whole = runs[CONTEXT]
    assert [len([s for s in run.steps if s.step == 0]) for run in runs.values()] == [1, 10, 86]
    assert whole.status == "ok" and len(whole.tokens) == 16
    for run in runs.values():
        assert (run.status, run.tokens, run.text) == ("ok", whole.tokens, whole.text)
