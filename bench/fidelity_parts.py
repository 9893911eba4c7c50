"""Where the packed logits' error comes from: one rounding at a time, in a numpy forward.

The f32 stage's weights (the file's blocks dequantized exactly) run through
a plain forward in which each rounding the engines make can be switched on
alone: the rows before each kind of product rounded to 8 bits per block of
32 (max|x|/127 steps, as kernels_q8 and llama.cpp do), with a float32 or a
float16 step (llama.cpp stores it as float16), with or without the row's
outliers taken out (workers.models.outliers), and the KV cache, the queries
and the softmax rounded to float16 (llama.cpp's default cache, and its
products with it). Each figure is the mean RMS distance of the last
position's logits to the exact forward's.

A forward that rounds is chaotic: a relative change of 2^-22 in every
rounded row (one float32 step) gives a distance to f32 as different from the
first as another prompt's would be (`perturbed`). So every figure is a mean
over prompts and over PERTURBATIONS such nudges, and only differences well
above its spread (given as `sem`, the standard error) mean anything.

`python -m bench.fidelity_parts` prints one JSON line; bench.__main__ runs it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import numpy as np

from bench.fidelity import PROMPTS
from workers import models
from workers.models.ops import apply_rope, causal_mask, rms_norm, rope_tables, silu, softmax
from workers.models.outliers import SPILL_MAX, SPILL_RATIO
from workers.models.tokenizer import load_tokenizer
from workers.protocol.report import LayerRange

KINDS = ("qkv", "o", "gate_up", "down", "head")  # the rows rounded: one kind of product each
PERTURBATIONS = 2  # nudges of every rounded row by (1 + i·2^-22): the chaos a figure is averaged over


@dataclass(frozen=True)
class Rounding:
    """Which roundings a forward makes; the default is none (the f32 reference)."""

    rows: tuple[str, ...] = ()  # the kinds of product whose input rows are rounded to 8 bits
    f16_step: bool = False  # the step max|x|/127 itself rounded to float16, as llama.cpp stores it
    spill: bool = False  # a row's outliers kept exact (workers.models.outliers)
    f16_attention: bool = False  # keys, values, queries and softmax weights rounded to float16
    layers: tuple[int, ...] | None = None  # the blocks that round (None: all); the head counts as -1
    nudge: float = 1.0  # every rounded row multiplied by this first


def f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def round_rows(x: np.ndarray, r: Rounding) -> np.ndarray:
    """Rows x (T, in) as the kernels see them: 8-bit codes per block of 32 times their step."""
    x = (x * np.float32(r.nudge)).astype(np.float32)
    far = np.zeros(x.shape, dtype=bool)
    if r.spill:  # the SPILL_MAX largest values above SPILL_RATIO × the row's RMS
        a = np.abs(x)
        kth = -np.sort(-a, axis=1)[:, SPILL_MAX - 1 : SPILL_MAX]
        far = (a > SPILL_RATIO * np.sqrt(np.mean(x * x, axis=1, keepdims=True))) & (a >= kth)
    blocks = np.where(far, 0, x).reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(axis=2, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, 0).astype(np.float32)
    step = amax / np.float32(127)
    rounded = (f16(step) if r.f16_step else step) * np.rint(blocks * inv)
    return np.where(far, x, rounded.reshape(x.shape)).astype(np.float32)


def forward(stage, ids: np.ndarray, r: Rounding) -> np.ndarray:
    """The last position's logits of prompt `ids` through the whole f32 `stage`, rounding as `r` says."""
    p, T = stage.params, len(ids)
    H, KV, hd = p.n_heads, p.n_kv_heads, p.head_dim
    eps = np.float32(p.eps)

    def rows(x: np.ndarray, kind: str, layer: int) -> np.ndarray:
        on = kind in r.rows and (r.layers is None or layer in r.layers)
        return round_rows(x, r) if on else x

    def half(x: np.ndarray) -> np.ndarray:
        return f16(x) if r.f16_attention else x

    x = stage.token_embd.embed(ids)
    mask = causal_mask(T, 0)
    for i, w in enumerate(stage.blocks):
        cos, sin = rope_tables(np.arange(T), hd, p.rope[i])
        h = rows(rms_norm(x, w.attn_norm, eps), "qkv", i)
        q = apply_rope((h @ w.attn_q).reshape(T, H, hd), cos, sin, p.arch.rope)  # (T, H, hd)
        k = half(apply_rope((h @ w.attn_k).reshape(T, KV, hd), cos, sin, p.arch.rope))  # (T, KV, hd)
        v = half((h @ w.attn_v).reshape(T, KV, hd))
        att = np.empty((T, H, hd), dtype=np.float32)
        for head in range(H):
            g = head // (H // KV)
            scores = half(q[:, head]) @ k[:, g].T * np.float32(1 / np.sqrt(hd))  # (T, T)
            att[:, head] = half(softmax(scores + mask if mask is not None else scores)) @ v[:, g]
        x = x + rows(att.reshape(T, H * hd), "o", i) @ w.attn_output
        h = rows(rms_norm(x, w.ffn_norm, eps), "gate_up", i)
        x = x + rows(silu(h @ w.ffn_gate) * (h @ w.ffn_up), "down", i) @ w.ffn_down
    return (rows(rms_norm(x[-1:], stage.output_norm, eps), "head", -1) @ stage.head)[0]


