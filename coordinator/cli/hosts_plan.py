"""`rlx-cluster plan --hosts FILE`: place a model over hosts described in a file, predict, simulate."""

from __future__ import annotations

import argparse
import asyncio

from coordinator.plan.costmodel import CONTEXT
from coordinator.plan.hosts import load_hosts, model_shape
from coordinator.plan.placement import OBJECTIVES, HostPlan, plan_hosts
from coordinator.plan.simulate import Workload, simulate
from coordinator.units import size_text

PROMPT = 128  # positions of the prompt whose prefill is predicted (a short chat's)
NEW_TOKENS = 64
SHOWN = 4  # spares named per reason; the rest counted


def add_host_options(plan: argparse.ArgumentParser) -> None:
    """The options of a plan over hosts that are described rather than here."""
    plan.add_argument(
        "--hosts", default=None, metavar="FILE",
        help="a TOML file of hosts (cores, memory, speed or measured costs, link latency and bandwidth; "
        "see docs/hosts.toml): place the model over them and predict its times",
    )  # fmt: skip
    plan.add_argument(
        "--objective", choices=OBJECTIVES, default="latency",
        help="with --hosts: least decode step (latency, the default: what one generation waits per token, "
        "and with the scheduler's two lanes a bound on throughput too) or least slowest stage (throughput)",
    )  # fmt: skip
    plan.add_argument(
        "--simulate", type=_count, default=0, metavar="N",
        help="with --hosts: simulate N concurrent generations through the placement",
    )  # fmt: skip
    plan.add_argument(
        "--prompt-tokens", type=_count, default=PROMPT, help="with --hosts: the prompt's positions"
    )
    plan.add_argument("--new-tokens", type=_count, default=NEW_TOKENS, help="with --simulate: tokens per run")


def _count(text: str) -> int:
    if not (text.isascii() and text.isdigit() and len(text) < 9) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return int(text)


async def plan_over_hosts(args: argparse.Namespace) -> int:
    """Print the placement, its predicted times and, with --simulate, what N generations would see."""
    lines = await asyncio.to_thread(host_plan_lines, args.hosts, args.model, args.objective,
                                    args.prompt_tokens, args.simulate, args.new_tokens)  # fmt: skip
    print("\n".join(lines), flush=True)
    return 0


def host_plan_lines(
    path: str, model: str | None, objective: str, prompt: int, runs: int = 0, new_tokens: int = NEW_TOKENS
) -> list[str]:
    """The plan over the hosts of `path` for a person."""
    hosts = load_hosts(path)
    shape = model_shape(hosts, model)
    plan = plan_hosts(hosts.hosts, shape, hosts.reference, objective)
    lines = _placement_lines(plan, shape.name, shape.n_layers)
    decode = plan.decode_ms()
    prefill = plan.prefill_ms(prompt)
    lines.append(f"decode: {decode:.2f} ms per token, {1000 / decode:.1f} tokens/s (one generation, "
                 f"attention over {CONTEXT} positions)")  # fmt: skip
    lines.append(f"prefill: {prefill / prompt:.2f} ms per token, {prompt * 1000 / prefill:.1f} tokens/s "
                 f"({prompt}-token prompt in {prefill:.0f} ms)")  # fmt: skip
    lines.append(
        f"slowest stage: {plan.slowest_ms():.2f} ms a step (compute and transfer; objective {objective})"
    )
    if runs:
        p = simulate(plan.stages, Workload(runs, prompt, new_tokens))
        lines.append(f"simulated {runs} generations of {prompt}+{new_tokens} tokens: {p.tokens_per_s:.1f} "
                     f"tokens/s, decode {p.decode_tokens_per_s:.1f} tokens/s")  # fmt: skip
        lines.append(f"  time to first token p50 {p.percentile('ttft_ms', 50):.0f} ms, "
                     f"p99 {p.percentile('ttft_ms', 99):.0f} ms")  # fmt: skip
        lines.append(f"  inter-token latency p50 {p.percentile('itl_ms', 50):.1f} ms, "
                     f"p99 {p.percentile('itl_ms', 99):.1f} ms")  # fmt: skip
    return lines


def _placement_lines(plan: HostPlan, name: str, n_layers: int) -> list[str]:
    how = "exact" if plan.exact else "heuristic"
    lines = [f"{name} over {len(plan.stages)} of {len(plan.stages) + len(plan.spares)} hosts ({how})"]
    for i, s in enumerate(plan.stages):
        lines.append(
            f"stage {i}: {s.host.name} layers {s.layers} ({len(s.layers)} of {n_layers})  compute "
            f"{s.compute_ms():.2f} ms + hop {s.hop_ms():.2f} ms per token"
            f" ({size_text(s.host.memory_bytes)}, speed {s.host.speed:g}, {s.host.latency_ms:.1f} ms away)"
        )
    by_reason: dict[str, list[str]] = {}
    for host, why in plan.spares:
        by_reason.setdefault(why, []).append(host.name)
    for why, names in by_reason.items():
        shown = ", ".join(names[:SHOWN]) + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")
        lines.append(f"spare: {shown}: {why}")
    return lines
