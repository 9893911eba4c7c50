"""The OpenAI-compatible API, driven by the real `openai` client against a SmolLM2 3-stage cluster."""

from __future__ import annotations

import asyncio
import os

import aiohttp
import msgspec
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestServer

from coordinator.api import CLUSTER, create_app
from coordinator.api.stops import sendable
from coordinator.cluster import Cluster, ClusterConfig
from coordinator.runs.requests import MAX_STOPS, RunRequest
from tests.conftest import eventually, worker_pids
from tests.support.lazy import lazy_import

openai = lazy_import("openai")  # a second of CPU, paid only by the process that runs this file

TOKEN = "openai-test-token"
TIMEOUT_S = 60.0  # one request, prefill and decode, on a busy 2-core machine
# A short system turn: the template's default one would double the prompt, and a forward's cost with it.
FRANCE = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
]
PARIS = "The capital of France is Paris."  # SmolLM2's greedy answer
on_smollm2 = pytest.mark.asyncio(loop_scope="module")


class Chat:
    """A served SmolLM2 cluster, an `openai` client and a plain HTTP session pointed at it."""

    def __init__(self, server: TestServer, cluster: Cluster) -> None:
        self.server, self.cluster = server, cluster
        self.client = openai.AsyncOpenAI(
            base_url=str(server.make_url("/v1")), api_key=TOKEN, max_retries=0, timeout=TIMEOUT_S
        )
        self.http = aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {TOKEN}"}, timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)
        )

    def url(self, path: str) -> str:
        return str(self.server.make_url(path))

    async def create(self, **kw):
        kw.setdefault("model", "smollm2")
        kw.setdefault("messages", FRANCE)
        kw.setdefault("temperature", 0)
        return await self.client.chat.completions.create(**kw)

    async def chunks(self, **kw) -> list:
        stream = await self.create(stream=True, **kw)
        return [chunk async for chunk in stream]

    async def record(self, run_id: int) -> dict:
        async with self.http.get(self.url(f"/runs/{run_id}")) as r:
            assert r.status == 200
            return await r.json()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def chat(smollm2):
    """One SmolLM2 cluster in 3 stages, served with a token, shared by the file's SmolLM2 tests."""
    app = create_app(ClusterConfig("smollm2", 3, build_timeout=120.0), TOKEN)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    served = Chat(server, server.app[CLUSTER])
    try:
        yield served
    finally:
        await served.client.close()
        await served.http.close()
        await server.close()
    assert worker_pids(os.getpid()) == [], "a worker outlived the cluster"


# The fake-model tests come first: their fixture checks that no worker of this process is left, which
# holds only before the shared SmolLM2 cluster starts.


async def test_a_model_that_takes_no_prompt_is_refused_and_still_listed(api_factory):
    api = await api_factory("fake:layers=4", 2, token=TOKEN)
    client = openai.AsyncOpenAI(base_url=api.url("/v1"), api_key=TOKEN, max_retries=0, timeout=TIMEOUT_S)
    async with client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model="fake:layers=4", messages=FRANCE)
        assert "model 'fake:layers=4' takes no prompt" in caught.value.body["message"]
        with pytest.raises(openai.BadRequestError) as caught:
            await client.completions.create(model="fake:layers=4", prompt="The capital of France is")
        assert "model 'fake:layers=4' takes no prompt" in caught.value.body["message"]
        models = await client.models.list()
        assert [(m.id, m.owned_by) for m in models.data] == [("fake:layers=4", "rlx-cluster")]
        assert models.data[0].endpoints == []  # neither: it is fed activations


