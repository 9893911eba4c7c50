"""Vocabularies from GGUF files: each pre-tokenizer's cuts, SentencePiece-style merges, BOS and end tokens."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.tiny_vocab import Vocab, letter_pieces, splitting_bpe, tiny_spm, write_vocab
from workers.models.gguf_file import GGUFError
from workers.models.tokenizer import Markers, load_tokenizer
from workers.models.vocab import PRE_TOKENIZERS, llamacpp_types

TEXTS = ["it's you'RE", "12345 and x1y22", "ok 日本語のテキスト", "x\n\n  y", "f(hi)!\nno"]
# Each text cut as its pre-tokenizer's regexes say (worked out from the regexes, not from a run).
GPT2_CUTS = [
    ["it", "'s", " you", "'", "RE"],  # contractions in lower case only
    ["12345", " and", " x", "1", "y", "22"],  # a number whole
    ["ok", " 日本語のテキスト"],  # CJK is letters
    ["x", "\n\n ", " y"],  # whitespace up to the last before a word
    ["f", "(", "hi", ")!", "\n", "no"],
]
DIGITS_CUTS = [*GPT2_CUTS[:1], ["1", "2", "3", "4", "5", " and", " x", "1", "y", "2", "2"], *GPT2_CUTS[2:]]
LLAMA3_CUTS = [
    ["it", "'s", " you", "'RE"],  # contractions in either case
    ["123", "45", " and", " x", "1", "y", "22"],  # at most three digits
    ["ok", " 日本語のテキスト"],
    ["x", "\n\n", " ", " y"],  # newlines apart from the spaces after them
    ["f", "(hi", ")!\n", "no"],  # one non-letter before a word; newlines after punctuation
]
QWEN2_CUTS = [*LLAMA3_CUTS[:1], ["1", "2", "3", "4", "5", " and", " x", "1", "y", "2", "2"], *LLAMA3_CUTS[2:]]
DEFAULT_CUTS = [
    ["it", "'", "s", " you", "'", "RE"],  # punctuation apart first
    ["123", "45", " and", " x", "1", "y", "22"],  # then runs of three digits
    *GPT2_CUTS[2:],
]
CUTS = {
    "gpt2": GPT2_CUTS,
    "smollm": DIGITS_CUTS,
    "llama-bpe": LLAMA3_CUTS,
    "qwen2": QWEN2_CUTS,
    None: DEFAULT_CUTS,  # a file without tokenizer.ggml.pre: llama.cpp's "default"
}


@pytest.mark.parametrize("pre", CUTS)
def test_each_pre_tokenizer_cuts_text_where_its_regex_says(tmp_path, pre):
    vocab = splitting_bpe(TEXTS, pre, control=("<|bos|>",))
    vocab.keys = {"bos_token_id": vocab.id("<|bos|>")}
    tok = load_tokenizer(write_vocab(tmp_path / "bpe.gguf", vocab))
    for text, cuts in zip(TEXTS, CUTS[pre], strict=True):
        assert [tok.decode([i]) for i in tok.encode(text)] == cuts, text
        assert tok.decode(tok.encode(text)) == text


def test_the_table_holds_the_pre_tokenizers_of_smollm_llama_3_and_qwen_2():
    assert {"default", "gpt2", "smollm", "llama-bpe", "qwen2"} <= PRE_TOKENIZERS.keys()


def test_a_pre_tokenizer_not_in_the_table_is_refused_naming_it_the_file_and_the_known_ones(tmp_path):
    path = write_vocab(tmp_path / "odd.gguf", splitting_bpe(["ab"], "tekken"))
    with pytest.raises(GGUFError) as refused:
        load_tokenizer(path)
    said = str(refused.value)
    assert str(path) in said and "'tekken'" in said and "tokenizer.ggml.pre" in said
    assert all(name in said for name in ("gpt2", "smollm", "llama-bpe", "qwen2"))


def test_a_tokenizer_model_not_supported_is_refused_naming_it(tmp_path):
    vocab = splitting_bpe(["ab"], "gpt2")
    vocab.model = "bert"
    with pytest.raises(GGUFError, match=r"tokenizer model 'bert' is not supported; these are: gpt2, llama"):
        load_tokenizer(write_vocab(tmp_path / "bert.gguf", vocab))


def test_a_vocabulary_holding_a_token_twice_is_refused_naming_it(tmp_path):
    vocab = tiny_spm({"▁a": -1.0, "a": -2.0})
    vocab.tokens[-1] = "▁a"
    with pytest.raises(GGUFError, match=r"token '▁a' is in the vocabulary twice"):
        load_tokenizer(write_vocab(tmp_path / "twice.gguf", vocab))


# A SentencePiece-style vocabulary whose merges disagree with a left-to-right reading: "bc" scores over "ab".
PIECES = {
    "▁": -1.0, "a": -2.0, "b": -2.1, "c": -2.2, "d": -2.3, "ab": -4.0, "bc": -1.5, "abc": -6.0,
    "▁a": -3.0, "▁ab": -3.5, "cd": -5.0, "▁d": -4.5, "ca": -0.5, "▁b": -7.0,
}  # fmt: skip


def spm(tmp_path: Path, **keys) -> object:
    return load_tokenizer(write_vocab(tmp_path / "spm.gguf", tiny_spm(PIECES, **keys)))


def pieces(tok, text: str) -> list[str]:
    return [tok._hf.id_to_token(i) for i in tok.encode(text)]


def test_sentencepiece_merges_the_highest_scoring_pair_first(tmp_path):
    tok = spm(tmp_path, add_space_prefix=False)
    assert pieces(tok, "bca") == ["b", "ca"]  # ca (-0.5) before bc (-1.5), though bc comes first
    assert pieces(tok, "abd") == ["ab", "d"]
    assert pieces(tok, "abc") == ["abc"]  # by a, bc: bc (-1.5) before ab (-4)


def test_sentencepiece_writes_spaces_as_the_marker_and_prefixes_one_by_default(tmp_path):
    tok = spm(tmp_path)
    assert pieces(tok, "ab d") == ["▁ab", "▁d"]
    assert pieces(tok, "d") == ["▁d"]
    assert pieces(spm(tmp_path, add_space_prefix=False), "ab d") == ["ab", "▁d"]


def test_a_character_no_piece_holds_falls_back_to_its_utf8_bytes(tmp_path):
    tok = spm(tmp_path, add_space_prefix=False)
    assert pieces(tok, "aé😀") == ["a", "<0xC3>", "<0xA9>", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]


@pytest.mark.parametrize("prefix", [True, False])
@pytest.mark.parametrize("text", ["abc d", "  leading and trailing  ", "dé ça 😀\n\tab", "cabd", "x"])
def test_sentencepiece_text_round_trips_through_ids_and_streams_whole(tmp_path, text, prefix):
    tok = spm(tmp_path, add_space_prefix=prefix)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    stream = tok.stream()
    streamed = "".join(stream.push(i) for i in ids) + stream.flush()
    assert streamed == (" " + text if prefix else text)  # a continuation keeps the space it starts with


def reference_spm(vocab: Vocab, text: str, prefix: bool) -> list[int]:
    """What llama.cpp's SPM tokenizer does, written plainly: merge the best-scoring pair, leftmost on ties."""
    if not text:
        return []
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    symbols = list(("▁" if prefix else "") + text.replace(" ", "▁"))
    while True:
        scored = [
            (vocab.scores[ids[a + b]], -i) for i, (a, b) in enumerate(pairwise(symbols)) if a + b in ids
        ]
        if not scored:
            break
        i = -max(scored)[1]
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
    out: list[int] = []
    for s in symbols:
        out += [ids[s]] if s in ids else [ids[f"<0x{b:02X}>"] for b in s.encode()]
    return out


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="abcd é", max_size=24), prefix=st.booleans())
def test_sentencepiece_tokenizes_as_llama_cpps_algorithm_does(tmp_path_factory, text, prefix):
    vocab = tiny_spm(PIECES, add_space_prefix=prefix)
    path = tmp_path_factory.getbasetemp() / f"spm-{prefix}.gguf"
    if not path.exists():
        write_vocab(path, vocab)
    assert load_tokenizer(path).encode(text) == reference_spm(vocab, text, prefix)


