"""Where a decode step of a model's packed stage goes: the head, each type's products, attention, the rest.

`python -m bench.decode_parts MODEL [--position P]` on the threads the
environment gives (bench.fresh.thread_env sets them; `--rounds R` runs R fresh
processes of ours, alternated with llama.cpp's decode on the same file, and
prints the medians). One process: the whole stage built packed, a prompt of P
ids prefilled, then STEPS decode steps, each split as a stage's forward
does it, timed between (embedding, the compiled blocks, the head with its
norm). Beside them the parts of the blocks, each called alone from Python
on the stage's own matrices and shapes: every product by (type, role), the
activations' rounding, attention over P positions, the norms, RoPE and the
gate; and what a call from Python to compiled code costs (`dispatch_us`),
which each part called from Python pays and a stage's one compiled call a
forward pays once. µs of the thread's CPU time, each call's median over the
steps, summed over the layers (a wall clock on a shared machine counts the
waits for a core); llama.cpp's beside it is its process's CPU time per
decode step, and its wall time.

`blocks_rest_us`: the blocks' time that their parts (less the dispatch of
their calls from Python) do not account for (the typed lists of the stage,
copies, caches); `python_us`: the step's time
beyond its embedding, blocks and head (Python between them, the input's checks).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import numpy as np

from bench.fresh import fresh, llamacpp

STEPS = 24
# The matrices whose input rows a block rounds once, as workers.models.decode does: by the first's role.
ROUNDED = {
    "attn_q": ("attn_q", "attn_k", "attn_v"),
    "attn_output": ("attn_output",),
    "ffn_gate": ("ffn_gate", "ffn_up"),
    "ffn_down": ("ffn_down",),
}
ROUNDS = 3


# The calling thread's CPU time: on a shared machine a wall clock counts the time the thread waited
# for a core (~16 ms a preemption, longer than most parts); with 1 thread every part runs on this one.
CLOCK = time.thread_time


def _us(fn, *args) -> float:
    t0 = CLOCK()
    fn(*args)
    return (CLOCK() - t0) * 1e6


def profile(model: str, position: int) -> dict:
    """A packed stage of `model`: a decode step's parts at `position`, µs, medians over STEPS steps."""
    from bench.model import prompt_ids
    from workers import models
    from workers.models import decode, kernels
    from workers.models.ops import rms_norm
    from workers.protocol.report import LayerRange

    stage = models.build(model, LayerRange(0, models.describe(model).n_layers), "packed")
    if not stage.compiled:
        raise SystemExit(f"{model}'s packed stage does not take the compiled decode: {stage.not_compiled}")
    decode.warm_up()
    ids = prompt_ids(position, model)
    stage.forward(ids, session="parts", start_pos=0, last_only=True)
    eps = np.float32(stage.params.eps)
    taken: dict[str, list[list[float]]] = defaultdict(list)  # a part's µs each step, one per layer
    token = np.array([ids[-1]], dtype=np.int32)
    for step in range(STEPS):
        pos = position + 2 * step  # a step taken apart, then one whole as forward takes it
        cache = stage._cache("parts", pos, 1)
        cache.reserve(pos + 1)
        t0 = CLOCK()
        h = stage._embed(token.astype(np.intp))
        t1 = CLOCK()
        h = stage._blocks(h, [(cache, pos, 0, 1)], np.arange(pos, pos + 1))
        cache.length = pos + 1
        t2 = CLOCK()
        logits = rms_norm(h, stage.output_norm, eps) @ stage.head
        t3 = CLOCK()
        for name, us in (("embed_us", t1 - t0), ("blocks_us", t2 - t1), ("head_us", t3 - t2)):
            taken[name].append([us * 1e6])
        token = np.array([int(np.argmax(logits[-1]))], dtype=np.int32)
        t4, wall = CLOCK(), time.perf_counter()
        logits = stage.forward(token, session="parts", start_pos=pos + 1, last_only=True)
        taken["step_us"].append([(CLOCK() - t4) * 1e6])
        taken["step_wall_us"].append([(time.perf_counter() - wall) * 1e6])
        for name, per_layer in _parts(stage, h, pos + 2).items():
            taken[name].append(per_layer)
        token = np.array([int(np.argmax(logits[-1]))], dtype=np.int32)
    # Each call's median over the steps, then summed over the layers: one preempted call is left out.
    medians = {name: round(sum(map(statistics.median, zip(*steps, strict=True))), 1)
               for name, steps in taken.items()}  # fmt: skip
    return {"model": model, "position": position, "threads": kernels.threads(), "steps": STEPS,
            "clock": "thread CPU time", **_summary(medians)}  # fmt: skip


