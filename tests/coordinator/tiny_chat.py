"""A tiny llama GGUF with a tokenizer whose generations never end by themselves, for long fast runs."""

from __future__ import annotations

from pathlib import Path

import gguf

from tests.workers.tiny_gguf import TinyLlama, tiny_weights

LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)]
PROMPT = "abc"


def write_tiny_chat(path: Path, context_length: int) -> TinyLlama:
    """Write a tiny llama whose vocabulary is lowercase letters, "ab" and markers; return its shape.

    Its end-of-sequence token is one past the model's output rows, so the model
    never samples it: a generation runs until its budget or the context is spent.
    """
    t = TinyLlama(context_length=context_length)
    words = [*LETTERS, "ab"]
    tokens = [*words, *(f"<unused{i}>" for i in range(t.vocab - len(words))), "<|eos|>"]
    w = gguf.GGUFWriter(path, arch="llama")
    w.add_block_count(t.n_layers)
    w.add_context_length(t.context_length)
    w.add_embedding_length(t.hidden)
    w.add_feed_forward_length(t.ffn)
    w.add_head_count(t.n_heads)
    w.add_head_count_kv(t.n_kv_heads)
    w.add_layer_norm_rms_eps(t.eps)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges(["a b"])
    w.add_token_types([1] * len(words) + [3] * (len(tokens) - len(words)))
    w.add_eos_token_id(len(tokens) - 1)
    for name, value in tiny_weights(t).items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return t
