"""The GGUF byte-level BPE tokenizer: SmolLM2's ids, round trips, streaming."""

from __future__ import annotations

import pytest

from workers import models
from workers.models.tokenizer import load_tokenizer

ROUND_TRIPS = [
    "Hello, world! How are you today?",
    "café, naïve, façade, Ünïcödé, señor",
    "emoji 😀👍🏽🇫🇷 and 日本語のテキスト",
    "def f(x):\n    return {'a': x**2}  # ok\n\tpass\n",
    "  leading, trailing and   inner  spaces  ",
    "digits 2024 and 3.14159",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n",
]


@pytest.fixture(scope="module")
def tok():
    try:
        path = models.smollm2_path()
    except models.ModelSpecError as exc:
        pytest.skip(str(exc))
    return load_tokenizer(path)


def test_the_capital_of_france_encodes_to_smollm2s_ids(tok):
    assert tok.encode("The capital of France is") == [504, 3575, 282, 4649, 314]


def test_paris_and_the_end_token(tok):
    assert tok.decode([7042]) == " Paris"
    assert tok.eos_id == 2
    assert tok.decode([tok.eos_id]) == "<|im_end|>"


def test_each_digit_is_a_token_of_its_own(tok):
    assert [tok.decode([i]) for i in tok.encode("2024")] == ["2", "0", "2", "4"]


def test_special_tokens_are_matched_whole(tok):
    assert tok.encode("<|im_start|>user") == [1, tok.encode("user")[0]]


@pytest.mark.parametrize("text", ROUND_TRIPS)
def test_text_round_trips_through_ids(tok, text):
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("text", ROUND_TRIPS)
def test_streaming_the_ids_gives_the_same_text(tok, text):
    stream = tok.stream()
    pieces = [stream.push(i) for i in tok.encode(text)]
    assert "".join(pieces) + stream.flush() == text
    assert not any("\ufffd" in p for p in pieces)


def test_a_character_split_across_tokens_comes_out_whole(tok):
    ids = tok.encode("😀")
    assert len(ids) > 1  # four UTF-8 bytes, more than one token
    stream = tok.stream()
    assert [stream.push(i) for i in ids] == [""] * (len(ids) - 1) + ["😀"]


def test_an_unfinished_character_is_flushed_as_a_replacement(tok):
    stream = tok.stream()
    assert stream.push(tok.encode("😀")[0]) == ""
    assert stream.flush() == "\ufffd"


def test_chat_wraps_the_prompt_as_a_user_turn_after_the_default_system_turn(tok):
    text = tok.chat("Hi there")
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant")
    assert text.endswith("<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert tok.encode(text).count(tok.encode("<|im_start|>")[0]) == 3


def test_chat_without_a_chatml_template_is_a_clear_error(tok):
    import copy

    plain = copy.copy(tok)
    plain.chat_template = None
    with pytest.raises(ValueError, match="no ChatML chat template"):
        plain.chat("Hi")
