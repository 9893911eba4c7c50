"""POST /v1/completions: a prompt continued as it is, driven by the real `openai` client and plain HTTP
against one served 2-stage cluster of a tiny llama whose file has no chat template."""

from __future__ import annotations

import os

import aiohttp
import msgspec
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestServer

from coordinator.api import CLUSTER, create_app
from coordinator.cluster import Cluster, ClusterConfig
from coordinator.runs.requests import MAX_PROMPT_CHARS, MAX_STOPS
from tests.conftest import worker_pids
from tests.support.lazy import lazy_import

openai = lazy_import("openai")  # a second of CPU, paid only by the process that runs this file

TOKEN = "completions-test-token"
TIMEOUT_S = 30.0  # one request of a few tiny tokens, on a busy 2-core machine
PROMPT = "xyz"
# The tiny model's greedy continuation of PROMPT, one letter a token (its end token is never sampled).
GREEDY = "amsmsm"
on_tiny = pytest.mark.asyncio(loop_scope="module")


class Served:
    """A served tiny cluster, an `openai` client and a plain HTTP session pointed at it."""

    def __init__(self, server: TestServer, cluster: Cluster) -> None:
        self.server, self.cluster, self.model = server, cluster, cluster.info.name
        self.client = openai.AsyncOpenAI(
            base_url=str(server.make_url("/v1")), api_key=TOKEN, max_retries=0, timeout=TIMEOUT_S
        )
        self.http = aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {TOKEN}"}, timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)
        )

    def url(self, path: str) -> str:
        return str(self.server.make_url(path))

    async def create(self, **kw):
        kw.setdefault("model", self.model)
        kw.setdefault("prompt", PROMPT)
        kw.setdefault("temperature", 0)
        kw.setdefault("max_tokens", len(GREEDY))
        return await self.client.completions.create(**kw)

    async def chunks(self, **kw) -> list:
        stream = await self.create(stream=True, **kw)
        return [chunk async for chunk in stream]

    async def post(self, path: str, body: dict) -> tuple[int, dict]:
        async with self.http.post(self.url(path), json=body) as r:
            return r.status, await r.json()

    async def get(self, path: str) -> tuple[int, dict]:
        async with self.http.get(self.url(path)) as r:
            return r.status, await r.json()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tiny_chat):
    """The tiny llama without a chat template in 2 stages, served with a token, shared by this file."""
    app = create_app(ClusterConfig(str(tiny_chat), 2, build_timeout=60.0), TOKEN)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    served = Served(server, server.app[CLUSTER])
    try:
        yield served
    finally:
        await served.client.close()
        await served.http.close()
        await server.close()
    assert worker_pids(os.getpid()) == [], "a worker outlived the cluster"


def run_id(completion) -> int:
    return int(completion.id.removeprefix("cmpl-"))


@on_tiny
async def test_a_completion_continues_the_prompt_as_plain_text_and_is_a_stored_run(served):
    answer = await served.create()
    assert answer.object == "text_completion" and answer.model == served.model
    [choice] = answer.choices
    assert (choice.text, choice.finish_reason, choice.index) == (GREEDY, "length", 0)
    status, record = await served.get(f"/runs/{answer.rlx['run']}")
    assert status == 200 and run_id(answer) == record["id"] and record["status"] == "ok"
    assert record["prompt"] == PROMPT and record["text"] == GREEDY
    # Tokenized as it is, the file's BOS rule applied, no template around it.
    assert answer.usage.prompt_tokens == record["seq"] == len(served.cluster.tokenizer.prompt_ids(PROMPT))
    assert answer.usage.completion_tokens == len(record["tokens"]) == len(GREEDY)
    assert answer.usage.total_tokens == record["seq"] + len(GREEDY)
    stages = [[t["stage"] for t in answer.rlx[phase]] for phase in ("prefill", "decode")]
    assert stages == [[0, 1], [0, 1]] and answer.rlx["location"] == f"/runs/{record['id']}"


@on_tiny
async def test_a_stream_sends_the_text_piece_by_piece_then_the_finish_then_the_usage(served):
    chunks = await served.chunks(stream_options={"include_usage": True})
    *texts, finish, usage = chunks
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    pieces = [c.choices[0].text for c in [*texts, finish]]
    assert "".join(pieces) == GREEDY and len([p for p in pieces if p]) == len(GREEDY)  # a letter a token
    assert all(c.choices[0].finish_reason is None for c in texts)
    assert finish.choices[0].finish_reason == "length" and finish.usage is None
    status, record = await served.get(f"/runs/{finish.rlx['run']}")
    assert status == 200 and record["text"] == GREEDY and run_id(chunks[0]) == record["id"]
    assert usage.choices == []
    assert (usage.usage.prompt_tokens, usage.usage.completion_tokens) == (record["seq"], len(GREEDY))


@on_tiny
async def test_the_stream_on_the_wire_is_data_lines_ending_with_done(served):
    body = {"model": served.model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "stream": True}
    async with served.http.post(served.url("/v1/completions"), json=body) as r:
        assert r.status == 200 and r.content_type == "text/event-stream"
        raw = (await r.read()).decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])
    chunks = [msgspec.json.decode(e.removeprefix("data: ")) for e in events[:-2]]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == GREEDY[:2]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)  # not asked for


