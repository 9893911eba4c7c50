"""A generation ends at any token the model's file marks as an end: EOS, eot, eom, or a turn end by its text.

Real workers of a tiny llama, real HTTP: the same weights under vocabularies that mark a token the
model samples as an end in each way; the run ends there, `finish_reason` "stop".
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.coordinator.conftest import Api
from tests.support.tiny_gguf import TinyLlama
from tests.support.tiny_vocab import CONTROL, NORMAL, Vocab, write_vocab

TINY = TinyLlama(context_length=1024)
LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)]
PROMPT = "abc"  # "ab" and "c"
BUDGET = 8


def vocab(names: dict[int, str] | None = None, **keys) -> Vocab:
    """The tiny chat llama's vocabulary (letters, "ab", markers, EOS past the rows sampled), renamed."""
    words = [*LETTERS, "ab"]
    tokens = [*words, *(f"<unused{i}>" for i in range(TINY.vocab - len(words) - 1)), "<|eos|>"]
    types = [NORMAL] * len(words) + [CONTROL] * (len(tokens) - len(words))
    for i, name in (names or {}).items():
        tokens[i], types[i] = name, CONTROL
    return Vocab("gpt2", tokens, types, merges=["a b"], keys={"eos_token_id": len(tokens) - 1, **keys})


async def greedy(api: Api) -> dict:
    run = await api.finished(await api.submit({"prompt": PROMPT, "temperature": 0, "max_new_tokens": BUDGET}))
    assert run["status"] == "ok", run
    return run


@pytest.mark.parametrize(
    "marking",
    [
        lambda token: vocab({token: "<end_of_turn>"}),  # Gemma's end of turn, by its text
        lambda token: vocab({token: "<|eot_id|>"}),  # Llama 3's
        lambda token: vocab(eot_token_id=token),
        lambda token: vocab(eom_token_id=token),
        lambda token: vocab(eos_token_id=token),
    ],
    ids=["end_of_turn", "eot_id", "eot key", "eom key", "eos key"],
)
async def test_a_generation_stops_at_a_token_the_file_marks_as_an_end(api_factory, tmp_path: Path, marking):
    plain = await api_factory(str(write_vocab(tmp_path / "plain.gguf", vocab(), TINY)), 1)
    tokens = (await greedy(plain))["tokens"]
    assert len(tokens) == BUDGET  # no end: the budget is spent
    spelled = [0, 1, 2, len(LETTERS)]  # a, b, c and "ab": the prompt and its merge
    # The first token sampled after others that spells none of the prompt: renamed, the prompt is as it was.
    at = next(i for i, t in enumerate(tokens) if i > 0 and t not in tokens[:i] and t not in spelled)
    ending = await api_factory(str(write_vocab(tmp_path / "ending.gguf", marking(tokens[at]), TINY)), 1)
    run = await greedy(ending)
    assert run["finish_reason"] == "stop" and run["tokens"] == tokens[:at]
