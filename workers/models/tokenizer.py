"""The tokenizer stored in a GGUF file: its vocabulary, BOS, end tokens and chat template.

The vocabulary is byte-level BPE or SentencePiece-style (workers.models.vocab);
the chat template is the file's own or one the operator names
(workers.models.chat). A file without a template serves no chat: no
template is assumed, since another model's would prompt this one wrongly.

Control tokens (`<|im_start|>`, ...) are never read out of text: a prompt that
spells one is tokenized as the characters it is. They come only from the
template parts of a `ChatPrompt`, so a user cannot open a turn of their own.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from workers.models.chat import ROLES, ChatPrompt, ChatTemplate
from workers.models.gguf_file import GGUFError, GGUFFile, open_gguf, read_arrays
from workers.models.vocab import (
    CONTROL,
    PRE_TOKENIZERS,
    USER_DEFINED,
    add_matched_whole,
    byte_level_bpe,
    byte_level_bytes,
    sentencepiece,
    sentencepiece_bytes,
)

__all__ = ["CONTROL", "ROLES", "USER_DEFINED", "ChatPrompt", "StreamDecoder", "Tokenizer", "load_tokenizer"]

MODELS = ("gpt2", "llama")  # tokenizer.ggml.model: byte-level BPE, SentencePiece-style
# Tokens that end a generation by their text, whatever the file's keys say, as llama.cpp marks them:
# each family's end of turn (ChatML, Llama 3, Gemma, Phi) and of text.
END_TEXTS = frozenset({
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>",
    "<|end_of_text|>", "<EOT>", "<end_of_utterance>", "<|return|>", "<|call|>", "</s>", "<eos>",
})  # fmt: skip
# Keys whose token ends a generation.
END_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
BOS_KEY = "tokenizer.ggml.bos_token_id"


class Tokenizer:
    """Text to token ids and back, for one GGUF file's vocabulary.

    model: "gpt2" (byte-level BPE over `merges`, cut as the pre-tokenizer type `pre`
        says) or "llama" (SentencePiece-style over `scores`).
    eos_id, bos_id: the file's end- and begin-of-sequence tokens, if it names them.
    add_bos: whether a prompt starts with BOS (`prompt_ids`); None for the model's default.
    add_space_prefix: SentencePiece-style only: a space before each run of text (default yes).
    end_ids: other tokens that end a generation (eot, eom).
    chat_template: the Jinja template's text, if any. name: the file, in errors; template_name:
        the template's file when it is not the vocabulary's.
    """

    def __init__(
        self,
        tokens: list[str],
        merges: list[str],
        token_types: list[int],
        pre: str = "default",
        eos_id: int | None = None,
        chat_template: str | None = None,
        *,
        model: str = "gpt2",
        scores: list[float] | None = None,
        bos_id: int | None = None,
        add_bos: bool | None = None,
        add_space_prefix: bool | None = None,
        end_ids: Sequence[int] = (),
        name: str = "the tokenizer",
        template_name: str = "",
    ) -> None:
        self.name, self.model, self.vocab_size = name, model, len(tokens)
        self._hf, self._bytes, default_bos, self._space_prefix = _vocabulary(
            tokens, merges, token_types, pre, model, scores, add_space_prefix, name
        )
        self._control = add_matched_whole(self._hf, tokens, token_types)
        self._markers = Markers(self._control)
        self.eos_id, self.bos_id = eos_id, bos_id
        self.add_bos = default_bos if add_bos is None else add_bos
        if self.add_bos and bos_id is None:
            raise ValueError(f"{name}: the prompt should start with BOS but the file names no bos_token_id")
        self.end_ids = _end_ids(tokens, [*end_ids, *([eos_id] if eos_id is not None else [])])
        bos_text = "" if bos_id is None else tokens[bos_id]
        eos_text = "" if eos_id is None else tokens[eos_id]
        source = template_name or f"{name} (tokenizer.chat_template)"
        self.chat_template = (
            None if chat_template is None else ChatTemplate(chat_template, source, bos_text, eos_text)
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no BOS is added); control tokens only from a ChatPrompt's template."""
        if not isinstance(text, ChatPrompt):
            return self._hf.encode(text, add_special_tokens=False).ids
        ids: list[int] = []
        run = ""  # text between two markers is encoded in one piece, as when parsed whole
        for part, is_template in text.parts:
            pieces = self._markers.split(part) if is_template else [part]
            for i, piece in enumerate(pieces):
                if i % 2:  # split() puts the captured markers at odd indices
                    ids += [*self.encode(run), self._control[piece]]
                    run = ""
                else:
                    run += piece
        return ids + self.encode(run)

    def prompt_ids(self, text: str) -> list[int]:
        """The ids a prompt is fed as: BOS first when the file says so (once: a template may write it)."""
        ids = self.encode(text)
        if self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: list[int]) -> str:
        """The text of token ids, special tokens included as written."""
        text = b"".join(self.token_bytes(i) for i in ids).decode(errors="replace")
        # The space a SentencePiece-style vocabulary put before the text is not the text's.
        return text[1:] if self._space_prefix and text.startswith(" ") else text

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token `token_id` stands for (possibly part of a UTF-8 character)."""
        return self._bytes[token_id]

    def chat(self, text: str) -> ChatPrompt:
        """`text` as one user turn in the model's chat template, ready for the assistant's answer."""
        return self.chat_turns([("user", text)])

    def chat_turns(self, turns: Sequence[tuple[str, str]]) -> ChatPrompt:
        """A conversation, (role, content) turns in order, in the model's chat template, ready for the answer.

        Roles are system, user and assistant. A ValueError, saying what to do, for a
        model without a template, or messages its template cannot hold.
        """
        if self.chat_template is None:
            raise ValueError(
                f"{self.name} has no chat template (no tokenizer.chat_template in the file), so it "
                "takes no chat: send the prompt as raw text, or name a template with --chat-template FILE "
                "(chat_template in the cluster's config)"
            )
        return self.chat_template.render(turns)

    def stream(self) -> StreamDecoder:
        """A decoder that turns tokens into text as they arrive."""
        return StreamDecoder(self)


def _end_ids(tokens: list[str], named: list[int]) -> frozenset[int]:
    """The tokens `named` by the file's keys, and those whose text ends a turn or a text."""
    spelled = {t: i for i, t in enumerate(tokens) if t in END_TEXTS}
    if "<|return|>" in spelled and "<|call|>" in spelled:
        # gpt-oss ends a message with <|end|> and goes on in another channel: only return and call end it.
        del spelled["<|end|>"]
    return frozenset([*spelled.values(), *named])