@on_tiny
async def test_a_stop_string_spanning_two_tokens_ends_the_text_before_it(served):
    answer = await served.create(stop="sm")  # "s" and "m" are two tokens
    assert (answer.choices[0].text, answer.choices[0].finish_reason) == ("am", "stop")
    _, record = await served.get(f"/runs/{answer.rlx['run']}")
    assert record["text"] == "am" and len(record["tokens"]) == 4  # "s", "m" were made, then cut
    first = await served.create(stop=["nowhere", "ms", "sm"])  # the earliest in the text wins
    assert (first.choices[0].text, first.choices[0].finish_reason) == ("a", "stop")


@on_tiny
async def test_a_stream_holds_back_what_may_begin_a_stop_string(served):
    chunks = await served.chunks(stop=["sm"])
    pieces = [c.choices[0].text for c in chunks]
    assert "".join(pieces) == "am" and not any("s" in p for p in pieces)
    assert chunks[-1].choices[0].finish_reason == "stop"


@on_tiny
async def test_sampling_follows_the_seed(served):
    sampled = [await served.create(max_tokens=8, temperature=1.5, seed=seed) for seed in (7, 7, 8)]
    texts = [s.choices[0].text for s in sampled]
    assert texts[0] == texts[1] and texts[0] != texts[2]
    assert all(len(s.choices[0].text) > 0 for s in sampled)
    nucleus = await served.create(temperature=1.5, top_p=1e-9, seed=9)  # only the most likely is left
    assert nucleus.choices[0].text == GREEDY


ONE_STRING = "prompt must be one string: lists of prompts and token ids are not supported"
BAD_REQUESTS = [
    ({"prompt": ["xyz", "abc"]}, ONE_STRING),
    ({"prompt": [1, 2, 3]}, "Expected `str`, got `array` - at `$.prompt` (prompt must be one string"),
    ({"prompt": ""}, "Expected `str` of length >= 1 - at `$.prompt`"),
    ({"prompt": "x" * (MAX_PROMPT_CHARS + 1)}, f"`str` of length <= {MAX_PROMPT_CHARS} - at `$.prompt`"),
    ({"n": 2}, "n 2 is not supported by this server; leave it out or send 1"),
    ({"extra_body": {"echo": True}}, "unknown field `echo`"),
    ({"temperature": 3}, "Expected `float` <= 2.0 - at `$.temperature`"),
    ({"top_p": 0}, "Expected `float` > 0.0 - at `$.top_p`"),
    ({"max_tokens": 0}, "Expected `int` >= 1 - at `$.max_tokens`"),
    ({"max_tokens": 5000}, "Expected `int` <= 4096 - at `$.max_tokens`"),
    ({"seed": "7"}, "Expected `int | null`, got `str` - at `$.seed`"),
    (
        {"stop": [f"s{i}" for i in range(MAX_STOPS + 1)]},
        f"Expected `array` of length <= {MAX_STOPS} - at `$.stop`",
    ),
    ({"stop": ""}, "at `$.stop`"),
    ({"stream": "yes"}, "Expected `bool | null`, got `str` - at `$.stream`"),
]


@on_tiny
@pytest.mark.parametrize(("kw", "message"), BAD_REQUESTS)
async def test_a_bad_request_is_a_bad_request_error_naming_what_is_wrong(served, kw, message):
    before = served.cluster.runner.latest
    with pytest.raises(openai.BadRequestError) as caught:
        await served.create(**kw)
    assert caught.value.status_code == 400 and message in caught.value.body["message"]
    # The hint about lists comes only after a list.
    assert (ONE_STRING in caught.value.body["message"]) == isinstance(kw.get("prompt"), list)
    assert caught.value.body["type"] == "invalid_request_error" and caught.value.body["code"] == "bad_request"
    assert served.cluster.runner.latest is before  # refused before a run was made


@on_tiny
async def test_a_body_without_a_prompt_or_not_json_is_400_in_openais_shape(served):
    status, body = await served.post("/v1/completions", {"model": served.model})
    assert status == 400 and "Object missing required field `prompt`" in body["error"]["message"]
    async with served.http.post(
        served.url("/v1/completions"), data=b"{", headers={"Content-Type": "application/json"}
    ) as r:
        assert r.status == 400 and "the body is not valid JSON" in (await r.json())["error"]["message"]


@on_tiny
async def test_another_model_is_not_found(served):
    with pytest.raises(openai.NotFoundError) as caught:
        await served.create(model="gpt-3.5-turbo-instruct")
    said = caught.value.body["message"]
    assert said == f"the model 'gpt-3.5-turbo-instruct' does not exist: this server serves {served.model!r}"


@on_tiny
async def test_a_model_without_a_chat_template_serves_completions_only_and_says_so(served):
    models = await served.client.models.list()
    assert [(m.id, m.endpoints) for m in models.data] == [(served.model, ["completions"])]
    assert (await served.client.models.retrieve(served.model)).endpoints == ["completions"]
    before = served.cluster.runner.latest
    with pytest.raises(openai.BadRequestError) as caught:
        await served.client.chat.completions.create(
            model=served.model, messages=[{"role": "user", "content": "abc"}], max_tokens=2
        )
    said = caught.value.body["message"]
    assert "has no chat template" in said and "POST /v1/completions" in said and "--chat-template" in said
    assert served.cluster.runner.latest is before
