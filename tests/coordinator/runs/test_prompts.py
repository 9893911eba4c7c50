"""A prompt the model cannot take is the caller's error, refused when submitted: HTTP 400, CLI exit 2."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from coordinator.runs.requests import RunRequest, encode_prompt
from tests.conftest import eventually, worker_pids
from tests.support.tiny_gguf import TinyLlama, write_tiny_tokenized
from tests.support.tiny_vocab import tiny_spm, write_vocab
from workers.models.tokenizer import load_tokenizer
from workers.protocol.info import ModelInfo

TINY = TinyLlama()  # 32 positions of context
LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)]
SPECIAL = ["<|im_start|>", "<|im_end|>"]
EOS = len(LETTERS) + 3  # <|im_end|>, after the letters, "ab", "Ġ" (space) and "Ċ" (newline)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

BAD_PROMPTS = [
    ({"prompt": "!?!"}, "the prompt encodes to no tokens"),
    ({"prompt": "a" * 40}, "the prompt is 40 tokens; the model's context holds 32"),
    ({"prompt": "a" * 14, "chat": True}, "the prompt is 33 tokens; the model's context holds 32"),
]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama GGUF whose vocabulary holds only lowercase letters, space, newline and ChatML markers."""
    path = tmp_path_factory.mktemp("tiny") / "tiny-chat.gguf"
    tokens = [*LETTERS, "ab", "Ġ", "Ċ", *SPECIAL]
    tokens += [f"<unused{i}>" for i in range(TINY.vocab - len(tokens))]
    write_tiny_tokenized(
        path, TINY, tokens, n_normal=len(LETTERS) + 3, eos_id=EOS, chat_template=CHAT_TEMPLATE
    )
    return path


@pytest.mark.parametrize(("body", "says"), BAD_PROMPTS)
async def test_a_prompt_the_model_cannot_take_is_400_and_stores_nothing(api_factory, tiny_model, body, says):
    api = await api_factory(str(tiny_model), 2)
    status, err, _ = await api.post("/runs", json={**body, "max_new_tokens": 2})
    assert status == 400 and says in err["error"]
    assert (await api.get("/runs"))[1]["runs"] == []
    status, ok, _ = await api.post("/runs", json={"prompt": "abc", "max_new_tokens": 2})
    assert status == 202 and (await api.finished(ok["id"]))["status"] == "ok"


@pytest.mark.parametrize(("body", "says"), BAD_PROMPTS)
async def test_a_prompt_the_model_cannot_take_is_a_cli_error_with_exit_status_2(
    rlx_cluster, tiny_model, body, says
):
    chat = ["--chat"] if body.get("chat") else []
    argv = ["run", "--model", str(tiny_model), "--stages", "1", "--prompt", body["prompt"], *chat]
    c = rlx_cluster.launch([*argv, "--db", ":memory:"])
    assert await c.aio.exit_code(60) == 2, c.stderr
    assert f"rlx-cluster: {says}" in c.stderr and c.stdout == ""
    assert "measuring" not in c.stderr and "launching" not in c.stderr  # before any timing or worker
    await eventually(lambda: worker_pids(c.pid) == [], 10, "the coordinator's workers to exit")


async def test_each_run_tells_only_its_own_text_callback_the_pieces_it_generates(cluster, tiny_model):
    opened = await cluster(str(tiny_model), 2)
    pieces: list[str] = []
    request = RunRequest(prompt="abc", max_new_tokens=5)
    run = await asyncio.wait_for(opened.runner.run(request, on_text=pieces.append), 30)
    assert run.status == "ok" and run.tokens and "".join(pieces) == run.text
    told = list(pieces)
    again = await asyncio.wait_for(opened.runner.run(request), 30)
    assert again.tokens == run.tokens and pieces == told


def test_a_prompt_is_encoded_with_bos_first_when_the_models_file_asks_for_it(tmp_path):
    info = ModelInfo(name="spm", n_layers=1, input="tokens", hidden=4, vocab=300, context_length=64)
    for add_bos in (True, False):
        path = write_vocab(tmp_path / f"spm-{add_bos}.gguf", tiny_spm({"▁ab": -1.0}, add_bos_token=add_bos))
        tok = load_tokenizer(path)
        ids = encode_prompt(RunRequest(prompt="ab"), tok, info)
        assert ids == ([1] if add_bos else []) + tok.encode("ab")  # <s> is 1