def _vocabulary(
    tokens: list[str],
    merges: list[str],
    types: list[int],
    pre: str,
    model: str,
    scores: list[float] | None,
    add_space_prefix: bool | None,
    name: str,
) -> tuple[HFTokenizer, list[bytes], bool, bool]:
    """The `tokenizers` pipeline of a vocabulary, each token's bytes, and whether BOS and a space lead."""
    if len(set(tokens)) != len(tokens):  # one set at C speed; the loop only to name the token
        seen: set[str] = set()
        for token in tokens:
            if token in seen:
                raise ValueError(f"{name}: token {token!r} is in the vocabulary twice")
            seen.add(token)
    if model == "gpt2":
        if pre not in PRE_TOKENIZERS:
            known = ", ".join(PRE_TOKENIZERS)
            raise ValueError(f"{name}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported: {known}")
        how = PRE_TOKENIZERS[pre]
        return byte_level_bpe(tokens, merges, how), byte_level_bytes(tokens, types), how.add_bos, False
    if model == "llama":
        if scores is None or len(scores) != len(tokens):
            raise ValueError(f"{name}: a SentencePiece-style vocabulary needs a score for each token")
        space = True if add_space_prefix is None else add_space_prefix  # llama.cpp's default: a space
        # llama.cpp adds BOS to prompts of SentencePiece vocabularies unless the file says not to.
        return sentencepiece(tokens, scores, types, space), sentencepiece_bytes(tokens, types), True, space
    raise ValueError(f"{name}: tokenizer model {model!r} is not supported: {', '.join(MODELS)}")