def test_a_sentencepiece_file_prompts_with_bos_unless_it_says_not_to(tmp_path):
    assert spm(tmp_path).prompt_ids("ab") == [1, *spm(tmp_path).encode("ab")]  # llama.cpp's default, <s> = 1
    assert spm(tmp_path, add_bos_token=False).prompt_ids("ab")[0] != 1
    assert spm(tmp_path, bos_token_id=2, add_bos_token=True).prompt_ids("ab")[0] == 2


def bpe(tmp_path: Path, pre: str | None, **keys) -> object:
    vocab = splitting_bpe(["ab"], pre, control=("<|begin_of_text|>", "<|eot_id|>", "<|x|>"))
    vocab.keys = {"bos_token_id": vocab.id("<|begin_of_text|>"), **keys}
    return load_tokenizer(write_vocab(tmp_path / "bpe.gguf", vocab)), vocab


@pytest.mark.parametrize(("pre", "keys", "bos"), [
    ("gpt2", {}, False),  # byte-level BPE: no BOS unless the file says
    ("llama-bpe", {}, True),  # Llama 3: BOS by default, as llama.cpp does
    ("llama-bpe", {"add_bos_token": False}, False),
    ("smollm", {"add_bos_token": True}, True),
])  # fmt: skip
def test_a_bpe_prompt_starts_with_bos_as_the_file_and_its_pre_tokenizer_say(tmp_path, pre, keys, bos):
    tok, vocab = bpe(tmp_path, pre, **keys)
    ids = tok.prompt_ids("ab")
    assert (ids[0] == vocab.id("<|begin_of_text|>")) is bos and ids[bos:] == tok.encode("ab")


