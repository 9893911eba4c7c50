"""Our tokenizers give llama.cpp's ids on Gemma 3's and SmolLM2's files, for every string of its fixture.

The fixtures (tests/fixtures/tokenizers/*_tokenizer.json) are written by `python -m bench.tokenizer_fixture`:
over a thousand strings in many scripts, emoji, code, whitespace runs, numbers, URLs, text that spells
special tokens and rare code points, tokenized by llama.cpp as a completion prompt is (no BOS, control
tokens not parsed). Each test reports every string that differs, not only the first.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from workers.models import ModelSpecError, gemma3_path, packages
from workers.models.tokenizer import Tokenizer, load_tokenizer

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "tokenizers"


def _fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}_tokenizer.json").read_text())


def _differences(got: dict[str, list[int]], want: list[list]) -> list[str]:
    """One line per string whose ids are not llama.cpp's."""
    return [f"{text!r}: ours {got[text]} llama.cpp {ids}" for text, ids in want if got[text] != ids]


@pytest.fixture(scope="module")
def gemma3() -> Tokenizer:
    """Gemma 3's tokenizer, loaded once (its 262,144 pieces take seconds); skipped without its packages."""
    try:
        return load_tokenizer(gemma3_path())
    except ModelSpecError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def smollm2_tok(smollm2: Path) -> Tokenizer:
    return load_tokenizer(smollm2)


def test_the_gemma3_fixture_was_made_from_the_file_we_load_and_holds_over_a_thousand_strings():
    fix = _fixture("gemma3")
    # The joined file is checked against this digest before it is used (workers.models.packages).
    assert fix["sha256"] == packages.GEMMA3.sha256
    assert len({text for text, _ in fix["cases"]}) >= 1000


def test_the_smollm2_fixture_was_made_from_the_file_we_load(smollm2: Path):
    with smollm2.open("rb") as f:
        assert hashlib.file_digest(f, "sha256").hexdigest() == _fixture("smollm2")["sha256"]


@pytest.mark.parametrize("name", ["gemma3", "smollm2"])
def test_every_string_encodes_to_llamacpps_ids(name, request):
    tok = request.getfixturevalue("gemma3" if name == "gemma3" else "smollm2_tok")
    cases = _fixture(name)["cases"]
    wrong = _differences({text: tok.encode(text) for text, _ in cases}, cases)
    assert not wrong, f"{len(wrong)} of {len(cases)} strings differ:\n" + "\n".join(wrong)


@pytest.mark.parametrize("name", ["gemma3", "smollm2"])
def test_a_prompt_starts_with_bos_exactly_when_llamacpp_adds_it(name, request):
    tok = request.getfixturevalue("gemma3" if name == "gemma3" else "smollm2_tok")
    cases = _fixture(name)["with_bos"]
    wrong = _differences({text: tok.prompt_ids(text) for text, _ in cases}, cases)
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("name", ["gemma3", "smollm2"])
def test_every_string_decodes_back_from_its_ids(name, request):
    tok = request.getfixturevalue("gemma3" if name == "gemma3" else "smollm2_tok")
    cases = _fixture(name)["cases"]
    wrong = [f"{text!r}: {tok.decode(ids)!r}" for text, ids in cases if tok.decode(tok.encode(text)) != text]
    assert not wrong, f"{len(wrong)} of {len(cases)} strings come back otherwise:\n" + "\n".join(wrong)
