"""What a run asks for, the checks that refuse a request the model cannot take, and its queued record.

A request the model cannot take (a prompt for a model fed activations, a prompt
that encodes to nothing or fills the context, an activation over
MAX_ACTIVATION) is a ValueError saying why, raised before the run is queued.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Annotated, Literal

import msgspec

from coordinator.stats import Accepted, ClusterRun
from workers.protocol.info import ModelInfo

if TYPE_CHECKING:
    from workers.models.tokenizer import Tokenizer

DEFAULT_SEQ = 16
# Positions in a synthetic run's input (`seq`); more is a 400.
MAX_SEQ = 65_536
# Floats in one activation, positions × hidden (16 MiB as float32); more is a 400.
MAX_ACTIVATION = 1 << 22
# Characters in a prompt, or in a chat's messages together; more is a 400 (the HTTP body limit is
# sized so any such prompt fits).
MAX_PROMPT_CHARS = 100_000
# Tokens a run may generate.
MAX_NEW_TOKENS = 4096
# Stop strings a run may have, and characters in each; more is a 400. Four is OpenAI's limit (and
# text-generation-inference's default), so no client written for that API sends more. Markers and
# role prefixes that end a turn are tens of characters; a stream holds back any end of its text that
# may begin a stop string, so 256 keeps that at most 255 characters behind.
MAX_STOPS, MAX_STOP_CHARS = 4, 256
StopString = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_STOP_CHARS)]


class ChatTurn(msgspec.Struct, forbid_unknown_fields=True):
    """One message of a chat: who says it (system, user or assistant) and what."""

    role: Literal["system", "user", "assistant"]
    content: Annotated[str, msgspec.Meta(max_length=MAX_PROMPT_CHARS)]


class RunRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What to run: `seq`/`seed` for a model fed activations, `prompt` or `messages` for a language model.

    seq: positions in the synthetic input (default 16).
    seed: seeds the synthetic input, or sampling.
    prompt: text to continue (language models).
    max_new_tokens: tokens to generate at most.
    temperature: 0 is greedy; above 0 samples.
    top_k: sample among the k most likely tokens (0 = all).
    chat: wrap the prompt as a user turn in the model's chat template.
    messages: a conversation to continue through the chat template, instead of a prompt.
    top_p: sample among the most likely tokens whose probabilities reach top_p (1 = all).
    stop: strings that end the text; it ends before the first one generated.
    """

    seq: Annotated[int, msgspec.Meta(ge=1, le=MAX_SEQ)] | None = None
    seed: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] = 0
    prompt: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PROMPT_CHARS)] | None = None
    max_new_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_NEW_TOKENS)] = 32
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=100.0)] = 0.0
    top_k: Annotated[int, msgspec.Meta(ge=0)] = 0
    chat: bool = False
    messages: Annotated[list[ChatTurn], msgspec.Meta(min_length=1)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    stop: Annotated[list[StopString], msgspec.Meta(max_length=MAX_STOPS)] = []

    @property
    def takes_text(self) -> bool:
        """Whether the request carries text (a prompt or messages) rather than a synthetic input."""
        return self.prompt is not None or self.messages is not None


def check(req: RunRequest, info: ModelInfo) -> None:
    """Refuse a request the model `info` describes cannot run, saying why."""
    if info.input == "tokens":
        if not req.takes_text:
            send = '{"prompt": "..."} or {"messages": [...]}'
            raise ValueError(f"model {info.name!r} takes a prompt: send {send}")
        if req.seq is not None:
            raise ValueError("seq is for models fed activations; this one takes a prompt")
        if req.messages is not None:
            _check_messages(req)
    elif req.takes_text:
        raise ValueError(f'model {info.name!r} takes no prompt: send {{"seq": N, "seed": S}}')
    else:
        check_activation(info, req.seq or DEFAULT_SEQ, "seq")


def _check_messages(req: RunRequest) -> None:
    """Refuse a chat that also has a prompt, or whose messages are longer than a prompt may be."""
    assert req.messages is not None
    if req.prompt is not None or req.chat:
        raise ValueError("send a prompt or messages, not both (messages always go through the chat template)")
    chars = sum(len(turn.content) for turn in req.messages)
    if chars > MAX_PROMPT_CHARS:
        limit = MAX_PROMPT_CHARS
        raise ValueError(f"the messages hold {chars:,} characters together, over the limit of {limit:,}")


def check_activation(info: ModelInfo, positions: int, what: str) -> None:
    """Refuse a forward whose activation, positions × hidden, is over MAX_ACTIVATION floats."""
    hidden = info.hidden
    if positions * hidden > MAX_ACTIVATION:
        raise ValueError(
            f"{what} {positions} × hidden {hidden} = {positions * hidden:,} floats per activation, "
            f"over the limit of {MAX_ACTIVATION:,} (MAX_ACTIVATION): this model takes {what} up to "
            f"{MAX_ACTIVATION // hidden:,}"
        )


def encode_prompt(req: RunRequest, tokenizer: Tokenizer, info: ModelInfo) -> list[int]:
    """The prompt's token ids as the model will see them; a ValueError when it cannot take them."""
    # chat() and chat_turns() are a ValueError for a model without a chat template, saying how to name one.
    if req.messages is not None:
        text = tokenizer.chat_turns([(turn.role, turn.content) for turn in req.messages])
    else:
        assert req.prompt is not None
        text = tokenizer.chat(req.prompt) if req.chat else req.prompt
    try:
        text.encode()
    except UnicodeEncodeError as exc:  # a lone surrogate, e.g. from undecodable command-line bytes
        where = f"{exc.reason} at character {exc.start}"
        raise ValueError(f"the prompt is not valid Unicode text: {where}") from None
    ids = tokenizer.prompt_ids(text)
    if not ids:
        raise ValueError("the prompt encodes to no tokens: none of its characters is in the vocabulary")
    if len(ids) >= info.context_length:
        raise ValueError(
            f"the prompt is {len(ids)} tokens; the model's context holds {info.context_length}, "
            "so no room is left to generate: shorten the prompt"
        )
    check_activation(info, len(ids), "prompt tokens")
    return ids


def transcript(messages: list[ChatTurn]) -> str:
    """A chat as a run record's prompt: one `role: content` line per message."""
    return "\n".join(f"{turn.role}: {turn.content}" for turn in messages)


def queued_run(req: RunRequest, ids: list[int], model: str, accepted: Accepted) -> ClusterRun:
    """The record a submitted request is stored with: queued, its prompt as `ids` (none for activations).

    accepted: the identity it was accepted under (coordinator.runs.resume.Identity.accepted).
    """
    return ClusterRun(
        timings=[],
        total_forward_ms=0.0,
        output=[],
        status="queued",
        model=model,
        created_at=time.time(),
        seq=len(ids) or req.seq or DEFAULT_SEQ,
        prompt=req.prompt if req.messages is None else transcript(req.messages),
        accepted=accepted,
    )
