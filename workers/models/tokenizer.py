"""The byte-level BPE tokenizer stored in a GGUF file, built with `tokenizers`.

Pre-tokenization follows GPT-2 (the byte-level regex) with each digit split
on its own first, which is what llama.cpp's "smollm" (and "starcoder",
"refact", ...) pre-tokenizer types do; other types fall back to plain GPT-2.

Control tokens (`<|im_start|>`, ...) are never read out of text: a prompt that
spells one is tokenized as the characters it is. They come only from the
template parts of a `ChatPrompt`, so a user cannot open a turn of their own.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Sequence
from pathlib import Path

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from workers.models.gguf_file import GGUFError, open_gguf, read_arrays

# tokenizer.ggml.token_type values of tokens matched whole, before BPE
CONTROL, USER_DEFINED = 3, 4
ROLES = ("system", "user", "assistant")  # the turns a chat prompt may hold
SPLIT_DIGITS = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in chars)
    chars |= {b: chr(256 + i) for i, b in enumerate(shifted)}
    return {c: b for b, c in chars.items()}


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


class Tokenizer:
    """Text to token ids and back, for one GGUF file's vocabulary."""

    def __init__(
        self,
        tokens: list[str],
        merges: list[str],
        token_types: list[int],
        pre: str,
        eos_id: int,
        chat_template: str | None = None,
    ) -> None:
        vocab = {token: i for i, token in enumerate(tokens)}
        pairs = [tuple(m.split(" ")) for m in merges]
        if any(len(pair) != 2 for pair in pairs):
            raise ValueError("tokenizer merges must be pairs 'a b'")
        self._hf = HFTokenizer(models.BPE(vocab=vocab, merges=pairs))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre in SPLIT_DIGITS:
            self._hf.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level]
            )
        else:
            self._hf.pre_tokenizer = byte_level
        self._hf.decoder = decoders.ByteLevel()
        # User-defined tokens are matched in any text, as llama.cpp does; control tokens
        # are special and, with encode_special_tokens, never matched in text.
        user_defined = [t for t, kind in zip(tokens, token_types, strict=True) if kind == USER_DEFINED]
        self._hf.add_tokens([AddedToken(t, normalized=False) for t in user_defined])
        self._control = {
            t: i for i, (t, kind) in enumerate(zip(tokens, token_types, strict=True)) if kind == CONTROL
        }
        self._hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in self._control])
        self._hf.encode_special_tokens = True
        by_length = sorted(self._control, key=len, reverse=True)  # the longest marker wins
        self._markers = re.compile("(" + "|".join(map(re.escape, by_length)) + ")") if by_length else None
        self.eos_id = eos_id
        self.chat_template = chat_template
        self.vocab_size = len(tokens)
        stand_in = _byte_decoder()
        self._bytes = [
            t.encode()
            if kind in (CONTROL, USER_DEFINED) or any(c not in stand_in for c in t)
            else bytes(stand_in[c] for c in t)
            for t, kind in zip(tokens, token_types, strict=True)
        ]

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no BOS is added); control tokens only from a ChatPrompt's template."""
        if not isinstance(text, ChatPrompt):
            return self._hf.encode(text, add_special_tokens=False).ids
        ids: list[int] = []
        run = ""  # text between two markers is encoded in one piece, as when parsed whole
        for part, is_template in text.parts:
            pieces = self._markers.split(part) if is_template and self._markers else [part]
            for i, piece in enumerate(pieces):
                if i % 2:  # split() puts the captured markers at odd indices
                    ids += [*self.encode(run), self._control[piece]]
                    run = ""
                else:
                    run += piece
        return ids + self.encode(run)

    def decode(self, ids: list[int]) -> str:
        """The text of token ids, special tokens included as written."""
        return self._hf.decode(list(ids), skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token `token_id` stands for (possibly part of a UTF-8 character)."""
        return self._bytes[token_id]

    def chat(self, text: str) -> ChatPrompt:
        """`text` as one user turn in the model's ChatML template, ready for the assistant's answer."""
        return self.chat_turns([("user", text)])

    def chat_turns(self, turns: Sequence[tuple[str, str]]) -> ChatPrompt:
        """A conversation, (role, content) turns in order, in the ChatML template, ready for the answer.

        Roles are system, user and assistant. A conversation that does not open
        with a system turn gets the template's default one, as the template does.
        """
        template = self.chat_template or ""
        if "<|im_start|>" not in template or not {"<|im_start|>", "<|im_end|>"} <= self._control.keys():
            raise ValueError("this model has no ChatML chat template; send the prompt as raw text")
        if not turns:
            raise ValueError("a chat needs at least one message")
        parts: list[tuple[str, bool]] = []
        default_system = re.search(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", template, re.S)
        if turns[0][0] != "system" and default_system:
            parts.append((f"<|im_start|>system\n{default_system.group(1)}<|im_end|>\n", True))
        for i, (role, content) in enumerate(turns):
            # The role is written into a template part: only a known one may get there.
            if role not in ROLES:
                raise ValueError(f"message {i}: role {role!r} is not one of {', '.join(ROLES)}")
            parts += [(f"<|im_start|>{role}\n", True), (content, False), ("<|im_end|>\n", True)]
        return ChatPrompt([*parts, ("<|im_start|>assistant\n", True)])

    def stream(self) -> StreamDecoder:
        """A decoder that turns tokens into text as they arrive."""
        return StreamDecoder(self)


class StreamDecoder:
    """Decode one token at a time, holding back a UTF-8 character split across tokens."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """The text completed by this token (possibly empty)."""
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """Whatever is held back at the end, as replacement characters."""
        return self._utf8.decode(b"", final=True)


def load_tokenizer(path: Path | str) -> Tokenizer:
    """Build the tokenizer of the GGUF file at `path`."""
    arrays = read_arrays(
        path, ["tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"]
    )
    file = open_gguf(path)  # parsed by read_arrays already
    kind = file.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(
            f"{file.path}: tokenizer model {kind!r} is not supported; only byte-level BPE ('gpt2') is"
        )
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        if key not in arrays:
            raise GGUFError(f"{file.path}: metadata key {key!r} is missing")
    tokens = arrays["tokenizer.ggml.tokens"]
    types = arrays.get("tokenizer.ggml.token_type", [1] * len(tokens))
    if len(types) != len(tokens):
        raise GGUFError(f"{file.path}: {len(tokens)} tokens but {len(types)} token types")
    return Tokenizer(
        tokens,
        arrays["tokenizer.ggml.merges"],
        types,
        pre=str(file.get("tokenizer.ggml.pre", "default")),
        eos_id=int(file.get("tokenizer.ggml.eos_token_id")),
        chat_template=file.get("tokenizer.chat_template", None),
    )