CASES = {
    "rows rounded, float32 steps (the packed path before outliers were spilled)": Rounding(rows=KINDS),
    "rows rounded, outliers exact (the packed path)": Rounding(rows=KINDS, spill=True),
    "rows rounded, float16 steps, float16 attention (llama.cpp)": Rounding(
        rows=KINDS, f16_step=True, f16_attention=True
    ),
    "rows rounded, float16 steps": Rounding(rows=KINDS, f16_step=True),
    "float16 attention alone": Rounding(f16_attention=True),
    **{f"{kind} rows alone": Rounding(rows=(kind,)) for kind in KINDS},
    "the last block's rows alone": Rounding(rows=KINDS, layers=(29,)),
    "every row but the last block's": Rounding(rows=KINDS, layers=(*range(29), -1)),
}


def run(n_prompts: int = 16) -> dict:
    """Each case's mean RMS distance to the exact forward, over prompts and PERTURBATIONS nudges."""
    path = models.smollm2_path()
    stage = models.build("smollm2", LayerRange(0, models.describe("smollm2").n_layers), "f32")
    tokenizer = load_tokenizer(path)
    prompts = [np.array(tokenizer.encode(text)) for text in PROMPTS[:n_prompts]]
    exact = [forward(stage, ids, Rounding()) for ids in prompts]
    results = {}
    for name, case in CASES.items():
        d = [
            _rms(forward(stage, ids, replace(case, nudge=1 + i * 2.0**-22)) - ref)
            for i in range(PERTURBATIONS)
            for ids, ref in zip(prompts, exact, strict=True)
        ]
        results[name] = {"rms": _round(np.mean(d)), "sem": _round(np.std(d) / np.sqrt(len(d)))}
    rounded, nudged = Rounding(rows=KINDS), Rounding(rows=KINDS, nudge=1 + 2.0**-22)
    apart = [_rms(forward(stage, ids, nudged) - forward(stage, ids, rounded)) for ids in prompts]
    results["perturbed: a run nudged by 2^-22 against the run un-nudged"] = {"rms": _round(np.mean(apart))}
    return {"prompts": n_prompts, "perturbations": PERTURBATIONS, "cases": results}


def _round(value: float) -> float:
    return round(float(value), 4)


def _rms(d: np.ndarray) -> float:
    return float(np.sqrt(np.mean(d.astype(np.float64) ** 2)))


def lines(results: dict) -> list[str]:
    """One line a case."""
    return [f"error of {name}: {f['rms']}" + (f" ± {f['sem']}" if "sem" in f else "")
            for name, f in results["cases"].items()]  # fmt: skip


if __name__ == "__main__":
    print(json.dumps(run()))