def _parts(stage, h: np.ndarray, length: int) -> dict[str, list[float]]:
    """Each part of the blocks called alone from Python on the stage's matrices: µs, one per layer."""
    from workers.models import decode, kernels
    from workers.models import decode_ops as ops
    from workers.models.products import activations, chunk_min_bytes, multiply, needs

    p, threads, chunk = stage.params, kernels.parallel(kernels.threads()), chunk_min_bytes()
    eps, scale = np.float32(p.eps), np.float32(p.query_scale)
    out: dict[str, list[float]] = defaultdict(list)
    x = np.ascontiguousarray(h, dtype=np.float32)
    widths = {"attn_output": p.n_heads * p.head_dim, "ffn_down": p.ffn}
    q = np.ones((1, p.n_heads * p.head_dim), dtype=np.float32)
    k = np.ones((1, p.n_kv_heads * p.head_dim), dtype=np.float32)
    norm = np.ones(p.head_dim, dtype=np.float32)
    angles = np.zeros((1, p.head_dim // 2), dtype=np.float32)
    q3 = np.empty((1, p.n_heads, p.head_dim), dtype=np.float32)
    k3 = np.empty((1, p.n_kv_heads, p.head_dim), dtype=np.float32)
    gate = np.ones((1, p.ffn), dtype=np.float32)
    keys = np.random.default_rng(0).standard_normal((p.n_kv_heads, length + 1, p.head_dim), dtype=np.float32)
    values, att = keys.copy(), np.empty((1, p.n_heads * p.head_dim), dtype=np.float32)
    for index, w in enumerate(stage.blocks):
        rounding, a = 0.0, None
        for role in decode.MATRICES:
            m = getattr(w, role).blocks
            if role in ROUNDED:  # the rows are rounded once for the matrices that take the same input
                group = tuple(getattr(w, r).blocks for r in ROUNDED[role])
                rows = np.ones((1, widths.get(role, p.hidden)), dtype=np.float32)
                t0 = CLOCK()
                a = activations(rows, needs(group))
                rounding += (CLOCK() - t0) * 1e6
            t1 = CLOCK()
            multiply(a, m, threads, chunk)
            t2 = CLOCK()
            # every layer gets an entry under each name, zero where its matrix is of another type
            for kind in {getattr(b, role).kind for b in stage.blocks}:
                us = (t2 - t1) * 1e6 if kind == getattr(w, role).kind else 0.0
                out[f"product {kind.upper()} {role}"].append(us)
        out["rounding_us"].append(rounding)
        out["norms_us"].append(
            4 * _us(ops.rms_norm, x, w.attn_norm, eps)  # attn, post-attn, ffn, post-ffn
            + _us(ops.prepare, q, p.n_heads, p.head_dim, norm[:0], norm, eps)
            + _us(ops.prepare, k, p.n_kv_heads, p.head_dim, norm[:0], norm, eps)
        )
        out["rope_us"].append(
            _us(ops.rotate, q, p.n_heads, p.head_dim, 1, angles, angles, q3)
            + _us(ops.rotate, k, p.n_kv_heads, p.head_dim, 1, angles, angles, k3)
        )
        out["gate_us"].append(_us(ops.gated, gate, gate, p.ffn, True))
        window = p.window[stage.layers.start + index]
        out["attention_us"].append(_us(ops.attend, q3, k3, k3, keys, values, length, att, scale, window))
        out["calls"].append(len(decode.MATRICES) + len(ROUNDED) + 4 + 2 + 2 + 1 + 1)  # from Python above
    out["dispatch_us"].append(_us(ops.rms_norm, x[:, :1], w.attn_norm[:1], eps))
    return out


def _summary(m: dict[str, float]) -> dict:
    """The step's parts, the products by type and role, and what the parts leave unexplained."""
    products = {k.removeprefix("product "): v for k, v in m.items() if k.startswith("product ")}
    by_type: dict[str, float] = defaultdict(float)
    for key, us in products.items():
        by_type[key.split()[0]] += us
    inside = ("rounding_us", "attention_us", "norms_us", "rope_us", "gate_us")
    # Each part called from Python paid a dispatch that the compiled blocks do not.
    dispatch = m["calls"] * m["dispatch_us"]
    explained = sum(products.values()) + sum(m[k] for k in inside) - dispatch
    return {
        "step_us": m["step_us"],
        "step_wall_us": m["step_wall_us"],
        "parts_us": {k: m[k] for k in ("embed_us", "blocks_us", "head_us")},
        "python_us": round(m["step_us"] - m["embed_us"] - m["blocks_us"] - m["head_us"], 1),
        "products_by_type_us": {k: round(v, 1) for k, v in sorted(by_type.items())},
        "products_us": products,
        **{k: m[k] for k in inside},
        "blocks_rest_us": round(m["blocks_us"] - explained, 1),
        "dispatch_us": m["dispatch_us"],
        "dispatch_in_parts_us": round(dispatch, 1),
    }


def rounds(model: str, position: int, n: int = ROUNDS) -> dict:
    """n fresh processes of ours (1 thread) alternated with llama.cpp's decode on the same file; medians."""
    ours, theirs = [], []
    for _ in range(n):
        ours.append(
            fresh(["-m", "bench.decode_parts", model, "--position", str(position), "--rounds", "0"], 1)
        )
        theirs.append(llamacpp(1, model, reps=1, prompt_tokens=position))
    flat = [_flat(r) for r in ours]
    medians = {k: round(statistics.median(f[k] for f in flat), 1) for k in flat[0]}
    llama_wall = statistics.median(1e6 / r["decode_tok_s"] for r in theirs)
    llama_cpu = statistics.median(r["decode_cpu_ms"] * 1e3 / r["new_tokens"] for r in theirs)
    return {"model": model, "position": position, "rounds": n, "ours": medians,
            "ours_runs_step_us": [r["step_us"] for r in ours], "llamacpp_step_us": round(llama_cpu, 1),
            "llamacpp_step_wall_us": round(llama_wall, 1),
            "llamacpp_runs_decode_tok_s": [r["decode_tok_s"] for r in theirs]}  # fmt: skip


def lines(r: dict) -> list[str]:
    """The medians of `rounds` as a person reads them: each part's µs and share of our step, llama.cpp's."""
    o = r["ours"]
    step = o["step_us"]
    parts = [("head (with its norm)", o["parts_us/head_us"]), ("embedding", o["parts_us/embed_us"])]
    parts += [(f"products {t}", us) for t, us in _by_prefix(o, "products_by_type_us/").items()]
    parts += [(name.removesuffix("_us").replace("_", " "), o[name])
              for name in ("rounding_us", "attention_us", "norms_us", "rope_us", "gate_us", "blocks_rest_us",
                           "python_us")]  # fmt: skip
    out = [f"decode step of {r['model']} at position {r['position']}, 1 thread, CPU µs (medians of "
           f"{r['rounds']} processes): ours {step:.0f} µs, llama.cpp {r['llamacpp_step_us']:.0f} µs "
           f"(× {r['llamacpp_step_us'] / step:.2f} our speed; wall µs llama.cpp "
           f"{r['llamacpp_step_wall_us']:.0f}, ours {o['step_wall_us']:.0f})"]  # fmt: skip
    out += [f"  {name}: {us:.0f} µs ({us / step:.0%})" for name, us in parts]
    return out


def _by_prefix(flat: dict[str, float], prefix: str) -> dict[str, float]:
    return {k.removeprefix(prefix): v for k, v in flat.items() if k.startswith(prefix)}


def _flat(r: dict, prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in r.items():
        if isinstance(v, dict):
            out |= _flat(v, f"{prefix}{k}/")
        elif isinstance(v, float) and k not in ("position", "threads", "steps"):
            out[prefix + k] = v
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.decode_parts", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="gemma3, smollm2 or a path to a .gguf file")
    parser.add_argument("--position", type=int, default=110, help="the prompt's length before the steps")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="fresh processes each; 0: this one alone")
    args = parser.parse_args()
    if args.position < 1:
        parser.error(f"--position must be at least 1, got {args.position}")
    result = (
        rounds(args.model, args.position, args.rounds) if args.rounds else profile(args.model, args.position)
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