async def test_errors_under_v1_have_openais_shape_401_and_404_included(api_factory):
    api = await api_factory("fake:layers=4", 2, token=TOKEN)
    client = openai.AsyncOpenAI(base_url=api.url("/v1"), api_key="wrong", max_retries=0, timeout=TIMEOUT_S)
    async with client:
        with pytest.raises(openai.AuthenticationError) as caught:
            await client.models.list()
    assert caught.value.body == {
        "message": "missing or wrong bearer token", "type": "invalid_request_error",
        "code": "invalid_api_key", "param": None,
    }  # fmt: skip
    status, body, _ = await api.get("/v1/embeddings", headers={"Authorization": f"Bearer {TOKEN}"})
    assert status == 404 and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["code"] == "not_found"
    status, body, _ = await api.get("/v1/completions", headers={"Authorization": f"Bearer {TOKEN}"})
    assert status == 405 and body["error"]["code"] == "method_not_allowed"  # served, but only to a POST
    status, body, _ = await api.get("/runs/99", headers={"Authorization": f"Bearer {TOKEN}"})
    assert status == 404 and body == {"error": "no run 99"}  # outside /v1 the shape is the project's own


def run_id(completion) -> int:
    return int(completion.id.removeprefix("chatcmpl-"))


@on_smollm2
async def test_the_capital_of_france_is_paris_and_the_usage_is_the_stored_runs(chat):
    answer = await chat.create(max_tokens=16)
    assert answer.object == "chat.completion" and answer.model == "smollm2"
    [choice] = answer.choices
    assert choice.message.role == "assistant" and choice.message.content == PARIS
    assert choice.finish_reason == "stop"  # the end of sequence came before 16 tokens
    record = await chat.record(answer.rlx["run"])
    assert run_id(answer) == record["id"] and record["status"] == "ok" and record["text"] == PARIS
    assert record["prompt"] == "system: Be brief.\nuser: What is the capital of France?"
    assert answer.usage.prompt_tokens == record["seq"]
    assert answer.usage.completion_tokens == len(record["tokens"]) == 7
    assert answer.usage.total_tokens == record["seq"] + len(record["tokens"])
    stages = [[t["stage"] for t in answer.rlx[phase]] for phase in ("prefill", "decode")]
    assert stages == [[0, 1, 2], [0, 1, 2]]
    assert answer.rlx["prefill"] == record["timings"] and answer.rlx["decode"] == record["decode"]["timings"]
    assert answer.rlx["location"] == f"/runs/{record['id']}"
    async with chat.http.get(chat.url("/run/latest/table")) as r:  # the table shows it like any run
        table = await r.text()
    assert r.status == 200 and all(t["addr"] in table for t in record["timings"])
    async with chat.http.get(chat.url("/run/latest")) as r:
        assert (await r.json())["id"] == record["id"]


@on_smollm2
async def test_a_stream_sends_the_role_then_the_text_then_the_finish_then_the_usage(chat):
    chunks = await chat.chunks(max_tokens=16, stream_options={"include_usage": True})
    first, *middle, finish, usage = chunks
    assert first.choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == first.id for c in chunks)
    pieces = [c.choices[0].delta.content or "" for c in [first, *middle, finish]]
    assert "".join(pieces) == PARIS and len([p for p in pieces if p]) > 3  # piece by piece, not at once
    assert all(c.choices[0].finish_reason is None for c in [first, *middle])
    assert finish.choices[0].finish_reason == "stop" and finish.usage is None
    record = await chat.record(finish.rlx["run"])
    assert record["text"] == PARIS and run_id(first) == record["id"]
    assert usage.choices == []
    counted = (usage.usage.prompt_tokens, usage.usage.completion_tokens)
    assert counted == (record["seq"], len(record["tokens"]))


