"""SmolLM2 through real worker processes: bitwise equal to one process, and it says Paris."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestServer

from coordinator.api import CLUSTER, create_app
from coordinator.cluster import ClusterConfig
from coordinator.runs.requests import RunRequest
from coordinator.stages.chain import ForwardRequest
from tests.conftest import worker_pids
from tests.coordinator.conftest import Api
from workers import models
from workers.models.tokenizer import load_tokenizer
from workers.protocol.info import BatchItem
from workers.protocol.report import LayerRange

PROMPT = "The capital of France is"
DECODE_STEPS = 4
# The tests on the shared served cluster run in its event loop; they only add runs and sessions to it.
on_served = pytest.mark.asyncio(loop_scope="module")


def blas_threads() -> str:
    """OpenBLAS threads of this process (the variable if set, else one per core)."""
    return os.environ.get("OPENBLAS_NUM_THREADS") or str(len(os.sched_getaffinity(0)))


# Bitwise equality needs the same BLAS thread count as the in-process reference (its last bits depend on
# it), while the launcher gives each worker only cores // workers by default: the workers get ours.
@pytest.fixture
def reference_blas(monkeypatch) -> None:
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", blas_threads())


@pytest.fixture(scope="module")
def prompt_ids(smollm2) -> np.ndarray:
    return np.asarray(load_tokenizer(smollm2).encode(PROMPT), np.int32)


@pytest.fixture(scope="module")
def reference(smollm2_f32, prompt_ids) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens and every step's logits from one in-process stage holding all 30 blocks."""
    x, pos, tokens, logits = prompt_ids, 0, [], []
    for _ in range(DECODE_STEPS + 1):
        out = smollm2_f32.forward(x, session="pipeline-reference", start_pos=pos, last_only=True)
        logits.append(out)
        pos += len(x)
        tokens.append(int(np.argmax(out[-1])))
        x = np.asarray(tokens[-1:], np.int32)
    return tokens, logits


async def assert_bitwise_equal_to_one_process(pipeline, prompt_ids, reference, session: str) -> None:
    """Prefill the prompt, then decode the greedy tokens through `pipeline`; each step as in one process."""
    tokens, expected = reference
    x, pos = prompt_ids, 0
    for step in range(DECODE_STEPS + 1):
        out = await asyncio.wait_for(pipeline.forward(ForwardRequest(BatchItem(x, session, pos, True))), 60)
        assert out.tobytes() == expected[step].tobytes(), f"step {step} differs ({session})"
        pos += len(x)
        x = np.asarray([tokens[step]], np.int32)


# The tests with a pipeline of their own come first: their fixtures check that no worker of this
# process is left, which holds only before the shared served cluster starts.


# Five stages are a first, three middle and a last: the cuts of the three served stages below, more of them
# (make soak; test_llama's in-process split into four keeps two middles in make test).
@pytest.mark.soak
async def test_five_launched_stages_give_one_processs_logits_bitwise_for_prefill_and_every_decode_step(
    launch, prompt_ids, reference, reference_blas
):
    pipeline = await launch("smollm2", 5)
    await assert_bitwise_equal_to_one_process(pipeline, prompt_ids, reference, "five")


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda tmp: tmp / "missing.gguf", "missing.gguf"),
        (lambda tmp: _truncated(tmp), "truncated"),
        (lambda tmp: _gpt2(tmp), "architecture 'gpt2' is not supported"),
    ],
)
async def test_bad_gguf_is_a_clear_error_from_the_worker_shown_by_the_coordinator(tmp_path, make, says):
    from coordinator.launch.base import LaunchError
    from coordinator.launch.local import Launcher

    path = make(tmp_path)
    launcher = Launcher(str(path))
    with pytest.raises(LaunchError) as failed:
        await launcher.start(0, LayerRange(0, 1))
    assert says in str(failed.value) and "before reporting" in str(failed.value)


def _truncated(tmp):
    with open(models.smollm2_path(), "rb") as f:
        data = f.read(5_000_000)
    path = tmp / "truncated.gguf"
    path.write_bytes(data)
    return path


def _gpt2(tmp):
    import gguf

    path = tmp / "gpt2.gguf"
    w = gguf.GGUFWriter(path, arch="gpt2")
    w.add_block_count(2)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(smollm2) -> AsyncIterator[Api]:
    """One SmolLM2 cluster in 3 stages behind the HTTP app, shared by the tests below."""
    config = ClusterConfig("smollm2", 3, precision="f32", build_timeout=120.0)  # the f32 reference's
    server = TestServer(create_app(config), host="127.0.0.1")
    with pytest.MonkeyPatch.context() as env:  # the workers start with the app
        env.setenv("OPENBLAS_NUM_THREADS", blas_threads())
        await server.start_server()
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
    try:
        yield Api(server, session, server.app[CLUSTER])
    finally:
        await session.close()
        await server.close()
    assert worker_pids(os.getpid()) == [], "a worker outlived the served cluster"


@on_served
async def test_three_served_stages_give_one_processs_logits_bitwise_for_prefill_and_every_decode_step(
    served, prompt_ids, reference
):
    assert len(served.cluster.pipeline.nodes) == 3
    await assert_bitwise_equal_to_one_process(served.cluster.pipeline, prompt_ids, reference, "three")


@on_served
async def test_generation_run_through_three_workers_answers_paris(served):
    pieces: list[str] = []
    request = RunRequest(prompt=PROMPT, max_new_tokens=6)
    run = await asyncio.wait_for(served.cluster.runner.run(request, on_text=pieces.append), 120)
    assert run.status == "ok", run.error
    assert run.text.startswith(" Paris") and "".join(pieces) == run.text
    assert run.seq == 5 and len(run.tokens) == 6 and run.tokens[0] == 7042
    assert run.decode is not None and run.decode.seq == 5 and len(run.decode.timings) == 3
    assert [t.stage for t in run.timings] == [0, 1, 2]
    table = run.table()
    assert table.count("across 3 stages") == 2 and "decode: 5 tokens" in table


@on_served
async def test_http_prompt_run_shows_text_tokens_and_the_decode_table(served):
    status, body, _ = await served.post(
        "/runs", json={"prompt": "What is the capital of France?", "max_new_tokens": 12, "chat": True}
    )
    assert status == 202
    run = await served.finished(body["id"], 120)
    assert run["status"] == "ok", run["error"]
    assert "Paris" in run["text"] and run["prompt"] == "What is the capital of France?"
    assert (
        len(run["tokens"]) - 1 <= run["decode"]["seq"] <= len(run["tokens"])
    )  # + the step that produced EOS
    assert run["decode"]["tokens_per_s"] > 0 and len(run["decode"]["timings"]) == 3
    status, table, _ = await served.get(f"/runs/{body['id']}/table")
    assert table.index("decode:") > table.index("across 3 stages")
    status, err, _ = await served.post("/runs", json={"seq": 4})
    assert status == 400 and "takes a prompt" in err["error"]
