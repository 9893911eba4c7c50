"""`--chat-template FILE`: a model whose file has no template chats only through one, and the command line
says so before any worker starts. Real coordinator processes."""

from __future__ import annotations

import asyncio

from tests.conftest import eventually, worker_pids

LETTERS_ONLY = "{% for m in messages %}{{ m.role }}{{ m.content }}{% endfor %}"


async def run(rlx_cluster, tiny_chat, *args: str):
    argv = [
        "run",
        "--model",
        str(tiny_chat),
        "--stages",
        "1",
        "--max-new-tokens",
        "2",
        "--db",
        ":memory:",
        *args,
    ]
    c = await asyncio.to_thread(rlx_cluster.launch, argv)
    await c.aio.exit_code(60)
    await eventually(lambda: worker_pids(c.pid) == [], 10, "the coordinator's workers to exit")
    return c


async def test_chat_with_a_model_without_a_template_is_a_cli_error_naming_the_option(rlx_cluster, tiny_chat):
    c = await run(rlx_cluster, tiny_chat, "--prompt", "abc", "--chat")
    assert await c.aio.exit_code(1) == 2, c.stderr
    assert "has no chat template" in c.stderr and "--chat-template FILE" in c.stderr and c.stdout == ""
    assert "launching" not in c.stderr  # before any worker


async def test_chat_through_a_template_named_on_the_command_line(rlx_cluster, tiny_chat, tmp_path):
    template = tmp_path / "letters.jinja"
    template.write_text(LETTERS_ONLY)
    # An even split: the layers' timing (the measured plan, a GGUF file's default) is not what this asks.
    argv = ["--prompt", "abc", "--chat", "--chat-template", str(template), "--plan", "even"]
    c = await run(rlx_cluster, tiny_chat, *argv)
    assert await c.aio.exit_code(1) == 0, c.stderr
    assert "prompt: abc" in c.stderr and "node " in c.stdout


async def test_without_a_template_the_default_prompt_goes_as_raw_text(rlx_cluster, tiny_chat):
    c = await run(rlx_cluster, tiny_chat, "--plan", "even")  # as above
    assert await c.aio.exit_code(1) == 0, c.stderr
    assert "prompt: Question: What is the capital of France?\nAnswer:" in c.stderr


async def test_a_template_file_that_cannot_be_read_or_parsed_is_a_cli_error_naming_it(
    rlx_cluster, tiny_chat, tmp_path
):
    missing = tmp_path / "missing.jinja"
    c = await run(rlx_cluster, tiny_chat, "--chat-template", str(missing))
    assert await c.aio.exit_code(1) == 2
    assert f"rlx-cluster: chat template {missing}: cannot read it (No such file or directory)" in c.stderr
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    c = await run(rlx_cluster, tiny_chat, "--chat-template", str(broken))
    assert await c.aio.exit_code(1) == 2
    assert f"{broken}: the chat template does not parse" in c.stderr and "launching" not in c.stderr