def test_bos_is_not_added_twice_when_the_template_wrote_it(tmp_path):
    tok, vocab = bpe(tmp_path, "llama-bpe", chat_template="{{ bos_token }}{{ messages[0]['content'] }}")
    assert tok.prompt_ids(tok.chat("ab")).count(vocab.id("<|begin_of_text|>")) == 1


def test_a_file_that_asks_for_bos_without_naming_one_is_refused(tmp_path):
    vocab = splitting_bpe(["ab"], "llama-bpe")
    with pytest.raises(GGUFError, match=r"should start with BOS but the file names no bos_token_id"):
        load_tokenizer(write_vocab(tmp_path / "nobos.gguf", vocab))


def test_the_end_tokens_are_eos_eot_eom_and_the_turn_ends_spelled_in_the_vocabulary(tmp_path):
    control = ("<s>", "</s>", "<end_of_turn>", "<|im_end|>", "<my_eot>", "<my_eom>", "<start_of_turn>")
    vocab = tiny_spm(PIECES, control=control)
    vocab.keys = {"eot_token_id": vocab.id("<my_eot>"), "eom_token_id": vocab.id("<my_eom>")}
    tok = load_tokenizer(write_vocab(tmp_path / "ends.gguf", vocab))
    ends = {"</s>", "<end_of_turn>", "<|im_end|>", "<my_eot>", "<my_eom>"}
    assert tok.end_ids == {vocab.id(t) for t in ends}
    assert tok.eos_id == vocab.id("</s>")  # llama.cpp's default for SentencePiece: 2


