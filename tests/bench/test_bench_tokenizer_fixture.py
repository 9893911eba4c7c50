"""bench/tokenizer_fixture's corpus: the one the committed fixtures hold, the same on every run."""

from __future__ import annotations

import json

from bench.tokenizer_fixture import FIXTURES, WITH_BOS, corpus, drawn


def test_the_corpus_is_drawn_the_same_on_every_run_and_holds_each_string_once():
    assert drawn() == drawn()
    assert len(corpus()) == len(set(corpus())) >= 1000


def test_the_committed_fixtures_hold_the_corpus_the_script_builds_now():
    gemma3 = json.loads((FIXTURES / "gemma3_tokenizer.json").read_text())
    assert [text for text, _ in gemma3["cases"]] == corpus()
    assert [text for text, _ in gemma3["with_bos"]] == WITH_BOS
    smollm2 = json.loads((FIXTURES / "smollm2_tokenizer.json").read_text())
    assert {text for text, _ in smollm2["cases"]} <= set(corpus())
