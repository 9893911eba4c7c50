"""The OpenAI-compatible face: POST /v1/chat/completions and /v1/completions, streamed or not, GET /v1/models.

A chat goes through the model's chat template; a text completion continues its
prompt as it is, so a base model whose file has no chat template (and none
named with --chat-template) serves text completions only, and a chat to it is
a 400 that says so. Each model's `endpoints` in /v1/models says which it
serves. Both run the same way (coordinator.api.completing): a stored run,
streamed or answered whole, its usage and its `rlx` field. Errors have
OpenAI's shape ({"error": {"message", "type", "code"}}). The request and
answer shapes are in coordinator.api.openai_shapes, and importable from here.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from aiohttp import web

from coordinator.api.common import CLUSTER, expect_body, json_response
from coordinator.api.completing import Head, check_model, check_neutral, decode, sampling, serve
from coordinator.api.openai_shapes import (
    NEUTRAL,
    TEXT_MAX_TOKENS,
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChunkChoice,
    CompletionRequest,
    Delta,
    Endpoint,
    FinishReason,
    Message,
    Model,
    ModelList,
    OpenAIError,
    RlxRun,
    TextChoice,
    TextChunkChoice,
    TextCompletion,
    TextCompletionChunk,
    Usage,
)
from coordinator.cluster import Cluster
from coordinator.runs.requests import MAX_NEW_TOKENS, ChatTurn, RunRequest

__all__ = [
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "CompletionRequest",
    "ModelList",
    "OpenAIError",
    "TextCompletion",
    "TextCompletionChunk",
    "setup",
]

CREATED = web.AppKey("openai_created", int)
CHAT_DECODER = msgspec.json.Decoder(ChatCompletionRequest)
TEXT_DECODER = msgspec.json.Decoder(CompletionRequest)
# Said after a text completion's prompt that is a list, not one string.
ONE_STRING = "prompt must be one string: lists of prompts and token ids are not supported"
PROMPT_HINT = {"got `array` - at `$.prompt`": ONE_STRING}
# A text completion's fields that change nothing at these values only; any other is refused.
TEXT_NEUTRAL: dict[str, tuple[object, ...]] = {"n": (1,)}


def endpoints(cluster: Cluster) -> list[Endpoint]:
    """What the served model takes: text completions if it is a language model, chats if it has a template."""
    if cluster.info.input != "tokens" or cluster.tokenizer is None:
        return []
    chat: list[Endpoint] = ["chat.completions"] if cluster.tokenizer.chat_template is not None else []
    return [*chat, "completions"]


async def list_models(request: web.Request) -> web.Response:
    return json_response(ModelList(data=[_model(request)]))


async def get_model(request: web.Request) -> web.Response:
    model, asked = _model(request), request.match_info["model"]
    if asked != model.id:
        raise web.HTTPNotFound(text=f"no model {asked!r}: this server serves {model.id!r}")
    return json_response(model)


def _model(request: web.Request) -> Model:
    cluster = request.app[CLUSTER]
    return Model(id=cluster.info.name, created=request.app[CREATED], endpoints=endpoints(cluster))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """Run a chat completion; answer it whole, or stream it as server-sent chunks."""
    creq = await decode(request, CHAT_DECODER, "chat completion", {})
    cluster = request.app[CLUSTER]
    rreq = _chat_run(creq, cluster)
    include_usage = creq.stream_options is not None and creq.stream_options.include_usage
    return await serve(request, cluster, rreq, ChatWording(), bool(creq.stream), include_usage)


def _chat_run(creq: ChatCompletionRequest, cluster: Cluster) -> RunRequest:
    """The run a chat completion request asks for; 404 for another model, 400 for what cannot be done."""
    check_model(cluster, creq.model, "chat completions")
    if "chat.completions" not in endpoints(cluster):
        raise web.HTTPBadRequest(
            text=f"model {cluster.info.name!r} has no chat template (its file has no "
            "tokenizer.chat_template), so it takes no chat: send the text to continue to "
            "POST /v1/completions, or name a template with --chat-template FILE"
        )
    check_neutral(creq, NEUTRAL)
    return RunRequest(
        messages=_turns(creq.messages),
        max_new_tokens=creq.max_completion_tokens or creq.max_tokens or MAX_NEW_TOKENS,
        **sampling(creq.temperature, creq.top_p, creq.seed, creq.stop, creq.top_k),
    )


def _turns(messages: list[Message]) -> list[ChatTurn]:
    """The conversation as the runner takes it; 400 naming the message it cannot hold."""
    turns = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = "system" if message.role == "developer" else message.role
        if role not in ("system", "user", "assistant"):
            raise web.HTTPBadRequest(
                text=f"{where}: role {message.role!r} is not supported; use system, user or assistant "
                "(tool calling is not supported)"
            )
        if message.tool_calls:
            raise web.HTTPBadRequest(text=f"{where}: tool_calls are not supported")
        if message.content is None:
            raise web.HTTPBadRequest(text=f"{where}: content is missing")
        content = message.content
        if not isinstance(content, str):
            for j, part in enumerate(content):
                if part.type != "text":
                    raise web.HTTPBadRequest(
                        text=f"{where}.content[{j}]: {part.type!r} parts are not supported; only text"
                    )
            content = "\n".join(part.text for part in content)
        turns.append(ChatTurn(role=role, content=content))
    return turns


async def completions(request: web.Request) -> web.StreamResponse:
    """Run a text completion of a prompt as it is; answer it whole, or stream it as server-sent chunks."""
    creq = await decode(request, TEXT_DECODER, "completion", PROMPT_HINT)
    cluster = request.app[CLUSTER]
    check_model(cluster, creq.model, "completions")
    check_neutral(creq, TEXT_NEUTRAL)
    rreq = RunRequest(
        prompt=creq.prompt,
        max_new_tokens=creq.max_tokens or TEXT_MAX_TOKENS,
        **sampling(creq.temperature, creq.top_p, creq.seed, creq.stop),
    )
    include_usage = creq.stream_options is not None and creq.stream_options.include_usage
    return await serve(request, cluster, rreq, TextWording(), bool(creq.stream), include_usage)


class ChatWording:
    """A chat completion's words: an assistant message, streamed as deltas after one giving the role."""

    prefix = "chatcmpl"

    def whole(self, head: Head, text: str, finish: FinishReason, usage: Usage, rlx: RlxRun) -> ChatCompletion:
        choice = Choice(message=AssistantMessage(content=text), finish_reason=finish)
        return ChatCompletion(
            id=head.id, object="chat.completion", created=head.created, model=head.model, choices=[choice],
            usage=usage, rlx=rlx,
        )  # fmt: skip

    def opening(self) -> ChunkChoice:
        return ChunkChoice(delta=Delta(role="assistant", content=""))

    def choice(self, text: str, finish: FinishReason | None = None) -> ChunkChoice:
        return ChunkChoice(delta=Delta(content=text) if text else Delta(), finish_reason=finish)

    def chunk(self, head: Head, choices: list[Any], **extra: Any) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=head.id, object="chat.completion.chunk", created=head.created, model=head.model,
            choices=choices, **extra,
        )  # fmt: skip


class TextWording:
    """A text completion's words: the text, streamed piece by piece, all in `text_completion` objects."""

    prefix = "cmpl"

    def whole(self, head: Head, text: str, finish: FinishReason, usage: Usage, rlx: RlxRun) -> TextCompletion:
        return TextCompletion(
            id=head.id, object="text_completion", created=head.created, model=head.model,
            choices=[TextChoice(text=text, finish_reason=finish)], usage=usage, rlx=rlx,
        )  # fmt: skip

    def opening(self) -> None:
        return None

    def choice(self, text: str, finish: FinishReason | None = None) -> TextChunkChoice:
        return TextChunkChoice(text=text, finish_reason=finish)

    def chunk(self, head: Head, choices: list[Any], **extra: Any) -> TextCompletionChunk:
        return TextCompletionChunk(
            id=head.id, object="text_completion", created=head.created, model=head.model, choices=choices,
            **extra,
        )  # fmt: skip


def setup(app: web.Application) -> None:
    """Add the /v1 routes."""
    app[CREATED] = int(time.time())
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", get_model)
    app.router.add_post("/v1/chat/completions", chat_completions, expect_handler=expect_body)
    app.router.add_post("/v1/completions", completions, expect_handler=expect_body)
