"""The q4_k_m bench section's bookkeeping: a file's type mix from its GGUF table, medians, ratios, bounds."""

from __future__ import annotations

from bench.quants import SHIPPED, _bound, _summary, type_mix
from tests.support.tiny_gguf import write_tiny_llama
from workers.models.gguf_file import open_gguf


def test_a_files_type_mix_counts_each_stored_types_tensors_and_bytes_from_its_table(tmp_path):
    path = tmp_path / "mixed.gguf"
    write_tiny_llama(path, mixed_types=True)  # FFN matrices Q4_1, attn_v Q8_0, token_embd F16, the rest F32
    entries = open_gguf(path).tensors.values()
    mix = type_mix(path)
    assert set(mix["types"]) == {"Q4_1", "Q8_0", "F16", "F32"}
    assert mix["types"]["Q8_0"]["tensors"] == sum(".attn_v." in e.name for e in entries)
    assert mix["types"]["F16"] == {"tensors": 1, "bytes": open_gguf(path).entry("token_embd.weight").n_bytes}
    assert (
        mix["tensor_bytes"]
        == sum(e.n_bytes for e in entries)
        == sum(t["bytes"] for t in mix["types"].values())
    )


def _run(prefill: float, decode: float, resident: int, tokens: list[int]) -> dict:
    return {"prefill_tok_s": prefill, "decode_tok_s": decode, "resident_bytes": resident,
            "worker_resident_bytes": resident + 10, "tokens": tokens}  # fmt: skip


def test_each_ways_medians_are_over_llamacpps_and_served_over_in_process():
    by = {
        "llamacpp": [
            _run(100, 40, 200, [1, 2, 3]),
            _run(90, 50, 210, [1, 2, 3]),
            _run(80, 45, 205, [1, 2, 3]),
        ],
        "in_process": [_run(200, 60, 300, [1, 2, 4])] * 3,
        "served": [
            _run(150, 90, 300, [1, 2, 3]),
            _run(190, 30, 300, [1, 2, 3]),
            _run(170, 45, 300, [1, 2, 3]),
        ],
    }
    s = _summary(by)
    assert s["llamacpp"]["decode_tok_s"] == 45 and s["llamacpp"]["resident_bytes"] == 205
    assert s["served"]["resident_bytes"] == 310, "a served stage's resident set is its worker's"
    assert s["served"]["over_llamacpp"] == {"prefill": 1.89, "decode": 1.0}
    assert s["in_process"]["over_llamacpp"] == {"prefill": 2.22, "decode": 1.33}
    assert s["served_over_in_process"] == {"prefill": 0.85, "decode": 0.75}
    assert s["in_process"]["same_tokens_as_llamacpp"] == "2/3"
    assert s["served"]["runs_decode_tok_s"] == [90, 30, 45]


def test_a_files_resident_bound_is_the_shipped_files_stage_plus_the_tensor_bytes_difference():
    def summary(resident: int) -> dict:
        return {way: {"resident_bytes": resident} for way in ("in_process", "served")}

    out = {
        SHIPPED: {"tensor_bytes": 1000, "threads": {"1": summary(5000)}},
        "Q4_K_M": {"tensor_bytes": 1300, "threads": {"1": summary(5301)}},
        "Q8_0": {"tensor_bytes": 1500, "threads": {"1": summary(5500)}},
    }
    for name in out:
        _bound(out, name)
    assert out["Q4_K_M"]["threads"]["1"]["served"]["resident_bound_bytes"] == 5300
    assert out["Q4_K_M"]["threads"]["1"]["served"]["resident_within_bound"] is False
    assert out["Q8_0"]["threads"]["1"]["in_process"]["resident_within_bound"] is True
    assert out[SHIPPED]["threads"]["1"]["served"]["resident_within_bound"] is True