class Markers:
    """Find control tokens spelled in a template's text: at the leftmost place one starts, the longest.

    A regex of every marker would do it, but Gemma 3's 6,249 control tokens take a regex most of
    a second to compile; looking up the few lengths they have at each place takes no time to build.
    """

    def __init__(self, markers: Sequence[str]) -> None:
        self._markers = frozenset(m for m in markers if m)
        self._lengths = sorted({len(m) for m in self._markers}, reverse=True)  # the longest marker wins
        self._firsts = frozenset(m[0] for m in self._markers)

    def split(self, text: str) -> list[str]:
        """`text` cut around the markers in it, as re.split with a group: text, marker, text, ..., text."""
        pieces, start, at = [], 0, 0
        while at < len(text):
            found = text[at] in self._firsts and next(
                (text[at : at + n] for n in self._lengths if text[at : at + n] in self._markers), None
            )
            if found:
                pieces += [text[start:at], found]
                at = start = at + len(found)
            else:
                at += 1
        return [*pieces, text[start:]]


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


def load_tokenizer(path: Path | str, chat_template: str | None = None, template_name: str = "") -> Tokenizer:
    """Build the tokenizer of the GGUF file at `path`.

    chat_template: a template to use instead of the file's (`template_name` names it in errors).
    """
    keys = [
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.scores",
    ]
    arrays = read_arrays(path, keys)
    file = open_gguf(path)  # parsed by read_arrays already
    model = file.get("tokenizer.ggml.model")
    if model not in MODELS:
        raise GGUFError(
            f"{file.path}: tokenizer model {model!r} is not supported; these are: {', '.join(MODELS)}"
        )
    needed = ["tokenizer.ggml.tokens", *(["tokenizer.ggml.merges"] if model == "gpt2" else [])]
    for key in needed:
        if key not in arrays:
            raise GGUFError(f"{file.path}: metadata key {key!r} is missing")
    tokens = arrays["tokenizer.ggml.tokens"]
    types = arrays.get("tokenizer.ggml.token_type", [1] * len(tokens))
    scores = arrays.get("tokenizer.ggml.scores", [0.0] * len(tokens))
    for key, values in (("tokenizer.ggml.token_type", types), ("tokenizer.ggml.scores", scores)):
        if len(values) != len(tokens):
            raise GGUFError(f"{file.path}: {len(tokens)} tokens but {len(values)} in {key}")
    ids = {key: _token_id(file, key, len(tokens), model) for key in (*END_KEYS, BOS_KEY)}
    if chat_template is None:
        chat_template, template_name = file.get("tokenizer.chat_template", None), ""
    try:
        return Tokenizer(
            tokens, arrays.get("tokenizer.ggml.merges", []), types,
            pre=str(file.get("tokenizer.ggml.pre", "default")), eos_id=ids[END_KEYS[0]],
            chat_template=chat_template, model=model, scores=scores, bos_id=ids[BOS_KEY],
            add_bos=file.get("tokenizer.ggml.add_bos_token", None),
            add_space_prefix=file.get("tokenizer.ggml.add_space_prefix", None),
            end_ids=[i for key in END_KEYS[1:] if (i := ids[key]) is not None],
            name=str(file.path), template_name=template_name,
        )  # fmt: skip
    except ValueError as exc:  # named the file already
        raise GGUFError(str(exc)) from None


def _token_id(file: GGUFFile, key: str, n_tokens: int, model: str) -> int | None:
    """The token `key` names, else llama.cpp's default for a SentencePiece-style vocabulary (BOS 1, EOS 2)."""
    default = {BOS_KEY: 1, END_KEYS[0]: 2}.get(key) if model == "llama" else None
    value = file.get(key, default)
    if value is None:
        return None
    if not (isinstance(value, int) and 0 <= value < n_tokens):
        raise GGUFError(f"{file.path}: {key} = {value!r} is not a token of the {n_tokens} in the vocabulary")
    return value