def test_end_is_no_end_where_the_vocabulary_also_has_return_and_call(tmp_path):
    vocab = tiny_spm(PIECES, control=("<s>", "</s>", "<|end|>", "<|return|>", "<|call|>"))
    tok = load_tokenizer(write_vocab(tmp_path / "harmony.gguf", vocab))
    assert tok.end_ids == {
        vocab.id(t) for t in ("</s>", "<|return|>", "<|call|>")
    }  # as llama.cpp for gpt-oss


def test_a_token_id_key_outside_the_vocabulary_is_refused_naming_it(tmp_path):
    vocab = tiny_spm(PIECES, eot_token_id=10_000)
    with pytest.raises(GGUFError, match=r"tokenizer.ggml.eot_token_id = 10000 is not a token of the"):
        load_tokenizer(write_vocab(tmp_path / "far.gguf", vocab))


def test_control_tokens_are_matched_only_in_a_template_and_user_defined_ones_anywhere(tmp_path):
    vocab = tiny_spm(PIECES, control=("<s>", "</s>", "<ctrl>"), add_space_prefix=False)
    vocab.tokens.append("<tag>")
    vocab.types.append(4)  # user-defined
    vocab.scores.append(0.0)
    tok = load_tokenizer(write_vocab(tmp_path / "ud.gguf", vocab))
    assert vocab.id("<ctrl>") not in tok.encode("a<ctrl>")
    assert tok.encode("a<tag>b") == [vocab.id("a"), vocab.id("<tag>"), vocab.id("b")]


def test_a_user_defined_token_llamacpp_takes_for_an_end_marker_is_text_where_it_is_spelled(tmp_path):
    # Gemma 3's file types "</s>" user-defined; llama.cpp makes it a control token by its text, as it
    # does every end and fill-in-the-middle marker, so a prompt spelling it gets its characters.
    vocab = tiny_spm(PIECES, control=("<s>", "<eos>"), add_space_prefix=False)
    for text in ("</s>", "<tag>"):
        vocab.tokens.append(text)
        vocab.types.append(4)  # user-defined
        vocab.scores.append(0.0)
    tok = load_tokenizer(write_vocab(tmp_path / "ud.gguf", vocab))
    assert vocab.id("</s>") not in tok.encode("a</s>b")
    assert tok.decode(tok.encode("a</s>b")) == "a</s>b"
    assert vocab.id("<tag>") in tok.encode("a<tag>b")  # a user-defined token of no such list: matched


def test_gpt_oss_message_markers_are_matched_in_text_and_end_is_no_marker_beside_return_and_call():
    tokens = ["a", "<|start|>", "<|end|>", "<|return|>", "<|call|>", "</s>"]
    types = [1, 3, 3, 3, 3, 1]
    assert llamacpp_types(tokens, types) == [1, 4, 4, 3, 3, 3]
    assert llamacpp_types([*tokens, "<|tool_response>"], [*types, 3])[5] == 1  # Gemma 4 keeps "</s>" text


def test_a_templates_markers_are_found_leftmost_then_longest_as_the_regex_found_them():
    markers = Markers(["<a>", "<a><b>", "<b>", "x"])
    assert markers.split("<a><b>c<b>x<a>") == ["", "<a><b>", "c", "<b>", "", "x", "", "<a>", ""]
    assert markers.split("no marker <a") == ["no marker <a"]
    assert markers.split("") == [""]


# Pieces of a vocabulary whose merges are as dense as a real one's (every split of a piece joins);
# its load time at Gemma 3's 262,144 pieces is a figure of `make bench` (bench/tokenizer_load.py).
LARGE = 20_000


def test_a_large_vocabulary_whose_every_piece_joins_from_its_splits_tokenizes_and_round_trips(tmp_path):
    pieces = letter_pieces(LARGE - 259)
    tok = load_tokenizer(write_vocab(tmp_path / "large.gguf", tiny_spm(pieces)))
    assert tok.vocab_size == LARGE
    ids = tok.encode("the quick brown fox")
    assert tok.decode(ids) == "the quick brown fox"
    assert len(ids) < len("the quick brown fox") / 2  # merged into pieces of up to four, not bytes
