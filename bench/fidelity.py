"""How close our packed stage's answers are to llama.cpp's, and each one's logits to an f32 reference.

`python -m bench.fidelity --model M [--threads N]` (gemma3, smollm2 or a path
to a GGUF file) prints one JSON line and the lines a person reads on stderr.
Both engines are fed the same ids (our tokenizer's, BOS first where the
file's prompts start with it); llama.cpp is fed them as ids, never as text.

- Greedy tokens, on each of PROMPTS (plain completion prompts), STEPS
  tokens: llama.cpp's greedy continuation, and ours fed llama.cpp's tokens
  (teacher forcing, so every step compares the same context). A step's
  top-1 is compared only where llama.cpp's top-1 leads its second by at
  least MARGIN logits: closer than that, either engine's rounding (RMS
  ~0.1-0.2 logits) may rightly decide the near tie either way. Each step's
  lead is kept. Beside it, how many leading tokens our own free greedy run
  shares with llama.cpp's.
- Teacher-forced top-1 agreement over LONG_POSITIONS positions of LONG_TEXT:
  every position's top-1, ours against llama.cpp's (all of them, and those
  where llama.cpp leads by MARGIN); beside it the f32 reference's top-1
  against each, and llama.cpp's own with a float32 KV cache against its
  default float16 one (how often two roundings of one model part at all).
- Distance to f32: the last position's logits of each prompt, ours and
  llama.cpp's, each against llama.cpp on an F32 re-quantization of the file
  (every tensor dequantized: the model the file stores, nothing rounded
  further) with an F32 KV cache; RMS over the vocabulary. `ratio` is ours over
  llama.cpp's; its median over the prompts is the figure (target ≤ 1.0).
  llama.cpp on the quantized file keeps its default (float16) KV cache, as
  a user runs it. Our f32 stage is checked against the same reference: the
  two engines computing one model, they should agree to float32 rounding.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import numpy as np

from workers import models
from workers.models.tokenizer import load_tokenizer
from workers.protocol.report import LayerRange

STEPS = 16
MARGIN = 0.2  # logits by which llama.cpp's top-1 must lead its second for a step to be compared
CONTEXT = 512  # the longest feed (LONG_POSITIONS) with room to spare
GGML_F32 = 0  # ggml's type id of float32, for llama.cpp's keys and values
LONG_POSITIONS = 320
AGREEMENT_TARGET = 0.99
RATIO_TARGET = 1.0
PROMPTS = (
    "The capital of France is",
    "Water boils at a temperature of",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "The three primary colors are red, blue and",
    "Photosynthesis is the process by which plants convert sunlight into",
    "In 1969, Neil Armstrong became the first person to",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "To make a cup of tea, first boil the water, then",
    "The largest planet in the solar system is",
    "Monday, Tuesday, Wednesday,",
)
LONG_TEXT = (
    "The lighthouse stood at the end of a narrow spit of rock, a mile from the nearest house. For "
    "ninety years a keeper had climbed its hundred and twelve steps every evening to light the lamp, "
    "wind the clockwork that turned the lens, and write the weather in a leather book. The last keeper, "
    "a woman named Agnes Morrow, kept the book for thirty-one years. Her entries were short: the wind's "
    "direction, the height of the swell, the ships that passed, and now and then a line about a storm "
    "that had kept her awake. When the light was automated in 1987, she was given a pension and a "
    "small brass plaque, and she moved to a cottage in the town where she had been born.\n\n"
    "Automation changed the work of a lighthouse less than people expected. A lamp still has to be "
    "cleaned, a battery still fails, and salt still eats through every hinge. Engineers now visit "
    "twice a year instead of living on the rock, and the log is kept by a computer that records the "
    "voltage of the panels, the hours the lamp has burned and the temperature inside the lantern room. "
    "Yet the old books are still read. Historians use them to study storms of the last century, and "
    "climate scientists compare the keepers' notes of sea ice and fog with the records of satellites. "
    "A single line in a keeper's hand, written by lamplight, can confirm the date of a storm that no "
    "instrument recorded.\n\n"
    "Agnes Morrow's books are kept in the county archive, in a grey box on the third floor. Visitors "
    "can ask to see them, and a few do every year: students, a novelist looking for details, and once "
    "a sailor whose grandfather's ship appeared in an entry from 1962. The entry reads, in full: "
    "'Fog until noon. Wind north-east, light. The Marianne passed at three, low in the water, and "
    "sounded her horn twice. I answered with the bell.' The sailor copied it into a notebook, thanked "
    "the archivist, and drove to the coast to look at the light for himself. He said afterwards that it "
    "was smaller than he had imagined, and that the sea around it was very calm."
)


def llama(path: str, threads: int, f32_cache: bool = False, all_logits: bool = False):
    """A llama-cpp-python model of `path`; its KV cache float32 if asked, else llama.cpp's default."""
    from llama_cpp import Llama

    cache = {"type_k": GGML_F32, "type_v": GGML_F32} if f32_cache else {}
    return Llama(model_path=path, n_ctx=CONTEXT, n_batch=CONTEXT, n_threads=threads, n_threads_batch=threads,
                 logits_all=all_logits, verbose=False, **cache)  # fmt: skip


