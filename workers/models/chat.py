"""A model's chat template, rendered in Jinja's sandbox, with the user's text kept apart from the template's.

The template is data from a file: it renders in ImmutableSandboxedEnvironment,
which refuses attribute access beyond plain values (`''.__class__`) and any
change to the messages; it is given what Hugging Face templates read
(`messages`, `bos_token`, `eos_token`, `add_generation_prompt`,
`raise_exception`) and nothing that reaches the filesystem or the clock.

Control tokens (`<|im_start|>`, ...) are read only out of the template's own
text. To know which text is whose, the messages are rendered twice: once as
they are, once with a unique placeholder for each message's content. The
placeholders cut the second rendering into the template's parts; the first
must then read as those parts with each message's content between them (as
it is, or trimmed, as templates often do). A template that changes the
content otherwise is refused: guessing could let a user's text open a turn.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from typing import Any

from jinja2 import TemplateError, Undefined
from jinja2.exceptions import SecurityError, TemplateRuntimeError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROLES = ("system", "user", "assistant")  # the turns a chat prompt may hold


class ChatPrompt(str):
    """A prompt rendered from the chat template that remembers which parts are the template's.

    It reads as the whole rendered text. `Tokenizer.encode` matches control tokens in
    the template's parts only; a string derived from it (slicing, +) is plain text again.
    """

    parts: tuple[tuple[str, bool], ...]

    def __new__(cls, parts: list[tuple[str, bool]]) -> ChatPrompt:
        prompt = super().__new__(cls, "".join(text for text, _ in parts))
        prompt.parts = tuple(parts)  # (text, is_template) in order
        return prompt


class _Refused(TemplateRuntimeError):
    """The template's own raise_exception: it cannot hold these messages."""


def _raise_exception(message: str) -> None:
    raise _Refused(str(message))


def _tojson(value: Any, indent: int | None = None) -> str:
    # Jinja's own tojson escapes <, > and & for HTML; a prompt wants the characters.
    return json.dumps(value, ensure_ascii=False, indent=indent)


class _Sandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, where reaching for an unsafe attribute fails at once.

    Jinja's own gives an undefined value that fails only once used, so `{{ ''.__class__ }}`
    would print nothing: a template that tries is broken or hostile, and is told so.
    """

    def unsafe_undefined(self, obj: Any, attribute: str) -> Undefined:
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__} is unsafe")


# trim_blocks and lstrip_blocks as Hugging Face renders templates: a block tag's own line leaves no blank.
_ENV = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
_ENV.globals["raise_exception"] = _raise_exception
_ENV.filters["tojson"] = _tojson


class ChatTemplate:
    """A Jinja chat template from `source` (a file named in every error), compiled once."""

    def __init__(self, text: str, source: str, bos_token: str = "", eos_token: str = "") -> None:
        self.text, self.source = text, source
        self._tokens = {"bos_token": bos_token, "eos_token": eos_token}
        try:
            self._template = _ENV.from_string(text)
        except TemplateError as exc:
            line = getattr(exc, "lineno", None)
            where = f" (line {line})" if line else ""
            raise ValueError(f"{source}: the chat template does not parse{where}: {exc}") from None

    def render(self, turns: Sequence[tuple[str, str]]) -> ChatPrompt:
        """The conversation, (role, content) in order, rendered ready for the assistant's answer."""
        if not turns:
            raise ValueError("a chat needs at least one message")
        for i, (role, _) in enumerate(turns):
            # The role is written into a template part: only a known one may get there.
            if role not in ROLES:
                raise ValueError(f"message {i}: role {role!r} is not one of {', '.join(ROLES)}")
        nonce = secrets.token_hex(8)
        marks = [f"\ue000{nonce}:{i}\ue001" for i in range(len(turns))]  # private-use characters
        real = self._render(turns)
        shape = self._render([(role, mark) for (role, _), mark in zip(turns, marks, strict=True)])
        contents = {mark: content for mark, (_, content) in zip(marks, turns, strict=True)}
        return ChatPrompt(self._parts(real, shape, contents))

    def _render(self, turns: Sequence[tuple[str, str]]) -> str:
        messages = [{"role": role, "content": content} for role, content in turns]
        try:
            return self._template.render(messages=messages, add_generation_prompt=True, **self._tokens)
        except _Refused as exc:
            raise ValueError(f"{self.source}: the chat template refuses these messages: {exc}") from None
        except Exception as exc:  # the template is a file's code: whatever it raises is its failure
            why = str(exc) if isinstance(exc, TemplateError) else f"{type(exc).__name__}: {exc}"
            raise ValueError(f"{self.source}: the chat template failed to render: {why}") from None

    def _parts(self, real: str, shape: str, contents: dict[str, str]) -> list[tuple[str, bool]]:
        """`real` cut into (text, is_template) parts where `shape` has the template's text and marks."""
        pieces = re.split("(" + "|".join(map(re.escape, contents)) + ")", shape)
        parts: list[tuple[str, bool]] = []
        pos = 0
        for i, piece in enumerate(pieces):
            if i % 2 == 0:  # the template's text: the real rendering has it here too
                if not real.startswith(piece, pos):
                    break
                parts.append((piece, True))
                pos += len(piece)
                continue
            after = pieces[i + 1]
            content = contents[piece]
            said = next((c for c in (content, content.strip()) if real.startswith(c + after, pos)), None)
            if said is None:
                break
            parts.append((said, False))
            pos += len(said)
        else:
            if pos == len(real):
                return parts
        raise ValueError(
            f"{self.source}: the chat template changes the messages' text, so it cannot be told apart "
            "from the template's own (whose control tokens it must not spell): use another chat template"
        )
