"""SmolLM2 through real worker processes: bitwise equal to one process, and it says Paris."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from coordinator.requests import RunRequest
from workers import models
from workers.models.tokenizer import load_tokenizer
from workers.report import LayerRange

PROMPT = "The capital of France is"
DECODE_STEPS = 4


@pytest.fixture(scope="module")
def reference(smollm2) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens and every step's logits from one in-process stage holding all 30 blocks."""
    stage = models.build("smollm2", LayerRange(0, 30), "f32")
    x = np.asarray(load_tokenizer(smollm2).encode(PROMPT), np.int32)
    pos, tokens, logits = 0, [], []
    for _ in range(DECODE_STEPS + 1):
        out = stage.forward(x, session="ref", start_pos=pos, last_only=True)
        logits.append(out)
        pos += len(x)
        tokens.append(int(np.argmax(out[-1])))
        x = np.asarray(tokens[-1:], np.int32)
    return tokens, logits


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 5])
async def test_pipeline_logits_equal_one_process_bitwise_for_prefill_and_every_decode_step(
    launch, reference, stages
):
    tokens, expected = reference
    pipeline = await launch("smollm2", stages)
    x = np.asarray(load_tokenizer(models.smollm2_path()).encode(PROMPT), np.int32)
    pos = 0
    for step in range(DECODE_STEPS + 1):
        out = await asyncio.wait_for(pipeline.forward(x, session="p", start_pos=pos, last_only=True), 60)
        assert out.tobytes() == expected[step].tobytes(), f"step {step} differs with {stages} stages"
        pos += len(x)
        x = np.asarray([tokens[step]], np.int32)


async def test_generation_run_through_three_workers_answers_paris(cluster):
    opened = await cluster("smollm2", 3)
    pieces: list[str] = []
    request = RunRequest(prompt=PROMPT, max_new_tokens=6)
    run = await asyncio.wait_for(opened.runner.run(request, on_text=pieces.append), 120)
    assert run.status == "ok", run.error
    assert run.text.startswith(" Paris") and "".join(pieces) == run.text
    assert run.seq == 5 and len(run.tokens) == 6 and run.tokens[0] == 7042
    assert run.decode is not None and run.decode.seq == 5 and len(run.decode.timings) == 3
    assert [t.stage for t in run.timings] == [0, 1, 2]
    table = run.table()
    assert table.count("across 3 stages") == 2 and "decode: 5 tokens" in table


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda tmp: tmp / "missing.gguf", "missing.gguf"),
        (lambda tmp: _truncated(tmp), "truncated"),
        (lambda tmp: _gpt2(tmp), "architecture 'gpt2' is not supported"),
    ],
)
async def test_bad_gguf_is_a_clear_error_from_the_worker_shown_by_the_coordinator(tmp_path, make, says):
    from coordinator.launcher import Launcher, LaunchError

    path = make(tmp_path)
    launcher = Launcher(str(path))
    with pytest.raises(LaunchError) as failed:
        await launcher.start(0, LayerRange(0, 1))
    assert says in str(failed.value) and "before reporting" in str(failed.value)


def _truncated(tmp):
    data = models.smollm2_path().read_bytes()[:5_000_000]
    path = tmp / "truncated.gguf"
    path.write_bytes(data)
    return path


async def test_http_prompt_run_shows_text_tokens_and_the_decode_table(api_factory):
    api = await api_factory("smollm2", 3, build_timeout=120)
    status, body, _ = await api.post(
        "/runs", json={"prompt": "What is the capital of France?", "max_new_tokens": 12, "chat": True}
    )
    assert status == 202
    run = await api.finished(body["id"], 120)
    assert run["status"] == "ok", run["error"]
    assert "Paris" in run["text"] and run["prompt"] == "What is the capital of France?"
    assert (
        len(run["tokens"]) - 1 <= run["decode"]["seq"] <= len(run["tokens"])
    )  # + the step that produced EOS
    assert run["decode"]["tokens_per_s"] > 0 and len(run["decode"]["timings"]) == 3
    status, table, _ = await api.get(f"/runs/{body['id']}/table")
    assert table.index("decode:") > table.index("across 3 stages")
    status, err, _ = await api.post("/runs", json={"seq": 4})
    assert status == 400 and "takes a prompt" in err["error"]


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