def _last(llm) -> np.ndarray:
    import llama_cpp

    row = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(row, shape=(llm.n_vocab(),)).copy()


def llama_greedy(llm, ids: list[int], steps: int = STEPS) -> tuple[list[int], list[float], np.ndarray]:
    """llama.cpp's `steps` greedy tokens after `ids`, its lead at each, the prompt's logits."""
    llm.reset()
    tokens, leads, feed, first = [], [], ids, None
    for _ in range(steps):
        llm.eval(feed)
        row = _last(llm)
        first = row if first is None else first
        tokens.append(int(np.argmax(row)))
        leads.append(float(lead(row[None])[0]))
        feed = tokens[-1:]
    return tokens, leads, first


def lead(logits: np.ndarray) -> np.ndarray:
    """Each row's top logit minus its second (rows, vocab) → (rows,)."""
    top2 = np.partition(logits, -2, axis=-1)[:, -2:]
    return top2[:, 1] - top2[:, 0]


def agreement(ours: list[int], theirs: list[int], leads: list[float], margin: float = MARGIN) -> dict:
    """Where both top-1s agree, counted over the steps where llama.cpp leads by ≥ margin (and over all)."""
    same = [a == b for a, b in zip(ours, theirs, strict=True)]
    compared = [x >= margin for x in leads]
    return {
        "same": sum(s and c for s, c in zip(same, compared, strict=True)),
        "compared": sum(compared),
        "same_all": sum(same),
        "positions": len(same),
    }


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy runs share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def rms(a: np.ndarray, ref: np.ndarray) -> float:
    d = a.astype(np.float64) - ref.astype(np.float64)
    return float(np.sqrt(np.mean(d * d)))


def distances(ours: np.ndarray, theirs: np.ndarray, ref: np.ndarray) -> dict:
    """Ours and llama.cpp's RMS and max-abs distances to the reference, and ours over llama.cpp's RMS."""
    out = {"ours_rms": rms(ours, ref), "llamacpp_rms": rms(theirs, ref)}
    out["ours_max"] = float(np.abs(ours.astype(np.float64) - ref).max())
    out["llamacpp_max"] = float(np.abs(theirs.astype(np.float64) - ref).max())
    out["ratio"] = round(out["ours_rms"] / out["llamacpp_rms"], 3) if out["llamacpp_rms"] else float("inf")
    return out


def teacher_forced(stage, ids: list[int], tokens: list[int]) -> tuple[list[int], np.ndarray]:
    """Our top-1 after `ids` and after each of `tokens` but the last; the prompt's last logits."""
    first = stage.forward(np.array(ids, dtype=np.int32), session="fidelity", start_pos=0, last_only=True)
    top = [int(np.argmax(first[-1]))]
    for step, token in enumerate(tokens[:-1]):
        x = np.array([token], dtype=np.int32)
        row = stage.forward(x, session="fidelity", start_pos=len(ids) + step, last_only=True)
        top.append(int(np.argmax(row[-1])))
    stage.reset("fidelity")
    return top, first[-1]


