"""The real Gemma 3 270M file through three worker processes: it completes the question with Paris, and its
greedy tokens are those of one in-process stage holding all 18 layers."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestServer

from coordinator.api import CLUSTER, create_app
from coordinator.cluster import ClusterConfig
from tests.conftest import worker_pids
from tests.coordinator.conftest import Api
from workers import models
from workers.models import ModelSpecError
from workers.protocol.report import LayerRange
from workers.stage import Stage

QUESTION = "Question: What is the capital of France?\nAnswer:"
# Plain completion prompts (the file has no chat template), greedy for this many tokens each.
PROMPTS = ("The capital of France is", "def fibonacci(n):")
STEPS = 16
N_LAYERS = 18
TIMEOUT_S = 60.0  # one request of 16 tokens on a busy 2-core machine
# The tests on the shared served cluster run in its event loop.
on_served = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def gemma3() -> Path:
    """The joined Gemma 3 file; the module is skipped, saying how to install it, when its package is not."""
    try:
        return models.gemma3_path()
    except ModelSpecError as exc:  # says the pip command that brings the package
        pytest.skip(str(exc))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(gemma3) -> AsyncIterator[Api]:
    """One `--model gemma3` cluster in 3 stages behind the HTTP app, shared by this file's tests."""
    server = TestServer(create_app(ClusterConfig("gemma3", 3, build_timeout=120.0)), host="127.0.0.1")
    await server.start_server()
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S))
    try:
        yield Api(server, session, server.app[CLUSTER])
    finally:
        await session.close()
        await server.close()
    assert worker_pids(os.getpid()) == [], "a worker outlived the served cluster"


@pytest.fixture(scope="module")
def one_stage(gemma3) -> Stage:
    """All 18 layers as one packed stage in this process, as `--stages 1` builds it."""
    return models.build("gemma3", LayerRange(0, N_LAYERS), "packed")


def greedy(stage: Stage, ids: list[int], steps: int, end_ids: frozenset[int], session: str) -> list[int]:
    """The prompt `ids` prefilled, then `steps` tokens decoded one at a time, each the argmax; an end
    token ends them as it ends a run."""
    x, pos, tokens = np.asarray(ids, np.int32), 0, []
    for _ in range(steps):
        logits = stage.forward(x, session=session, start_pos=pos, last_only=True)  # (1, vocab)
        pos += len(x)
        tokens.append(int(np.argmax(logits[-1])))
        if tokens[-1] in end_ids:
            break
        x = np.asarray(tokens[-1:], np.int32)
    stage.reset(session)
    return tokens


async def complete(api: Api, prompt: str, max_tokens: int) -> tuple[dict, dict]:
    """A greedy /v1/completions of `prompt`; the answer and its stored run."""
    body = {"model": "gemma3", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    status, answer, _ = await api.post("/v1/completions", json=body)
    assert status == 200, answer
    status, record, _ = await api.get(f"/runs/{answer['rlx']['run']}")
    assert status == 200 and record["status"] == "ok", record
    return answer, record


@on_served
async def test_a_text_completion_answers_the_question_with_paris(served):
    answer, record = await complete(served, QUESTION, 4)
    assert answer["object"] == "text_completion" and "Paris" in answer["choices"][0]["text"], answer
    assert [t["stage"] for t in record["timings"]] == [0, 1, 2]
    status, models_, _ = await served.get("/v1/models")
    assert status == 200 and models_["data"][0]["endpoints"] == ["completions"]  # no chat template


@on_served
async def test_three_stages_give_the_greedy_tokens_of_one_in_process_stage(served, one_stage):
    tokenizer = served.cluster.tokenizer
    assert tokenizer is not None
    ends = frozenset(tokenizer.end_ids)
    for i, prompt in enumerate(PROMPTS):
        ids = tokenizer.prompt_ids(prompt)
        assert ids[0] == tokenizer.bos_id  # the file asks for BOS first
        _, record = await complete(served, prompt, STEPS)
        assert record["seq"] == len(ids)
        expected = greedy(one_stage, ids, STEPS, ends, f"reference-{i}")
        assert record["tokens"] == expected, (prompt, tokenizer.decode(expected))
        assert len(expected) == STEPS  # no end token cut the comparison short
