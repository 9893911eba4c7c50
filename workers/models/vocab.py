"""A GGUF file's vocabulary as a `tokenizers` pipeline: byte-level BPE or SentencePiece-style.

Byte-level BPE (`tokenizer.ggml.model = "gpt2"`) cuts text with the regexes
its pre-tokenizer type names (`tokenizer.ggml.pre`, the PRE_TOKENIZERS table,
as llama.cpp reads them) before merging. A type not in the table is refused:
another type's regex would give other tokens than the model was trained on.

SentencePiece-style (`"llama"`: Llama 2, Gemma) merges, over the whole text
with spaces written as "▁", the adjacent pair whose merged piece scores
highest, as llama.cpp's SPM tokenizer does; a character no piece holds comes
out as its UTF-8 bytes (`<0xNN>` tokens). That is a BPE whose merges are every
pair of pieces that make a piece, ranked by the merged piece's score.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import repeat
from operator import itemgetter, methodcaller

import numpy as np
from tokenizers import AddedToken, Regex, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "▁"  # how SentencePiece writes a space inside a piece
BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")

# GPT-2's word regex; llama.cpp's types that are GPT-2's plus a rule or two add those before it.
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# Llama 3's and Qwen 2's: contractions in either case, a letter run taking one non-letter before it,
# numbers in runs of at most three digits (Llama 3) or one (Qwen 2), newlines kept with what precedes.
LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")


@dataclass(frozen=True)
class Pre:
    """How one pre-tokenizer type cuts text before BPE merges its pieces.

    splits: regexes applied in turn, each cutting every piece further; what a regex
        does not match stays a piece of its own, as in llama.cpp's regex_exprs.
    ignore_merges: a piece that is a token whole is that token, merges not tried (Llama 3).
    add_bos: whether a prompt starts with BOS when the file has no add_bos_token key.
    """

    splits: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


_DIGITS_FIRST = Pre((r"\p{N}", GPT2))  # each digit a piece of its own, then GPT-2's words
_LLAMA3 = Pre((LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2 = Pre((QWEN2,))
# tokenizer.ggml.pre → its pre-tokenizer. "default" is what llama.cpp uses for a file without the key.
PRE_TOKENIZERS: dict[str, Pre] = {
    "default": Pre((r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")),
    "gpt2": Pre((GPT2,)),
    "gpt-2": Pre((GPT2,)),
    "smollm": _DIGITS_FIRST,
    "starcoder": _DIGITS_FIRST,
    "refact": _DIGITS_FIRST,
    "command-r": _DIGITS_FIRST,
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
}


def byte_level_bpe(tokens: list[str], merges: list[str], pre: Pre) -> HFTokenizer:
    """The byte-level BPE of `tokens` and `merges` ("a b" each), cutting text as `pre` says."""
    pairs = [tuple(m.split(" ")) for m in merges]
    if any(len(pair) != 2 for pair in pairs):
        raise ValueError("tokenizer merges must be pairs 'a b'")
    vocab = {token: i for i, token in enumerate(tokens)}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre.ignore_merges))
    cuts = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.splits]
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [*cuts, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    return hf


def sentencepiece(
    tokens: list[str], scores: list[float], types: list[int], add_space_prefix: bool
) -> HFTokenizer:
    """The SentencePiece-style tokenizer of `tokens`: highest-scoring merge first, byte fallback."""
    vocab = {token: i for i, token in enumerate(tokens)}
    unk = next((t for t, kind in zip(tokens, types, strict=True) if kind == UNKNOWN), None)
    model = models.BPE(
        vocab=vocab, merges=spm_merges(tokens, scores, types), byte_fallback=True, unk_token=unk
    )
    hf = HFTokenizer(model)
    spaces = normalizers.Replace(" ", SPACE)
    # Every run of text gets the prefix: the first and each one after a token matched whole, as llama.cpp.
    hf.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), spaces]) if add_space_prefix else spaces
    return hf


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Each pair of pieces that joins into a normal piece, the highest-scoring joined piece first.

    Pieces of equal score rank by id (llama.cpp would merge the leftmost pair of them first).
    """
    get = dict(zip(tokens, range(len(tokens)), strict=True)).get
    names = np.array(tokens, dtype=object)
    lengths = np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens))
    pieces = np.flatnonzero((np.asarray(types) == NORMAL) & (lengths > 1))
    joined, lefts, rights = [], [], []
    # One cut place at a time over every piece long enough, the slicing and look-ups done by map()
    # rather than a loop of ours: Gemma 3's 262,144 pieces have 1.2 million places to cut.
    for cut in range(1, int(lengths.max(initial=0))):
        pieces = pieces[lengths[pieces] > cut]
        left = _ids(get, map(itemgetter(slice(None, cut)), names[pieces]), len(pieces))
        at, left = pieces[left >= 0], left[left >= 0]
        right = _ids(get, map(itemgetter(slice(cut, None)), names[at]), len(at))
        joined.append(at[right >= 0])
        lefts.append(left[right >= 0])
        rights.append(right[right >= 0])
    at, left, right = (np.concatenate([np.empty(0, np.int64), *parts]) for parts in (joined, lefts, rights))
    # lexsort: the last key first. Gemma 3's ~500k merges are sorted in numpy, not as tuples.
    order = np.lexsort((left, at, -np.asarray(scores, dtype=np.float64)[at]))
    return list(zip(names[left[order]].tolist(), names[right[order]].tolist(), strict=True))