def free_greedy(stage, ids: list[int], steps: int = STEPS) -> list[int]:
    """Our own greedy run of `steps` tokens after `ids`."""
    logits = stage.forward(np.array(ids, dtype=np.int32), session="free", start_pos=0, last_only=True)
    tokens = [int(np.argmax(logits[-1]))]
    for step in range(steps - 1):
        x = np.array(tokens[-1:], dtype=np.int32)
        logits = stage.forward(x, session="free", start_pos=len(ids) + step, last_only=True)
        tokens.append(int(np.argmax(logits[-1])))
    stage.reset("free")
    return tokens


def build(model: str, precision: str):
    return models.build(model, LayerRange(0, models.describe(model).n_layers), precision)


def run(model: str, threads: int, check_f32: bool = True) -> dict:
    """Every figure of the module on `model`: per prompt, the long text's agreement, the medians."""
    from bench.quants import requantized

    path = models.gguf_path(model)
    tokenizer = load_tokenizer(path)
    prompts = [tokenizer.prompt_ids(text) for text in PROMPTS]
    long_ids = tokenizer.prompt_ids(LONG_TEXT)[:LONG_POSITIONS]
    if len(long_ids) < LONG_POSITIONS:
        raise SystemExit(f"the long text is {len(long_ids)} tokens of {path.name}, not {LONG_POSITIONS}")
    step(f"llama.cpp on {path.name}: {len(prompts)} prompts, {STEPS} greedy steps each")
    llm = llama(str(path), threads)
    theirs = [llama_greedy(llm, ids) for ids in prompts]
    del llm
    step(f"llama.cpp on {path.name}: every position of {LONG_POSITIONS}")
    llm = llama(str(path), threads, all_logits=True)
    llm.eval(long_ids)
    long_scores = np.asarray(llm.scores[: len(long_ids)])
    long_theirs, long_leads = long_scores.argmax(axis=-1).tolist(), lead(long_scores).tolist()
    del llm, long_scores
    step(f"llama.cpp on {path.name} with an F32 KV cache: every position of {LONG_POSITIONS}")
    llm = llama(str(path), threads, f32_cache=True, all_logits=True)
    llm.eval(long_ids)
    long_f32_cache = np.asarray(llm.scores[: len(long_ids)]).argmax(axis=-1).tolist()
    del llm
    step(f"llama.cpp on an F32 re-quantization of {path.name}, an F32 KV cache")
    llm = llama(str(requantized("F32", path)), threads, f32_cache=True)
    reference = []
    for ids in prompts:
        llm.reset()
        llm.eval(ids)
        reference.append(_last(llm))
    del llm
    llm = llama(str(requantized("F32", path)), threads, f32_cache=True, all_logits=True)
    llm.eval(long_ids)
    long_f32 = np.asarray(llm.scores[: len(long_ids)]).argmax(axis=-1).tolist()
    del llm
    step(f"ours, packed, on {path.name}")
    stage = build(model, "packed")
    rows = []
    for text, ids, (tokens, leads, their_first), ref in zip(PROMPTS, prompts, theirs, reference, strict=True):
        top, first = teacher_forced(stage, ids, tokens)
        free = free_greedy(stage, ids)
        rows.append({
            "prompt": text, "ids": len(ids), "llamacpp_tokens": tokens, "ours_tokens": free,
            "shared_prefix": shared_prefix(free, tokens), "leads": [round(x, 3) for x in leads],
            "same": [a == b for a, b in zip(top, tokens, strict=True)],
            "agreement": agreement(top, tokens, leads), **distances(first, their_first, ref),
        })  # fmt: skip
    long_ours = stage.forward(
        np.array(long_ids, dtype=np.int32), session="long", start_pos=0, last_only=False
    )
    long = agreement(long_ours.argmax(axis=-1).tolist(), long_theirs, long_leads)
    # How often the f32 model itself picks llama.cpp's quantized top-1, and ours picks the f32 one:
    # what two roundings of one model disagree on at all, to read the figure above against.
    long["f32_same_as_llamacpp"] = agreement(long_f32, long_theirs, long_leads)["same_all"]
    long["ours_same_as_f32"] = agreement(long_ours.argmax(axis=-1).tolist(), long_f32, long_leads)["same_all"]
    # And how often llama.cpp keeps its own top-1 when only its KV cache's precision changes (float16,
    # its default, to float32): the agreement its own rounding allows on this file.
    long["llamacpp_f32_cache_same"] = agreement(long_f32_cache, long_theirs, long_leads)["same_all"]
    precision = stage.precision
    del stage, long_ours
    out = {"model": model, "file": str(path), "precision": precision, "threads": threads, "steps": STEPS,
           "margin": MARGIN, "prompts": rows, "long": long, **summary(rows)}  # fmt: skip
    if check_f32:
        step(f"ours, f32, on {path.name}, against the F32 reference")
        ref_stage = build(model, "f32")
        out["f32_vs_reference_rms"] = [
            rms(teacher_forced(ref_stage, ids, [0])[1], ref)
            for ids, ref in zip(prompts, reference, strict=True)
        ]
    return out


