"""What a served decode step costs beyond its stages' compute: the coordinator's part, on a fake model.

A coordinator is started as a user starts it (`python -m coordinator run
--serve`), on fake workers that sleep a fixed time per forward and answer a
SmolLM2-sized vocabulary of logits (49,152 float32 a row, as a real head
does; workers.fake), with SmolLM2's tokenizer. Runs are posted over HTTP, greedy
and seeded-sampled, on 1 and 3 stages. Per decode step, from the run's record:
its wall time on the coordinator's clock, the workers' compute, the difference
(the overhead: hops, sampling, recording, events), and the coordinator's and
workers' CPU time (schedstat, as bench/served.py reads it), which a shared
machine's noise blurs less than wall times. Medians of several runs.

    python -m bench.overhead [--reps 5] [--tokens 128] [--stages 1 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from bench.served import NS_PER_MS, WARM_TOKENS, run, schedstat, serving, worker_pids

# Each stage's compute per forward: a fixed sleep, about SmolLM2's packed decode step at 1 thread.
DELAY_MS = 10.0
# A language model of SmolLM2's shape as far as the wire sees it: hidden rows between stages, a
# vocabulary of logits from the last (its tokenizer, so the text is decoded as a served run's is).
VOCAB, HIDDEN, LAYERS = 49_152, 576, 24
PROMPT = "The history of computing is a story of machines that grew smaller and faster each decade."
# Full-vocabulary softmax with a nucleus: the costliest sampling a request asks for.
SAMPLED = {"temperature": 0.8, "top_p": 0.95, "seed": 7}
FACES = {"greedy": {}, "sampled": SAMPLED}
# Seconds between polls of a run: few, so that the polls' CPU stays out of the steps' figures.
POLL_S = 0.5


def spec(delay_ms: float = DELAY_MS) -> str:
    """The fake model the bench serves."""
    return f"fake:layers={LAYERS},hidden={HIDDEN},vocab={VOCAB},delay_ms={delay_ms:g},tokenizer=smollm2"


def _cpu(pids: dict[str, list[int]]) -> dict[str, int]:
    """CPU time so far, ns, of the coordinator and of its workers together."""
    return {k: sum(schedstat(pid)[0] for pid in group) for k, group in pids.items()}


def one_run(base: str, pids: dict[str, list[int]], tokens: int, sampling: dict) -> dict:
    """A timed run of `tokens` and, before it, one of the prompt alone: its per-step figures, ms."""
    before = _cpu(pids)
    run(base, PROMPT, 1, POLL_S, **sampling)
    middle = _cpu(pids)
    view = run(base, PROMPT, tokens, POLL_S, **sampling)
    after = _cpu(pids)
    decode = view["decode"]
    steps = max(1, decode["seq"])
    # What the timed run cost beyond the prompt-alone one is its decode steps'.
    cpu = {k: ((after[k] - middle[k]) - (middle[k] - before[k])) / NS_PER_MS / steps for k in pids}
    wall = decode["total_forward_ms"] / steps
    compute = sum(t["compute_ms"] for t in decode["timings"]) / steps
    forward = sum(t["forward_ms"] for t in decode["timings"]) / steps
    return {
        "steps": steps,
        "wall_ms": wall,
        "compute_ms": compute,
        "overhead_ms": wall - compute,
        "hops_ms": forward - compute,
        "coordinator_cpu_ms": cpu["coordinator"],
        "workers_cpu_ms": cpu["workers"],
    }


def measure(stages: int, reps: int, tokens: int, delay_ms: float = DELAY_MS) -> dict:
    """Greedy and sampled runs through one coordinator on `stages` fake stages, alternated `reps` times."""
    env = dict(os.environ)
    with serving(env, spec(delay_ms), stages, "f32") as (base, proc):
        pids = {"coordinator": [proc.pid], "workers": worker_pids(proc.pid)}
        if len(pids["workers"]) != stages:
            raise SystemExit(f"the coordinator has {len(pids['workers'])} workers, not {stages}")
        for sampling in FACES.values():
            run(base, PROMPT, WARM_TOKENS, POLL_S, **sampling)
        runs: dict[str, list[dict]] = {face: [] for face in FACES}
        for _ in range(reps):
            for face, sampling in FACES.items():
                runs[face].append(one_run(base, pids, tokens, sampling))
    return {face: medians(rs) for face, rs in runs.items()}


def medians(runs: list[dict]) -> dict:
    """Each figure's median over the runs (ms, 3 decimals), and every run's overhead."""
    keys = [k for k in runs[0] if k != "steps"]
    out = {k: round(statistics.median(r[k] for r in runs), 3) for k in keys}
    return out | {"steps": runs[0]["steps"], "overheads_ms": [round(r["overhead_ms"], 3) for r in runs]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="runs of each kind (median)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens a timed run generates")
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--delay-ms", type=float, default=DELAY_MS, help="each stage's compute per forward")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    results = {
        "model": spec(args.delay_ms),
        "tokens": args.tokens,
        "reps": args.reps,
        "stages": {str(n): measure(n, args.reps, args.tokens, args.delay_ms) for n in args.stages},
    }
    text = json.dumps(results, indent=1)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text, file=sys.stdout)


if __name__ == "__main__":
    main()
