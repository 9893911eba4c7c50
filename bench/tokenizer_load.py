"""How long a SentencePiece vocabulary of Gemma 3's size takes to load (the coordinator loads it once).

The vocabulary is made up, as the tokenizer's test makes its smaller one (tiny_vocab.letter_pieces): each
piece joins from every split of it, so the merges derived from the scores are as dense as a real one's.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from tests.support.tiny_vocab import letter_pieces, tiny_spm, write_vocab
from workers.models.tokenizer import load_tokenizer

GEMMA3_VOCAB = 262_144


def spm_load(vocab: int = GEMMA3_VOCAB, repeats: int = 3) -> dict:
    """Seconds to load the vocabulary from its GGUF file: each of `repeats` loads, and the median."""
    with tempfile.TemporaryDirectory() as tmp:
        spm = tiny_spm(letter_pieces(vocab - 259))
        path = write_vocab(Path(tmp) / "vocab.gguf", spm)
        took = []
        for _ in range(repeats):
            started = time.perf_counter()
            tok = load_tokenizer(path)
            took.append(round(time.perf_counter() - started, 2))
        assert tok.decode(tok.encode("the quick brown fox")) == "the quick brown fox"
    return {"vocab": tok.vocab_size, "load_s": took, "median_s": sorted(took)[len(took) // 2]}