def summary(rows: list[dict]) -> dict:
    """The prompts' totals: steps compared and agreed, free runs' shared tokens, the median ratio."""
    total = {k: sum(r["agreement"][k] for r in rows) for k in ("same", "compared", "same_all", "positions")}
    return {
        "greedy": total,
        "shared_prefix": [r["shared_prefix"] for r in rows],
        "median_ratio": statistics.median(r["ratio"] for r in rows),
        "median_ours_rms": statistics.median(r["ours_rms"] for r in rows),
        "median_llamacpp_rms": statistics.median(r["llamacpp_rms"] for r in rows),
    }


def lines(f: dict) -> list[str]:
    """The figures as a person reads them: each prompt's steps and leads, the totals against the targets."""
    out = [f"fidelity of {f['file']} ({f['precision']}), {f['steps']} greedy steps a prompt, "
           f"compared where llama.cpp's top-1 leads by ≥ {f['margin']}:"]  # fmt: skip
    for i, r in enumerate(f["prompts"]):
        marks = " ".join(
            f"{x:.2f}{('=' if same else '≠') if x >= f['margin'] else '~'}"
            for x, same in zip(r["leads"], r["same"], strict=True)
        )
        a = r["agreement"]
        out.append(
            f"  {i + 1:2} ({r['ids']} ids): {a['same']}/{a['compared']}, free run shares "
            f"{r['shared_prefix']}/{f['steps']}; RMS to f32 ours {r['ours_rms']:.3f} llama.cpp "
            f"{r['llamacpp_rms']:.3f} (× {r['ratio']}); leads {marks}"
        )
    g, long = f["greedy"], f["long"]
    share = long["same_all"] / long["positions"]
    out.append(
        f"greedy = llama.cpp: {g['same']}/{g['compared']} compared steps ({g['same_all']}/{g['positions']} "
        f"of all); teacher-forced top-1 over {long['positions']} positions of a long text: "
        f"{long['same_all']}/{long['positions']} = {share:.3f} (target ≥ {AGREEMENT_TARGET}; "
        f"{long['same']}/{long['compared']} where llama.cpp leads by ≥ {f['margin']}); the f32 model's top-1 "
        f"is llama.cpp's at {long.get('f32_same_as_llamacpp', '?')}, ours is the f32 model's at "
        f"{long.get('ours_same_as_f32', '?')} of {long['positions']}; llama.cpp's own top-1 with an F32 KV "
        f"cache is its float16 cache's at {long.get('llamacpp_f32_cache_same', '?')}"
    )
    out.append(
        f"last position's RMS to f32: median ours {f['median_ours_rms']:.3f}, llama.cpp "
        f"{f['median_llamacpp_rms']:.3f}; median of ours / llama.cpp's {f['median_ratio']} "
        f"(target ≤ {RATIO_TARGET})"
    )
    if "f32_vs_reference_rms" in f:
        out.append(f"our f32 stage vs the reference (llama.cpp, F32 file): RMS median "
                   f"{statistics.median(f['f32_vs_reference_rms']):.2e}")  # fmt: skip
    return out


def step(what: str) -> None:
    print(f"{what} …", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.fidelity", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3", help="gemma3, smollm2 or a path to a .gguf file")
    parser.add_argument("--threads", type=int, default=1, help="threads of llama.cpp and of our kernels")
    parser.add_argument(
        "--no-f32", action="store_true", help="skip our f32 stage's check against the reference"
    )
    args = parser.parse_args()
    if args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    results = run(args.model, args.threads, check_f32=not args.no_f32)
    print("\n".join(lines(results)), file=sys.stderr)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
