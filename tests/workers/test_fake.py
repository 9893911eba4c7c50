"""The fake stage as a language model: token ids in, a vocabulary of logits out, a tokenizer borrowed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from coordinator.cluster import model_tokenizer
from tests.support.tiny_chat import write_tiny_chat
from workers.fake import FIRST_TEXT_ID, favoured, parse
from workers.models import ModelSpecError
from workers.protocol.report import LayerRange
from workers.stage import StageError

VOCAB = 1000


def test_a_fake_language_model_answers_a_vocabulary_of_logits_favouring_a_text_token_per_position():
    model = parse(f"fake:layers=2,vocab={VOCAB}")
    assert model.describe().input == "tokens" and model.describe().vocab == VOCAB
    stage = model.build(LayerRange(0, 2), "f32")
    ids = np.array([5, 7, 9], np.int32)
    logits = stage.forward(ids, session="s", start_pos=10, last_only=False)
    assert logits.shape == (3, VOCAB) and logits.dtype == np.float32
    assert logits.argmax(axis=1).tolist() == [favoured(VOCAB, p) for p in (10, 11, 12)]
    assert all(favoured(VOCAB, p) >= FIRST_TEXT_ID for p in range(2 * VOCAB))
    # Every low id (control and byte tokens) stays below every other: a sampled run draws none.
    # The draw is seeded: its extremes are within ~3.3 of 0, and the gap is 20.
    assert logits[:, :FIRST_TEXT_ID].max() < logits[:, FIRST_TEXT_ID:].min() - 5
    last = stage.forward(ids, session="s", start_pos=10, last_only=True)
    assert np.array_equal(last, logits[-1:])


def test_a_fake_language_model_split_in_stages_passes_hidden_rows_between_them():
    spec = f"fake:layers=4,hidden=3,vocab={VOCAB}"
    first, last = (parse(spec).build(LayerRange(a, b), "f32") for a, b in ((0, 2), (2, 4)))
    hidden = first.forward(np.array([4, 2], np.int32), session="s", start_pos=0, last_only=True)
    assert hidden.shape == (2, 3) and hidden.dtype == np.float32
    logits = last.forward(hidden, session="s", start_pos=0, last_only=True)
    assert logits.shape == (1, VOCAB) and int(logits.argmax()) == favoured(VOCAB, 1)
    with pytest.raises(StageError, match="int32 token ids"):
        first.forward(hidden, session="s", start_pos=0, last_only=True)


def test_a_fake_language_model_reads_its_tokenizer_from_the_file_it_names(tmp_path: Path):
    path = tmp_path / "tiny.gguf"
    write_tiny_chat(path, context_length=64)
    tokenizer = model_tokenizer(f"fake:vocab=40,tokenizer={path}")
    assert tokenizer.decode(tokenizer.encode("abc")) == "abc"
    with pytest.raises(ModelSpecError, match="names no GGUF file"):
        model_tokenizer("fake:vocab=40")
