"""Chat needs a template: a model whose file has none is refused chat over HTTP (400, naming what is
missing and the option) until the cluster's config names one. Real workers, real HTTP."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.cluster import ClusterConfig, open_cluster

MESSAGES = [{"role": "user", "content": "abc"}]
# A template the tiny vocabulary can spell: letters only.
LETTERS_ONLY = "{% for m in messages %}{{ m.role }}{{ m.content }}{% endfor %}"


def said_what_is_missing(message: str) -> bool:
    return "has no chat template" in message and "--chat-template FILE" in message


async def test_a_chat_to_a_model_without_a_template_is_400_naming_what_is_missing_and_the_option(
    api_factory, tiny_chat
):
    api = await api_factory(str(tiny_chat), 1)
    for body in ({"messages": MESSAGES}, {"prompt": "abc", "chat": True}):
        status, err, _ = await api.post("/runs", json={**body, "max_new_tokens": 2})
        assert status == 400 and said_what_is_missing(err["error"]), (body, err)
    status, err, _ = await api.post(
        "/v1/chat/completions", json={"model": api.cluster.info.name, "messages": MESSAGES, "max_tokens": 2}
    )
    assert status == 400 and said_what_is_missing(err["error"]["message"]), err
    assert "POST /v1/completions" in err["error"]["message"]  # where such a model's text goes
    assert (await api.get("/runs"))[1]["runs"] == []  # refused when submitted: nothing stored
    status, ok, _ = await api.post("/runs", json={"prompt": "abc", "max_new_tokens": 2})
    assert status == 202 and (await api.finished(ok["id"]))["status"] == "ok"  # a raw prompt still runs


async def test_a_template_named_in_the_config_lets_a_model_without_one_chat(api_factory, tiny_chat, tmp_path):
    template = tmp_path / "letters.jinja"
    template.write_text(LETTERS_ONLY)
    api = await api_factory(str(tiny_chat), 1, chat_template=str(template))
    assert api.cluster.tokenizer.chat("abc") == "userabc"
    run = await api.finished(await api.submit({"messages": MESSAGES, "max_new_tokens": 2}))
    assert run["status"] == "ok" and run["seq"] == len(api.cluster.tokenizer.encode("userabc"))
    status, answer, _ = await api.post(
        "/v1/chat/completions", json={"model": api.cluster.info.name, "messages": MESSAGES, "max_tokens": 2}
    )
    assert status == 200 and answer["usage"]["completion_tokens"] == 2, answer
    status, models, _ = await api.get("/v1/models")
    assert status == 200 and models["data"][0]["endpoints"] == ["chat.completions", "completions"]


async def test_a_chat_template_for_a_model_fed_activations_is_refused(tmp_path: Path):
    with pytest.raises(ValueError, match=r"model 'synthetic' takes no prompt, so no chat template"):
        async with open_cluster(ClusterConfig("synthetic", chat_template=str(tmp_path / "t.jinja"))):
            pass
