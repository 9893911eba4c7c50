"""A tiny llama GGUF with a tokenizer whose generations never end by themselves, for long fast runs."""

from __future__ import annotations

from pathlib import Path

from tests.support.tiny_gguf import TinyLlama, write_tiny_tokenized

LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)]
PROMPT = "abc"


def write_tiny_chat(path: Path, context_length: int, eos_id: int | None = None) -> TinyLlama:
    """Write a tiny llama whose vocabulary is lowercase letters, "ab" and markers; return its shape.

    Its end-of-sequence token is one past the model's output rows, so the model
    never samples it: a generation runs until its budget or the context is spent.
    eos_id: another token to end the sequence instead, one the model does sample.
    """
    t = TinyLlama(context_length=context_length)
    words = [*LETTERS, "ab"]
    tokens = [*words, *(f"<unused{i}>" for i in range(t.vocab - len(words))), "<|eos|>"]
    eos = len(tokens) - 1 if eos_id is None else eos_id
    write_tiny_tokenized(path, t, tokens, n_normal=len(words), eos_id=eos)
    return t
