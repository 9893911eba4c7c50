"""The question a face asks when told none follows the model: a chat turn where the file has a chat template,
a text to complete where it has none (a base model, as Gemma 3 270M is). In process: no worker is started."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

from coordinator.cli.main import CHAT_PROMPT, COMPLETION_PROMPT, example_body, parse_args, run_request
from coordinator.cluster import model_tokenizer
from coordinator.runs.requests import RunRequest, encode_prompt
from tests.support.tiny_chat import write_tiny_chatml
from tests.support.tiny_gguf import TINY_ARCHS, write_tiny_arch
from workers.models import describe


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny gemma3 file: like Gemma 3 270M's, its tokenizer has no chat template."""
    path = tmp_path_factory.mktemp("gemma3") / "tiny-gemma3.gguf"
    write_tiny_arch(path, TINY_ARCHS["gemma3"])
    return str(path)


@pytest.fixture(scope="module")
def tiny_chatml(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("chatml") / "tiny-chatml.gguf"
    write_tiny_chatml(path, context_length=1024)
    return str(path)


def default_run(model: str, *args: str) -> RunRequest:
    """The run `rlx-cluster run --model MODEL ARGS` asks for, as _command decides it."""
    tokenizer = model_tokenizer(model)
    args = parse_args(["run", "--model", model, *args])
    return run_request(args, True, tokenizer.chat_template is not None)


def test_a_model_without_a_chat_template_is_given_the_question_to_complete_not_a_chat(tiny_gemma3):
    req = default_run(tiny_gemma3)
    assert (req.prompt, req.chat) == ("Question: What is the capital of France?\nAnswer:", False)
    assert req.stop == ["\n"]  # the answer's line, not the next question a base model asks itself
    assert req.prompt == COMPLETION_PROMPT
    assert encode_prompt(req, model_tokenizer(tiny_gemma3), describe(tiny_gemma3))  # the model takes it


def test_a_model_with_a_chat_template_is_asked_the_question_as_a_chat_turn(tiny_chatml):
    req = default_run(tiny_chatml)
    assert (req.prompt, req.chat, req.stop) == (CHAT_PROMPT, True, [])
    assert CHAT_PROMPT.startswith("What is the capital of France?")


def test_a_prompt_given_on_the_command_line_is_sent_as_given_whatever_the_model(tiny_gemma3, tiny_chatml):
    for model in (tiny_gemma3, tiny_chatml):
        req = default_run(model, "--prompt", "abc")
        assert (req.prompt, req.chat, req.stop) == ("abc", False, []), model
    assert default_run(tiny_chatml, "--prompt", "abc", "--chat").chat is True


def test_the_run_serve_suggests_posting_is_one_the_model_takes(tiny_gemma3, tiny_chatml):
    for model, chat in ((tiny_gemma3, False), (tiny_chatml, True)):
        tokenizer = model_tokenizer(model)
        body = example_body(SimpleNamespace(tokenizer=tokenizer))  # the cluster's tokenizer is all it reads
        req = msgspec.json.decode(body, type=RunRequest)
        assert req.chat is chat and req.prompt == (CHAT_PROMPT if chat else COMPLETION_PROMPT), body
        assert req.stop == ([] if chat else ["\n"]), body
        assert encode_prompt(req, tokenizer, describe(model))
    assert msgspec.json.decode(example_body(SimpleNamespace(tokenizer=None)), type=RunRequest).seq == 16
