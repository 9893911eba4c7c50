"""How far the packed path's logits are from exact arithmetic, next to how far llama.cpp's are.

For each prompt (token ids from our tokenizer, fed as ids to both sides, no
BOS), the logits after the prompt and after each of llama.cpp's next greedy
tokens (STEPS decisions): llama.cpp's on the file, our packed stage's, and
the f32 reference's. Our side is fed llama.cpp's tokens (teacher forcing),
so every step compares the same context.

The f32 reference is our f32 stage on the same file: every weight
dequantized exactly as the file's blocks give it (d·q + m in float32: the
model the file stores, nothing rounded further), activations, KV cache and
softmax in float32. Both quantized engines approximate that same model, so
the distance of each to it is its own arithmetic error. The reference is
checked against llama.cpp on an F32 re-quantization of the file (the same
dequantized weights, an F32 KV cache): if both compute the same model their
logits agree to float32 rounding, a small fraction of either engine's error.

Distances over the vocabulary: RMS and max-abs of the logits' difference,
and KL(reference ‖ engine) of the softmaxes. `ratio` is ours over
llama.cpp's RMS distance; its median over the prompts is the figure. A
step's greedy tokens are compared only where llama.cpp's top-1 leads its
second by at least MARGIN logits: closer than that, either engine's error
(RMS ~0.2 logits) may rightly decide a tie either way.

Each prompt gives one sample of a quantity that is chaotic: a change of one
float32 step in a rounded row moves a prompt's distance to f32 by ±50%
(bench/fidelity_parts.py), so the figures are medians over 32 prompts, and
the distance over all STEPS positions is the steadier one.

Run in a fresh process (`python -m bench.fidelity --threads N`, one JSON line
on stdout); bench.__main__ does, with the thread variables set.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from bench.model import PROMPT_TEXT
from workers import models
from workers.models.tokenizer import load_tokenizer
from workers.protocol.report import LayerRange

STEPS = 8  # greedy decisions a prompt: after the prompt, then after each of the first STEPS - 1 tokens
MARGIN = 0.2  # logits by which llama.cpp's top-1 must lead for a step's tokens to be compared
CONTEXT = 512
PROMPTS = (
    "The capital of France is",
    "Water boils at a temperature of",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "The three primary colors are red, blue and",
    "Photosynthesis is the process by which plants convert sunlight into",
    "1, 2, 3, 4, 5, 6, 7,",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "In 1969, Neil Armstrong became the first person to",
    "To make a cup of tea, first boil the water, then",
    "Q: What is the largest planet in the solar system?\nA:",
    "import numpy as np\n\nx = np.zeros((3, 4))\nprint(x.shape)\n# prints",
    "The French word for 'cat' is",
    "Dear Sir or Madam,\n\nI am writing to",
    "The main ingredients of a pancake are flour, eggs,",
    PROMPT_TEXT.strip(),
    "Monday, Tuesday, Wednesday,",
    "The sun rises in the east and sets in the",
    "SELECT name, age FROM users WHERE",
    "A haiku about autumn:\n",
    "The doctor told the patient that",
    "for (int i = 0; i < n; i++) {",
    "The best way to learn a new language is",
    "Mount Everest is the highest mountain in",
    "She opened the door and saw",
    "The chemical symbol for gold is",
    "Here is a list of three fruits:\n1.",
    "The Industrial Revolution began in",
    "If it rains tomorrow, we will",
    "The square root of 144 is",
    "My favourite book is",
    "Translate to French: Good morning ->",
)
# ggml's type ids and llama.cpp's file types, as llama.h numbers them
GGML_F32 = 0
FTYPES = {"f32": 0, "q8_0": 7}


def llama(path: Path, threads: int, f32_cache: bool = False):
    """A llama-cpp-python model of `path`; its KV cache float32 if asked, else llama.cpp's default (f16)."""
    from llama_cpp import Llama

    cache = {"type_k": GGML_F32, "type_v": GGML_F32} if f32_cache else {}
    return Llama(model_path=str(path), n_ctx=CONTEXT, n_batch=CONTEXT, n_threads=threads,
                 n_threads_batch=threads, verbose=False, **cache)  # fmt: skip


def llama_steps(llm, ids: list[int]) -> tuple[np.ndarray, list[int]]:
    """llama.cpp's logits (STEPS, vocab) after the prompt and each greedy token, and those tokens."""
    import llama_cpp

    llm.reset()
    rows, tokens, feed = [], [], ids
    for _ in range(STEPS):
        llm.eval(feed)
        row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
        rows.append(row.copy())
        tokens.append(int(np.argmax(row)))
        feed = tokens[-1:]
    return np.stack(rows), tokens


def stage_steps(stage, ids: list[int], tokens: list[int]) -> np.ndarray:
    """Our stage's logits (STEPS, vocab) after the prompt and after each of `tokens` but the last."""
    rows = [stage.forward(np.array(ids, dtype=np.int32), session="fidelity", start_pos=0, last_only=True)]
    for step, token in enumerate(tokens[: STEPS - 1]):
        x = np.array([token], dtype=np.int32)
        rows.append(stage.forward(x, session="fidelity", start_pos=len(ids) + step, last_only=True))
    stage.reset("fidelity")
    return np.concatenate(rows).astype(np.float64)


