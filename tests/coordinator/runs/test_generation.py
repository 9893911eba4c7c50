"""Generation on its own: steps through a forwarder whose model compute is a script, a real tokenizer."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from coordinator.events import EventBus
from coordinator.runs.generation import Sampling, generate
from coordinator.runs.recorder import Recorder, RunCancelled
from coordinator.stages.chain import ForwardRequest
from coordinator.stats import ClusterRun, StageTiming
from workers.models.tokenizer import CONTROL, Tokenizer
from workers.protocol.info import ModelInfo
from workers.protocol.report import LayerRange

LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)]
EOS = len(LETTERS)
PROMPT = [0, 1, 2]  # "abc"


def ids(text: str) -> list[int]:
    return [LETTERS.index(c) for c in text]


def tokenizer() -> Tokenizer:
    """Lowercase letters, one token each, and an end-of-sequence marker."""
    tokens = [*LETTERS, "<|eos|>"]
    return Tokenizer(tokens, [], [1] * len(LETTERS) + [CONTROL], pre="default", eos_id=EOS)


class Scripted:
    """Two stages whose logits pick the next token of `script`, told and halted as a pipeline would."""

    def __init__(self, script: list[int], context_length: int = 64, seed: int | None = None) -> None:
        self.info = ModelInfo(
            name="scripted",
            n_layers=2,
            input="tokens",
            hidden=4,
            vocab=EOS + 1,
            context_length=context_length,
        )
        self.script = list(script)
        self.rng = None if seed is None else np.random.default_rng(seed)
        self.requests: list[ForwardRequest] = []

    async def forward(self, request: ForwardRequest) -> np.ndarray:
        self.requests.append(request)
        for stage in range(2):
            request.halt()
            await asyncio.sleep(0)
            request.on_stage(timing(stage))
        if self.rng is not None:
            return self.rng.standard_normal((1, EOS + 1)).astype(np.float32)
        logits = np.zeros((1, EOS + 1), np.float32)
        logits[0, self.script.pop(0) if self.script else EOS] = 1.0
        return logits


def timing(stage: int) -> StageTiming:
    return StageTiming(
        addr=f"stub:{stage}", layers=LayerRange(stage, stage + 1), device="cpu", build_ms=0.0,
        forward_ms=4.0 + stage, resident_bytes=0, compute_ms=3.0, stage=stage,
    )  # fmt: skip


def new_run() -> tuple[ClusterRun, Recorder]:
    run = ClusterRun(timings=[], total_forward_ms=0.0, output=[], id=1, status="running")
    recorder = Recorder(run, EventBus())
    recorder.start()
    return run, recorder


async def run_generation(model: Scripted, sampling: Sampling, on_text=None) -> tuple[ClusterRun, Recorder]:
    run, recorder = new_run()
    await asyncio.wait_for(
        generate(model, tokenizer(), run, PROMPT, sampling, "run-1", recorder, on_text), 10
    )
    return run, recorder


async def generate_chunked(model: Scripted, prompt: list[int], chunk: int) -> tuple[ClusterRun, Recorder]:
    run, recorder = new_run()
    await generate(model, tokenizer(), run, prompt, Sampling(10), "run-1", recorder, chunk=chunk)
    return run, recorder


async def test_the_prompt_is_one_forward_then_each_token_is_forwarded_at_the_next_position():
    model = Scripted(ids("hi"))  # then the end of sequence
    pieces: list[str] = []
    run, _ = await run_generation(model, Sampling(max_new_tokens=10), pieces.append)
    assert run.tokens == ids("hi") and run.text == "hi" and pieces == ["h", "i"]
    sent = [(r.item.x.tolist(), r.item.session, r.item.start_pos, r.item.last_only) for r in model.requests]
    assert sent == [(PROMPT, "run-1", 0, True), (ids("h"), "run-1", 3, True), (ids("i"), "run-1", 4, True)]
    assert all(r.item.x.dtype == np.int32 for r in model.requests)


async def test_the_prompt_is_timed_into_the_run_and_the_decode_steps_summed_per_stage_into_its_decode():
    run, _ = await run_generation(Scripted(ids("hey")), Sampling(max_new_tokens=10))
    assert [(t.stage, t.forward_ms) for t in run.timings] == [(0, 4.0), (1, 5.0)]
    assert run.seq == len(PROMPT)
    decode = run.decode
    assert decode is not None and decode.status == "ok"
    assert decode.seq == 3  # the forwards of "h", "e" and "y": the last gave the end of sequence
    assert [(t.stage, t.forward_ms, t.compute_ms) for t in decode.timings] == [(0, 12.0, 9.0), (1, 15.0, 9.0)]
    assert decode.total_forward_ms > 0 and run.total_forward_ms > 0


async def test_every_forward_is_a_step_of_the_runs_record():
    run, _ = await run_generation(Scripted(ids("ok")), Sampling(max_new_tokens=10))
    assert [(s.step, s.positions) for s in run.steps] == [(0, 3), (1, 1), (2, 1)]
    assert all(s.forward_ms == [4.0, 5.0] for s in run.steps)


async def test_a_long_prompt_goes_in_even_chunks_each_where_the_last_ended_and_only_the_last_is_read():
    prompt = ids("abcdefghij")
    model = Scripted(ids("xy") + ids("hi"))  # the first two chunks' logits are not read: no "x", no "y"
    run, _ = await asyncio.wait_for(generate_chunked(model, prompt, chunk=4), 10)
    assert run.tokens == ids("hi") and run.text == "hi"
    sent = [(r.item.x.tolist(), r.item.start_pos, r.item.last_only) for r in model.requests]
    assert sent == [
        (prompt[0:3], 0, True), (prompt[3:6], 3, True), (prompt[6:10], 6, True),  # 10 as 3 + 3 + 4
        (ids("h"), 10, True), (ids("i"), 11, True),
    ]  # fmt: skip
    # Each chunk is a forward of the prompt's step; the prompt's figures are its chunks' together.
    assert [(s.step, s.positions) for s in run.steps] == [(0, 3), (0, 3), (0, 4), (1, 1), (2, 1)]
    assert run.seq == 10 and [(t.stage, t.forward_ms, t.compute_ms) for t in run.timings] == [
        (0, 12.0, 9.0), (1, 15.0, 9.0),
    ]  # fmt: skip
    assert run.decode is not None and run.decode.seq == 2


async def test_a_cancel_during_a_chunked_prompt_stops_it_before_the_next_chunk_reaches_a_stage():
    model = Scripted(ids("abc"))
    run, recorder = new_run()
    forward = model.forward

    async def cancel_in_chunk_two(request: ForwardRequest) -> np.ndarray:
        if len(model.requests) == 1:  # the first chunk is through: a cancel comes as the second is sent
            recorder.cancelled = True
        return await forward(request)

    model.forward = cancel_in_chunk_two
    with pytest.raises(RunCancelled):
        await asyncio.wait_for(
            generate(model, tokenizer(), run, ids("abcdefghij"), Sampling(10), "run-1", recorder, chunk=4), 10
        )
    assert len(model.requests) == 2 and run.tokens == [] and run.finish_reason == "cancelled"
    assert [len(s.forward_ms) for s in run.steps] == [2, 0]  # the second chunk reached no stage


async def test_generation_stops_at_the_token_budget():
    model = Scripted(ids("abcdefgh"))
    run, _ = await run_generation(model, Sampling(max_new_tokens=3))
    assert run.tokens == ids("abc") and run.text == "abc"
    assert len(model.requests) == 3  # the third token came from the second decode step's forward


async def test_generation_stops_where_the_context_is_full():
    model = Scripted(ids("abcdefgh"), context_length=len(PROMPT) + 2)
    run, _ = await run_generation(model, Sampling(max_new_tokens=10))
    assert run.tokens == ids("ab")


async def test_a_stop_string_ends_the_text_before_it_and_the_generation_there():
    model = Scripted(ids("abstxyz"))
    run, _ = await run_generation(model, Sampling(max_new_tokens=10, stop=("zz", "st")))
    assert run.text == "ab" and run.tokens == ids("abst")
    assert len(model.requests) == 4  # nothing is forwarded after the token that completed the stop


async def test_a_cancel_between_steps_stops_the_run_before_its_next_forward():
    model = Scripted(ids("abcdef"))
    run, recorder = new_run()

    def cancel_after_two(piece: str) -> None:
        if len(run.tokens) == 2:
            recorder.cancelled = True

    with pytest.raises(RunCancelled):
        await asyncio.wait_for(
            generate(model, tokenizer(), run, PROMPT, Sampling(10), "run-1", recorder, cancel_after_two), 10
        )
    assert run.tokens == ids("ab") and len(model.requests) == 2


async def test_a_sampled_generation_is_the_same_for_the_same_seed_and_differs_for_another():
    async def tokens(seed: int) -> list[int]:
        run, _ = await run_generation(
            Scripted([], seed=99), Sampling(8, temperature=0.8, top_k=10, seed=seed)
        )
        return run.tokens

    first = await tokens(1)
    assert first == await tokens(1)
    assert first != await tokens(2)


class ByPosition(Scripted):
    """Logits that depend only on the position they are for, as a real model's do on its input."""

    async def forward(self, request: ForwardRequest) -> np.ndarray:
        self.requests.append(request)
        end = request.item.start_pos + len(request.item.x)
        logits = np.random.default_rng(end).standard_normal((1, EOS + 1)).astype(np.float32)
        logits[0, EOS] = -np.inf  # never the end: every generation runs its budget out
        return logits


async def test_a_sampled_token_depends_on_its_position_not_on_how_many_draws_came_before():
    sampling = Sampling(8, temperature=1.5, seed=5)
    whole, _ = await run_generation(ByPosition([]), sampling)
    assert len(whole.tokens) == 8
    # Taken up again from its first 4 tokens (a step tried again after its stage was rebuilt draws
    # as this does: afresh), the generation draws the same last 4.
    run, recorder = new_run()
    prompt = PROMPT + whole.tokens[:4]
    again = Sampling(4, temperature=1.5, seed=5)
    await asyncio.wait_for(generate(ByPosition([]), tokenizer(), run, prompt, again, "run-1", recorder), 10)
    assert run.tokens == whole.tokens[4:]