@on_smollm2
async def test_the_stream_on_the_wire_is_data_lines_ending_with_done(chat):
    body = {"model": "smollm2", "messages": FRANCE, "max_tokens": 2, "temperature": 0, "stream": True}
    async with chat.http.post(chat.url("/v1/chat/completions"), json=body) as r:
        assert r.status == 200 and r.content_type == "text/event-stream"
        raw = (await r.read()).decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [msgspec.json.decode(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: {") for e in events[:-2])
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "The capital"
    assert all("usage" not in c for c in chunks)  # not asked for


@on_smollm2
async def test_max_tokens_three_ends_with_finish_reason_length(chat):
    answer = await chat.create(max_completion_tokens=3)
    text, finish, usage = answer.choices[0].message.content, answer.choices[0].finish_reason, answer.usage
    assert (text, finish, usage.completion_tokens) == ("The capital of", "length", 3)


@on_smollm2
async def test_a_stop_string_ends_the_text_before_it(chat):
    answer = await chat.create(max_tokens=16, stop=" Paris")
    assert answer.choices[0].message.content == "The capital of France is"
    assert answer.choices[0].finish_reason == "stop"
    record = await chat.record(answer.rlx["run"])
    assert record["text"] == "The capital of France is" and len(record["tokens"]) == 6  # " Paris" was made


@on_smollm2
async def test_a_stream_holds_back_what_may_begin_a_stop_string(chat):
    # "is Paris" spans two tokens: " is" must wait until " Paris" shows it starts the stop string.
    chunks = await chat.chunks(max_tokens=16, stop=["nowhere", "is Paris"])
    pieces = [c.choices[0].delta.content or "" for c in chunks]
    assert "".join(pieces) == "The capital of France "
    assert not any("is" in p for p in pieces)
    assert chunks[-1].choices[0].finish_reason == "stop"


@on_smollm2
async def test_a_conversation_goes_through_the_chat_template_turn_by_turn(chat):
    messages = [
        {"role": "developer", "content": "Answer in one word."},
        {"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "it?"}]},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?", "name": "ada"},
    ]
    answer = await chat.create(messages=messages, max_tokens=1)
    turns = [
        ("system", "Answer in one word."),
        ("user", "What is\nit?"),
        ("assistant", "Paris."),
        ("user", "And of Italy?"),
    ]
    tokenizer = chat.cluster.tokenizer
    assert answer.usage.prompt_tokens == len(tokenizer.encode(tokenizer.chat_turns(turns)))
    record = await chat.record(answer.rlx["run"])
    assert record["prompt"] == "\n".join(f"{role}: {content}" for role, content in turns)


@on_smollm2
async def test_sampling_follows_the_seed_and_a_tiny_top_p_is_greedy(chat):
    same = [await chat.create(max_tokens=3, temperature=1.5, seed=7) for _ in range(2)]
    assert same[0].choices[0].message.content == same[1].choices[0].message.content
    nucleus = await chat.create(max_tokens=3, temperature=1.5, top_p=1e-9, extra_body={"top_k": 40})
    assert nucleus.choices[0].message.content == "The capital of"


@on_smollm2
async def test_a_client_that_disconnects_mid_stream_cancels_the_run(chat):
    story = [{"role": "user", "content": "Write a long story about a dragon."}]
    stream = await chat.create(messages=story, max_tokens=400, stream=True)
    seen = []
    async for chunk in stream:
        seen.append(chunk)
        if len(seen) == 3:
            break
    await stream.close()
    run = run_id(seen[0])

    async def cancelled():
        record = await chat.record(run)
        return record if record["status"] not in ("queued", "running") else None

    record = await eventually(cancelled, TIMEOUT_S, f"run {run} to end")
    assert record["status"] == "cancelled"
    assert 2 <= len(record["tokens"]) < 400


@on_smollm2
async def test_a_cluster_that_cannot_take_a_run_answers_503_with_retry_after(chat):
    runner = chat.cluster.runner
    limit, runner.queue_limit = runner.queue_limit, 1
    active, runner.max_active = runner.max_active, 1  # the second run waits in the queue
    # The first run is held at its first forward until the end, however soon it would finish.
    scheduler, held = runner.scheduler, asyncio.Event()
    forward = scheduler.forward

    async def held_forward(*args, **kwargs):
        await held.wait()
        return await forward(*args, **kwargs)

    scheduler.forward = held_forward
    busy = await runner.submit(RunRequest(prompt="Tell me a long story.", max_new_tokens=400))
    waiting = None
    try:
        await eventually(lambda: runner.queued() == 0, TIMEOUT_S, "the long run to start")
        waiting = await runner.submit(RunRequest(prompt="Hi", max_new_tokens=1))
        with pytest.raises(openai.InternalServerError) as caught:
            await chat.create(max_tokens=1)
        assert caught.value.status_code == 503 and caught.value.response.headers["Retry-After"] == "5"
        assert caught.value.body["type"] == "server_error"
        assert "runs are already waiting" in caught.value.body["message"]
    finally:
        del scheduler.forward  # the class's again
        held.set()
        runner.queue_limit, runner.max_active = limit, active
        for run in (waiting, busy):
            if run is not None:
                await runner.cancel(run.id)


BAD_REQUESTS = [
    ({"n": 2}, "n 2 is not supported by this server; leave it out or send 1"),
    ({"extra_body": {"min_p": 0.1}}, "unknown field `min_p`"),
    ({"temperature": 3}, "Expected `float` <= 2.0 - at `$.temperature`"),
    ({"max_tokens": 5000}, "Expected `int` <= 4096 - at `$.max_tokens`"),
    ({"logprobs": True}, "logprobs True is not supported"),
    (
        {"stop": [f"s{i}" for i in range(MAX_STOPS + 1)]},
        f"Expected `array` of length <= {MAX_STOPS} - at `$.stop`",
    ),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools [{'type'"),
    ({"messages": []}, "Expected `array` of length >= 1 - at `$.messages`"),
    (
        {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]},
        "messages[1]: role 'tool' is not supported; use system, user or assistant",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages[0].content[0]: 'image_url' parts are not supported; only text",
    ),
]


@on_smollm2
@pytest.mark.parametrize(("kw", "message"), BAD_REQUESTS)
async def test_a_bad_request_is_a_bad_request_error_saying_what_is_wrong(chat, kw, message):
    before = chat.cluster.runner.latest
    with pytest.raises(openai.BadRequestError) as caught:
        await chat.create(**kw)
    assert caught.value.status_code == 400
    assert message in caught.value.body["message"]
    assert caught.value.body["type"] == "invalid_request_error" and caught.value.body["code"] == "bad_request"
    assert chat.cluster.runner.latest is before  # refused before a run was made


@on_smollm2
async def test_another_model_is_not_found_and_the_models_list_names_this_one(chat):
    with pytest.raises(openai.NotFoundError) as caught:
        await chat.create(model="gpt-4o")
    assert "the model 'gpt-4o' does not exist: this server serves 'smollm2'" in caught.value.body["message"]
    models = await chat.client.models.list()
    assert [(m.id, m.object, m.owned_by) for m in models.data] == [("smollm2", "model", "rlx-cluster")]
    assert (await chat.client.models.retrieve("smollm2")).id == "smollm2"
    assert models.data[0].endpoints == ["chat.completions", "completions"]  # its file has a chat template


@on_smollm2
async def test_a_text_completion_continues_the_prompt_without_the_chat_template(chat):
    prompt = "The capital of France is"
    answer = await chat.client.completions.create(model="smollm2", prompt=prompt, max_tokens=4, temperature=0)
    assert answer.object == "text_completion" and answer.choices[0].text == " Paris.\n\n"
    assert answer.choices[0].finish_reason == "length"
    record = await chat.record(answer.rlx["run"])
    assert record["prompt"] == prompt and answer.usage.prompt_tokens == record["seq"]
    assert record["seq"] == len(chat.cluster.tokenizer.prompt_ids(prompt))  # the words alone, no template


@on_smollm2
async def test_post_runs_takes_messages_and_refuses_them_with_a_prompt(chat):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_new_tokens": 1}
    async with chat.http.post(chat.url("/runs"), json=body) as r:
        assert r.status == 202
    async with chat.http.post(chat.url("/runs"), json={**body, "prompt": "Hi"}) as r:
        assert r.status == 400
        assert (await r.json())["error"] == (
            "send a prompt or messages, not both (messages always go through the chat template)"
        )


@pytest.mark.parametrize(
    ("text", "stops", "end"),
    [
        ("The capital", [], 11),
        ("The capital", ["Paris"], 11),
        ("The capital of France is", ["is Paris"], 22),  # "is" may begin the stop string
        ("The capital of France is Paris", ["is Paris"], 22),
        ("The capital of France is Paris", ["Paris", "France"], 15),  # the earliest wins
        ("a\nb\n", ["\n\n"], 3),
        ("abc", ["abcd"], 0),
    ],
)
def test_what_may_be_sent_stops_short_of_a_stop_string_and_any_start_of_one(text, stops, end):
    assert sendable(text, stops) == end