def distance(a: np.ndarray, ref: np.ndarray) -> dict:
    """RMS and max-abs of a - ref (logits, last axis the vocabulary) and KL(ref ‖ a), each row's mean."""
    d = a - ref
    log_p, log_q = _log_softmax(ref), _log_softmax(a)
    return {
        "rms": float(np.sqrt(np.mean(d * d, axis=-1)).mean()),
        "max": float(np.abs(d).max(axis=-1).mean()),
        "kl": float((np.exp(log_p) * (log_p - log_q)).sum(axis=-1).mean()),
    }


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def agreement(ours: np.ndarray, theirs: np.ndarray) -> tuple[int, int]:
    """(steps where our top-1 is llama.cpp's, steps compared): those where llama.cpp's leads by ≥ MARGIN."""
    top2 = np.sort(theirs, axis=-1)[:, -2:]
    compared = top2[:, 1] - top2[:, 0] >= MARGIN
    same = ours.argmax(axis=-1) == theirs.argmax(axis=-1)
    return int((same & compared).sum()), int(compared.sum())


def requantize(src: Path, dst: Path, kind: str) -> Path:
    """src re-quantized by llama.cpp to `kind` (every matrix, the embedding too), written at dst."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.pure = FTYPES[kind], True, True
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not re-quantize {src} to {kind}")
    return dst


def build(path: Path, precision: str):
    n_layers = models.describe(str(path)).n_layers
    return models.build(str(path), LayerRange(0, n_layers), precision)


def compare_file(path: Path, prompts: list[list[int]], threads: int) -> dict:
    """llama.cpp and our packed stage on `path`, each against our f32 stage: per prompt and the medians."""
    llm = llama(path, threads)
    theirs = [llama_steps(llm, ids) for ids in prompts]
    del llm
    ours_stage, ref_stage = build(path, "packed"), build(path, "f32")
    rows = []
    for ids, (their_logits, tokens) in zip(prompts, theirs, strict=True):
        ours = stage_steps(ours_stage, ids, tokens)
        ref = stage_steps(ref_stage, ids, tokens)
        them = their_logits.astype(np.float64)
        row = {"tokens": len(ids)}
        for name, at in (("prompt", slice(0, 1)), ("steps", slice(0, STEPS))):
            a, b = distance(ours[at], ref[at]), distance(them[at], ref[at])
            row[name] = {"ours": a, "llamacpp": b, "ratio": round(a["rms"] / b["rms"], 3)}
        row["greedy_ours"] = "{}/{}".format(*agreement(ours, them))
        row["greedy_f32"] = "{}/{}".format(*agreement(ref, them))
        rows.append(row)
    return {
        "precision": ours_stage.precision,
        "median_ratio": float(np.median([r["prompt"]["ratio"] for r in rows])),
        "median_ratio_steps": float(np.median([r["steps"]["ratio"] for r in rows])),
        "greedy_ours": _total(rows, "greedy_ours"),
        "greedy_f32": _total(rows, "greedy_f32"),
        "prompts": rows,
    }


def _total(rows: list[dict], key: str) -> str:
    same, compared = np.array([list(map(int, r[key].split("/"))) for r in rows]).sum(axis=0)
    return f"{same}/{compared}"


def check_reference(path: Path, f32_file: Path, prompts: list[list[int]], threads: int) -> dict:
    """Our f32 stage on `path` against llama.cpp on its F32 re-quantization with an F32 KV cache."""
    llm = llama(f32_file, threads, f32_cache=True)
    ref_stage = build(path, "f32")
    rows = []
    for ids in prompts:
        theirs, tokens = llama_steps(llm, ids)
        rows.append(distance(stage_steps(ref_stage, ids, tokens), theirs.astype(np.float64)))
    return {k: float(np.mean([r[k] for r in rows])) for k in ("rms", "max", "kl")}


def run(threads: int, prompts: tuple[str, ...] = PROMPTS) -> dict:
    """The fidelity figures of the shipped Q4_1 file and of its Q8_0 re-quantization."""
    path = models.smollm2_path()
    ids = [load_tokenizer(path).encode(text) for text in prompts]
    with tempfile.TemporaryDirectory(prefix="rlx-fidelity-") as tmp:
        f32_file = requantize(path, Path(tmp) / "f32.gguf", "f32")
        reference = check_reference(path, f32_file, ids, threads)
        f32_file.unlink()
        q8 = requantize(path, Path(tmp) / "q8_0.gguf", "q8_0")
        return {
            "threads": threads,
            "steps": STEPS,
            "margin": MARGIN,
            "reference_vs_llamacpp_f32": reference,
            "q4_1": compare_file(path, ids, threads),
            "q8_0": compare_file(q8, ids, threads),
        }


def lines(results: dict) -> list[str]:
    """Lines a person reads: per file the median ratio and the greedy agreement; the reference check."""
    out = []
    for kind in ("q4_1", "q8_0"):
        r = results[kind]
        out.append(
            f"fidelity {kind} ({r['precision']}): RMS distance to f32, ours / llama.cpp's: median "
            f"{r['median_ratio']:.2f} at the prompt's last position (target ≤ 1.0), "
            f"{r['median_ratio_steps']:.2f} over {results['steps']} steps; greedy = llama.cpp "
            f"{r['greedy_ours']} (f32: {r['greedy_f32']}) where its top-1 leads by ≥ {results['margin']}"
        )
    ref = results["reference_vs_llamacpp_f32"]
    out.append(f"f32 reference vs llama.cpp on an F32 file: RMS {ref['rms']:.2e}, max {ref['max']:.2e}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.fidelity", description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="threads of llama.cpp and of our kernels")
    args = parser.parse_args()
    if args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    results = run(args.threads)
    print("\n".join(lines(results)), file=sys.stderr)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
