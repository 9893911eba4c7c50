"""Small GGUF files carrying each kind of tokenizer, written with gguf's writer.

`splitting_bpe` is a byte-level BPE vocabulary whose merges join any run of
characters of the texts it is made for, so that BPE merges each piece the
pre-tokenizer cuts into one token: its tokens show exactly where the cuts are.
`tiny_spm` is a SentencePiece-style vocabulary with scores and byte-fallback
tokens. `write_vocab` writes either, with or without a tiny llama's weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import islice, product
from pathlib import Path
from typing import Any

import gguf

from tests.support.tiny_gguf import TinyLlama, tiny_weights

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6


@dataclass
class Vocab:
    """What a GGUF file says about its tokenizer.

    model: "gpt2" or "llama"; pre: tokenizer.ggml.pre (None: no key). keys: the
    other tokenizer keys by their writer's method (add_bos_token_id=..., ...).
    """

    model: str
    tokens: list[str]
    types: list[int]
    merges: list[str] = field(default_factory=list)
    scores: list[float] | None = None
    pre: str | None = None
    keys: dict[str, Any] = field(default_factory=dict)

    def id(self, token: str) -> int:
        return self.tokens.index(token)


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in chars)
    chars |= {b: chr(256 + i) for i, b in enumerate(shifted)}
    return [chars[b] for b in range(256)]


def byte_level(text: str) -> str:
    """`text` as byte-level BPE writes it: each UTF-8 byte as its stand-in character."""
    chars = _byte_chars()
    return "".join(chars[b] for b in text.encode())


def splitting_bpe(texts: list[str], pre: str | None, control: tuple[str, ...] = ()) -> Vocab:
    """A byte-level BPE vocabulary: every byte, every run of characters of `texts`, then `control`.

    Every split of every run is a merge, shorter results first, so whatever pieces
    the pre-tokenizer cuts a text into, BPE joins each piece whole into one token.
    """
    tokens = _byte_chars()
    runs: dict[str, None] = {}
    for text in texts:
        s = byte_level(text)
        for i in range(len(s)):
            for j in range(i + 2, len(s) + 1):
                if s[i:j] not in control:  # a control token's text is never merged into from text
                    runs.setdefault(s[i:j])
    merges = sorted(
        {(run[:k], run[k:]) for run in runs for k in range(1, len(run))}, key=lambda m: (len(m[0] + m[1]), m)
    )
    tokens += list(runs)  # runs are two characters or more: none is a byte's
    types = [NORMAL] * len(tokens) + [CONTROL] * len(control)
    return Vocab("gpt2", [*tokens, *control], types, [f"{a} {b}" for a, b in merges], pre=pre)


BYTES = [f"<0x{b:02X}>" for b in range(256)]


def tiny_spm(pieces: dict[str, float], control: tuple[str, ...] = ("<s>", "</s>"), **keys: Any) -> Vocab:
    """A SentencePiece-style vocabulary: <unk>, `control`, the 256 byte tokens, then `pieces` (with scores).

    Laid out as Llama 2's: <unk> 0, <s> 1, </s> 2 (llama.cpp's defaults for BOS and EOS).
    """
    tokens = ["<unk>", *control, *BYTES, *pieces]
    types = [UNKNOWN] + [CONTROL] * len(control) + [BYTE] * len(BYTES) + [NORMAL] * len(pieces)
    scores = [0.0] * (1 + len(control) + len(BYTES)) + list(pieces.values())
    return Vocab("llama", tokens, types, scores=scores, keys=keys)


LETTERS = "abcdefghijklmnopqrstuvwxyz▁"


def letter_pieces(n: int) -> dict[str, float]:
    """n pieces: every string of 27 letters up to four long, the shorter first, scored in that order.

    Each piece joins from every split of it, as in a real vocabulary: as many merges as pieces allow.
    """
    strings = ("".join(p) for length in range(1, 5) for p in product(LETTERS, repeat=length))
    return {piece: -float(i) for i, piece in enumerate(islice(strings, n))}


def write_vocab(path: Path, vocab: Vocab, t: TinyLlama | None = None) -> Path:
    """Write a llama GGUF holding `vocab`, and the tiny model `t`'s weights when given (else none)."""
    w = gguf.GGUFWriter(path, arch="llama")
    shape = t or TinyLlama()
    w.add_block_count(shape.n_layers)
    w.add_context_length(shape.context_length)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.n_heads)
    w.add_head_count_kv(shape.n_kv_heads)
    w.add_layer_norm_rms_eps(shape.eps)
    w.add_tokenizer_model(vocab.model)
    if vocab.pre is not None:
        w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    if vocab.merges:
        w.add_token_merges(vocab.merges)
    if vocab.scores is not None:
        w.add_token_scores(vocab.scores)
    for key, value in vocab.keys.items():
        getattr(w, f"add_{key}")(value)
    for name, value in (tiny_weights(t) if t is not None else {}).items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
