"""A tiny llama GGUF with a tokenizer whose generations never end by themselves (without a chat template)."""

from __future__ import annotations

from pathlib import Path

from tests.support.tiny_gguf import TinyLlama, write_tiny_tokenized

LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)]
PROMPT = "abc"
CHATML_MARKERS = ["<|im_start|>", "<|im_end|>"]
# Each turn between ChatML's markers, then the assistant's opened (no newlines: not in the vocabulary).
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}{{ m.content }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}"
)


def write_tiny_chat(
    path: Path, context_length: int, eos_id: int | None = None, chat: bool = False, marker_chars: int = 0
) -> TinyLlama:
    """Write a tiny llama whose vocabulary is lowercase letters, "ab" and markers; return its shape.

    Its end-of-sequence token is one past the model's output rows, so the model
    never samples it: a generation runs until its budget or the context is spent.
    eos_id: another token to end the sequence instead, one the model does sample.
    chat: give the file a ChatML chat template, its markers control tokens after the words.
    <|im_end|> then ends a generation too (as llama.cpp reads it), and the model samples it:
    greedy from PROMPT, a chat ends after ~130 tokens and a raw prompt after ~30.
    marker_chars: pad each unused marker's text to this many characters. The model is
    the same (its greedy tokens too, soon one marker over and over), but each
    of those tokens is that much text: a long run pushes megabytes of events.
    """
    t = TinyLlama(context_length=context_length)
    words = [*LETTERS, "ab"]
    markers = CHATML_MARKERS if chat else []
    unused = (f"<unused{i}>" for i in range(t.vocab - len(words) - len(markers)))
    tokens = [*words, *markers, *(m[:-1].ljust(marker_chars - 1, "x") + ">" for m in unused), "<|eos|>"]
    eos = len(tokens) - 1 if eos_id is None else eos_id
    template = CHATML if chat else None
    write_tiny_tokenized(path, t, tokens, n_normal=len(words), eos_id=eos, chat_template=template)
    return t


# Each turn on lines of its own, for a vocabulary that has the newline.
CHATML_LINES = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_chatml(path: Path, context_length: int) -> TinyLlama:
    """As write_tiny_chat, with space, newline and a ChatML template, so /v1/chat/completions takes it."""
    t = TinyLlama(context_length=context_length)
    words = [*LETTERS, "ab", "Ġ", "Ċ"]  # Ġ, Ċ: byte-level BPE's space and newline
    tokens = [*words, "<|im_start|>", "<|im_end|>"]
    tokens += [*(f"<unused{i}>" for i in range(t.vocab - len(tokens))), "<|eos|>"]
    write_tiny_tokenized(
        path, t, tokens, n_normal=len(words), eos_id=len(tokens) - 1, chat_template=CHATML_LINES
    )
    return t