def _ids(get: Callable[[str, int], int], texts: Iterator[str], n: int) -> np.ndarray:
    """The id of each of the `n` texts, -1 for one that is no piece."""
    return np.fromiter(map(get, texts, repeat(-1)), dtype=np.int64, count=n)


# Tokens llama.cpp makes control tokens by their text, whatever type the file gives them: its list of
# tokens that end a generation, and its fill-in-the-middle markers (those it takes only when the file
# names none of their kind: the files that spell them name that same token). A user-defined "</s>"
# (Gemma 3's) is then text like any other, never matched whole.
CONTROL_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
    "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
    "<|code_prefix|>", "<|prefix|>", "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>",
    "<SUF>", "▁<SUF>", "<|code_suffix|>", "<|suffix|>", "<|fim_middle|>", "<fim-middle>", "<fim_middle>",
    "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>", "<|middle|>", "<|fim_pad|>", "<fim-pad>",
    "<fim_pad>", "<PAD>", "[PAD]", "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>",
    "<|file_sep|>",
})  # fmt: skip
# gpt-oss's message markers, which llama.cpp matches in any text whatever type the file gives them.
USER_DEFINED_TEXTS = frozenset({"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"})


def llamacpp_types(tokens: list[str], types: list[int]) -> list[int]:
    """The token types llama.cpp matches text with: some tokens it retypes by their text.

    The end and fill-in-the-middle markers of CONTROL_TEXTS become control tokens, gpt-oss's markers
    user-defined; and two exceptions of its own: "<|end|>" is user-defined beside "<|return|>" and
    "<|call|>" (or "<|calls|>" and "<|flush|>"), where it ends a message but not the generation, and
    "</s>" is normal beside Gemma 4's "<|tool_response>".
    """
    present = set(tokens)
    out = list(types)
    for token in present & CONTROL_TEXTS:  # a few: each found by a scan at C speed
        out[tokens.index(token)] = CONTROL
    for token in present & USER_DEFINED_TEXTS:
        out[tokens.index(token)] = USER_DEFINED
    for pair in (("<|return|>", "<|call|>"), ("<|calls|>", "<|flush|>")):
        if "<|end|>" in present and present.issuperset(pair):
            out[tokens.index("<|end|>")] = USER_DEFINED
    if "<|tool_response>" in present and "</s>" in present:
        out[tokens.index("</s>")] = NORMAL
    return out


def add_matched_whole(hf: HFTokenizer, tokens: list[str], types: list[int]) -> dict[str, int]:
    """Match user-defined tokens in any text and make control tokens special; the control tokens by text.

    User-defined tokens are matched wherever they are spelled, as llama.cpp does; control
    tokens are never matched in text (encode_special_tokens): only the template places them.
    The types are first those llama.cpp gives them (llamacpp_types).
    """
    kinds = list(zip(tokens, llamacpp_types(tokens, types), strict=True))
    hf.add_tokens([AddedToken(t, normalized=False) for t, kind in kinds if kind == USER_DEFINED])
    control = {t: i for i, (t, kind) in enumerate(kinds) if kind == CONTROL}
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    hf.encode_special_tokens = True
    return control


def _gpt2_byte_decoder() -> dict[str, int]:
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


def byte_level_bytes(tokens: list[str], types: list[int]) -> list[bytes]:
    """The bytes each byte-level BPE token stands for (a token matched whole is its own text)."""
    stand_in = _gpt2_byte_decoder()
    return [
        t.encode()
        if kind in (CONTROL, USER_DEFINED) or any(c not in stand_in for c in t)
        else bytes(stand_in[c] for c in t)
        for t, kind in zip(tokens, types, strict=True)
    ]


def sentencepiece_bytes(tokens: list[str], types: list[int]) -> list[bytes]:
    """The bytes each SentencePiece-style token stands for: "▁" a space, `<0xNN>` its byte."""
    if len(types) != len(tokens):
        raise ValueError(f"{len(tokens)} tokens but {len(types)} token types")
    # Most are normal: all at once by map(), then the few others one by one.
    out = list(map(str.encode, map(methodcaller("replace", SPACE, " "), tokens)))
    for i in np.flatnonzero(~np.isin(np.asarray(types), (NORMAL, USER_DEFINED))).tolist():
        byte = BYTE_TOKEN.fullmatch(tokens[i]) if types[i] == BYTE else None
        out[i] = bytes([int(byte.group(1), 16)]) if byte else tokens[i].encode()
    return out
