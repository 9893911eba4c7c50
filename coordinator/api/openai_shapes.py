"""The shapes of OpenAI's chat and text completion APIs as this server takes and answers them (msgspec).

Requests are refused rather than half-understood: a field OpenAI defines that
changes nothing at some values (n=1, penalties 0, no tools, ...) is accepted
only at those (NEUTRAL); a field nobody defines is refused. /openapi.json
describes these same Structs.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from coordinator.api.common import OpenAIError
from coordinator.runs.requests import MAX_NEW_TOKENS, MAX_PROMPT_CHARS, MAX_STOP_CHARS, MAX_STOPS
from coordinator.stats import StageTiming

__all__ = [
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "CompletionRequest",
    "ModelList",
    "OpenAIError",
    "TextCompletion",
    "TextCompletionChunk",
]

OWNED_BY = "rlx-cluster"
# Messages in one request; more is a 400.
MAX_MESSAGES = 1024
FinishReason = Literal["stop", "length"]
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
MaxTokens = Annotated[int, msgspec.Meta(ge=1, le=MAX_NEW_TOKENS)]
Stop = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_STOP_CHARS)]
Stops = Stop | Annotated[list[Stop], msgspec.Meta(max_length=MAX_STOPS)]
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
# What an endpoint is called in a model's `endpoints`: OpenAI's names for them (its client's too).
Endpoint = Literal["chat.completions", "completions"]
# OpenAI's default for a text completion's max_tokens: a base model rarely ends of itself.
TEXT_MAX_TOKENS = 16


class ContentPart(msgspec.Struct, kw_only=True):
    """One part of a message's content; only text parts are understood. type: "text". text: the text."""

    type: str
    text: str = ""


class Message(msgspec.Struct, kw_only=True):
    """One message of the conversation.

    role: system, user or assistant ("developer" is taken as system).
    content: a string, or a list of text parts (joined by newlines).
    name: accepted and not used (the chat template has no place for it).
    tool_calls: only empty: tool calling is not supported.
    """

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class StreamOptions(msgspec.Struct, kw_only=True):
    """With stream: include_usage adds a last chunk with the usage and no choices."""

    include_usage: bool = False


class ChatCompletionRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A chat completion request, as OpenAI's API takes it.

    model: the model's id (GET /v1/models). messages: the conversation so far.
    max_completion_tokens (or max_tokens): tokens to generate at most; without
        either, until the end of sequence or MAX_NEW_TOKENS.
    temperature: 0..2, default 1; 0 is greedy. top_p: nucleus mass in (0, 1].
    top_k: the k most likely tokens only (0 or -1 = all; as llama.cpp and vLLM take it).
    seed: makes sampling repeatable; without it each request draws its own.
    stop: up to MAX_STOPS strings; the text ends before the first one generated.
    stream, stream_options: answer as server-sent chunks, the usage last when asked.
    n: only 1. user, metadata, store, service_tier, parallel_tool_calls,
        reasoning_effort: accepted, not used.
    frequency_penalty, presence_penalty, logprobs, top_logprobs, logit_bias,
        tools, tool_choice, functions, function_call, response_format,
        modalities, audio, prediction, web_search_options: accepted only at the
        values that change nothing (see NEUTRAL); any other is refused.
    """

    model: str
    messages: Annotated[list[Message], msgspec.Meta(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, msgspec.Meta(ge=-1)] | None = None
    seed: Seed | None = None
    stop: Stops | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None


# The values at which these fields change nothing here; any other is refused, naming the field.
NEUTRAL: dict[str, tuple[object, ...]] = {
    "n": (1,),
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "logprobs": (False,),
    "top_logprobs": (0,),
    "logit_bias": ({},),
    "tools": ([],),
    "tool_choice": ("none", "auto"),
    "functions": ([],),
    "function_call": ("none", "auto"),
    "response_format": ({"type": "text"},),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "web_search_options": (),
}


class CompletionRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A text completion request, as OpenAI's completions API takes it: text to continue, no chat template.

    model: the model's id (GET /v1/models).
    prompt: one string, tokenized as plain text (BOS first when the model's file says so);
        a list of prompts, or of token ids, is refused.
    max_tokens: tokens to generate at most (default TEXT_MAX_TOKENS, as OpenAI's).
    temperature: 0..2, default 1; 0 is greedy. top_p: nucleus mass in (0, 1].
    seed: makes sampling repeatable; without it each request draws its own.
    stop: up to MAX_STOPS strings; the text ends before the first one generated.
    stream, stream_options: answer as server-sent chunks, the usage last when asked.
    n: only 1. Any other field is refused.
    """

    model: str
    prompt: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PROMPT_CHARS)]
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Seed | None = None
    stop: Stops | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = None


class Usage(msgspec.Struct, kw_only=True):
    """Tokens: the prompt's (after the chat template, for a chat), the generated ones, and both."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class RlxRun(msgspec.Struct, kw_only=True):
    """This project's extension: the stored run behind the completion.

    run: its id. location: where to read it. prefill, decode: per-stage
    timings of the prompt's forward and of all decode steps summed.
    prefill_ms, decode_ms: their wall times.
    """

    run: int
    location: str
    prefill: list[StageTiming]
    decode: list[StageTiming]
    prefill_ms: float
    decode_ms: float


class AssistantMessage(msgspec.Struct, kw_only=True):
    """The answer. role: assistant. content: the generated text."""

    role: Literal["assistant"] = "assistant"
    content: str


class Choice(msgspec.Struct, kw_only=True):
    """The one choice: its message and why generation ended (stop: end of sequence or a stop string)."""

    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: None = None


class ChatCompletion(msgspec.Struct, kw_only=True):
    """A whole completion. id: chatcmpl-<run id>. created: Unix time the run was queued."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    system_fingerprint: str | None = None
    rlx: RlxRun


class Delta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a chunk adds: the role (first chunk), then pieces of content."""

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(msgspec.Struct, kw_only=True):
    """A chunk's choice: its delta, and the finish reason on the last one."""

    index: int = 0
    delta: Delta
    finish_reason: FinishReason | None = None
    logprobs: None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One server-sent chunk of a streamed completion; the last with choices empty carries the usage."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    rlx: RlxRun | None = None


class TextChoice(msgspec.Struct, kw_only=True):
    """The one choice of a text completion: the generated text and why generation ended."""

    index: int = 0
    text: str
    finish_reason: FinishReason
    logprobs: None = None


class TextCompletion(msgspec.Struct, kw_only=True):
    """A whole text completion. id: cmpl-<run id>. created: Unix time the run was queued."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage
    system_fingerprint: str | None = None
    rlx: RlxRun


class TextChunkChoice(msgspec.Struct, kw_only=True):
    """A text chunk's choice: the text it adds, and the finish reason on the last one."""

    index: int = 0
    text: str
    finish_reason: FinishReason | None = None
    logprobs: None = None


class TextCompletionChunk(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One server-sent chunk of a streamed text completion; the last with choices empty carries the usage."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChunkChoice]
    usage: Usage | None = None
    rlx: RlxRun | None = None


class Model(msgspec.Struct, kw_only=True):
    """A model served: id (the model spec), created (Unix time the app was made), owned_by.

    endpoints: this project's extension: what the model serves, by OpenAI's names for them:
    "completions" (POST /v1/completions) for a language model, and "chat.completions"
    (POST /v1/chat/completions) when it has a chat template too; none for a model fed activations.
    """

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = OWNED_BY
    endpoints: list[Endpoint]


class ModelList(msgspec.Struct, kw_only=True):
    """The models served: this cluster's one."""

    object: Literal["list"] = "list"
    data: list[Model]
