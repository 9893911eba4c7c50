"""Choose which hosts serve, in which order, and which contiguous layers each holds.

A decode step walks the stages in order, each hop through the coordinator:
a stage costs its compute plus its host's round trip and the bytes it is sent
and sends back over its link. Two objectives:

- latency (the default): the least decode step, Σ stage compute + Σ hops,
  what one generation waits per token. With the scheduler's two lanes
  (coordinator.runs.scheduler) at most two forwards are in flight, so beyond
  two stages the step bounds concurrent runs' throughput too; ties go to the
  plan whose slowest stage is fastest.
- throughput: the least slowest stage (compute plus its link's transfer: what
  a stage is busy with per step, the bound on batches pipelined through it),
  ties to the least decode step.

A host held to a share of a core by a CPU quota computes a step at full
speed, but no more of its share's worth a step on average: its stage's
compute over that share bounds the step from below (latency) and is what
the stage is busy with (throughput). With such a host the latency plan is
the least over limits on that bound of max(Σ within the limit, the limit).

Each stage must fit its host's memory. Exact over every subset and order of
hosts, by dynamic programming over (hosts used, layers covered), for up to
EXACT_HOSTS hosts; beyond, a heuristic: the hosts ordered by how fast they
compute the whole model, the LAST_TRIED hosts that hold the last layer
cheapest each tried as the last stage (its link carries the logits) and the
others, in that order, each given a range or skipped, by the same dynamic
programming over (hosts in the order, layers).
A host given nothing is a spare, with the reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from coordinator.plan.costmodel import ModelShape
from coordinator.plan.hosts import Host, LayerCosts, Reference
from coordinator.plan.split import PlanError
from coordinator.units import size_text
from workers.protocol.report import LayerRange

OBJECTIVES = ("latency", "throughput")
# Up to 10 hosts the exact plan takes ~1 s of CPU for 30 layers (2^H subsets × H hosts × a layers² step).
EXACT_HOSTS = 10
# Costs within this share of each other are a tie (they come from sums in different orders).
TIE = 1e-9
REFERENCE = Reference()
# Beyond EXACT_HOSTS, how many hosts are tried as the last stage (each costs a pass over the others).
LAST_TRIED = 8
# The part of a CPU quota a plan may use. The quota is a budget per period (100 ms by default), spent
# at full speed: a stage using all of it on average is throttled to the period's end whenever its steps
# run long (a prompt's forward, a busy neighbour), so the plan keeps a quarter of it spare.
QUOTA_USE = 0.75


@dataclass(frozen=True)
class PlannedStage:
    """A host given contiguous layers, and what a forward through them costs there.

    in_bytes: bytes the stage is sent per row; out_bytes: bytes it sends back per row out
    (the last stage's rows are logits; a prompt's last stage sends one).
    """

    host: Host
    layers: LayerRange
    costs: LayerCosts
    in_bytes: int
    out_bytes: int

    def compute_ms(self, rows: int = 1) -> float:
        """The worker's time for a forward of `rows` rows."""
        return self.costs.range_ms(self.layers.start, self.layers.end, rows)

    def transfer_ms(self, rows: int = 1, rows_out: int | None = None) -> float:
        """The link's time for a forward's bytes, in and out."""
        sent = self.in_bytes * rows + self.out_bytes * (rows if rows_out is None else rows_out)
        return sent / self.host.bandwidth * 1e3

    def hop_ms(self, rows: int = 1, rows_out: int | None = None) -> float:
        """What the link adds to a forward: its round trip and its transfer."""
        return self.host.latency_ms + self.transfer_ms(rows, rows_out)

    def step_ms(self, rows: int = 1, rows_out: int | None = None) -> float:
        """A forward through the stage as the coordinator sees it: compute and hop."""
        return self.compute_ms(rows) + self.hop_ms(rows, rows_out)

    def held_ms(self) -> float:
        """The least a decode step takes with its host's CPU quota: compute over the share used (0: none)."""
        share = self.host.cpu_share * QUOTA_USE
        return self.compute_ms() / share if share else 0.0

    def busy_ms(self) -> float:
        """What the stage is busy with per decode step (compute, as its quota holds it, and transfer)."""
        return max(self.compute_ms(), self.held_ms()) + self.transfer_ms()


@dataclass(frozen=True)
class HostPlan:
    """A placement: stages in order, spares with the reason each was left out.

    exact: whether every subset and order of the hosts was weighed (else the heuristic's).
    """

    stages: list[PlannedStage]
    spares: list[tuple[Host, str]]
    objective: str
    exact: bool

    def decode_ms(self) -> float:
        """One generation's decode step: Σ stage compute + Σ hops, or what a CPU quota holds it to."""
        return max(sum(s.step_ms() for s in self.stages), max(s.held_ms() for s in self.stages))

    def slowest_ms(self) -> float:
        """The busiest stage's time per step: what bounds pipelined throughput."""
        return max(s.busy_ms() for s in self.stages)

    def prefill_ms(self, prompt: int) -> float:
        """A prompt of `prompt` positions forwarded at once (one logits row back)."""
        return sum(s.step_ms(prompt, rows_out=1) for s in self.stages)


def plan_hosts(
    hosts: Sequence[Host],
    shape: ModelShape,
    ref: Reference = REFERENCE,
    objective: str = "latency",
    stages: int | None = None,
) -> HostPlan:
    """The placement of `shape` over `hosts` best by `objective`; a PlanError when none fits memory.

    stages: exactly this many stages (a pipeline whose stages are already there, as a join
    listener's); None lets the plan use as many hosts as help. Exact plans only (up to EXACT_HOSTS).
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; accepted: {', '.join(OBJECTIVES)}")
    if not hosts:
        raise PlanError("no hosts to plan over")
    if stages is not None and (len(hosts) > EXACT_HOSTS or not 1 <= stages <= len(hosts)):
        raise PlanError(f"{stages} stages cannot be planned exactly over {len(hosts)} hosts")
    costs = [h.costs(shape, ref) for h in hosts]
    tables = [_tables(h, c, shape) for h, c in zip(hosts, costs, strict=True)]
    exact = len(hosts) <= EXACT_HOSTS
    rank = [sum(c.weights_ms) + sum(c.row_ms) for c in costs]  # the whole model on each host
    busy = [t[1] for t in tables]
    bound = None
    if objective == "throughput":
        bound, _, with_each = _search(exact, busy, busy, np.maximum, rank, stages)
    lat = [_within(t[0], t[1], bound) for t in tables]
    if any(h.cpu_share for h in hosts):
        value, chosen, with_latency = _held_search(exact, lat, busy, [t[2] for t in tables], rank, stages)
    else:
        value, chosen, with_latency = _search(exact, lat, busy, np.add, rank, stages)
    if not np.isfinite(value):
        raise PlanError(_no_fit(hosts, shape))
    if bound is None:
        bound, with_each = value, with_latency
    planned = [
        PlannedStage(hosts[h], LayerRange(s, e), costs[h], shape.in_bytes(s == 0, 1), shape.out_bytes(
            e == shape.n_layers, 1)) for h, s, e in chosen
    ]  # fmt: skip
    used = {h for h, _, _ in chosen}
    spares = [(hosts[i], _why_spare(hosts[i], shape, bound, with_each, i, objective))
              for i in range(len(hosts)) if i not in used]  # fmt: skip
    return HostPlan(planned, spares, objective, exact)


def _tables(host: Host, costs: LayerCosts, shape: ModelShape) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(step, busy, held)[s, e] of a stage of layers s..e on `host` (see PlannedStage); inf where it
    cannot hold them."""
    n = shape.n_layers
    w = np.concatenate([[0.0], np.cumsum(costs.weights_ms)])
    r = np.concatenate([[0.0], np.cumsum(costs.row_ms)])
    b = np.concatenate([[0.0], np.cumsum(shape.weight_bytes())])
    s, e = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    compute = costs.stage_ms + (w[e] - w[s]) + (r[e] - r[s])
    sent = np.where(s == 0, shape.in_bytes(True, 1), shape.in_bytes(False, 1)) + np.where(
        e == n, shape.out_bytes(True, 1), shape.out_bytes(False, 1))  # fmt: skip
    transfer = sent / host.bandwidth * 1e3
    bad = (e <= s) | (b[e] - b[s] > host.memory_bytes)
    held = compute / (host.cpu_share * QUOTA_USE) if host.cpu_share else np.zeros_like(compute)
    step = np.where(bad, np.inf, compute + host.latency_ms + transfer)
    busy = np.where(bad, np.inf, np.maximum(compute, held) + transfer)
    return step, busy, np.where(bad, np.inf, held)


def _within(step: np.ndarray, busy: np.ndarray, bound: float | None) -> np.ndarray:
    """`step` where the stage's busy time is within `bound` (inf elsewhere)."""
    if bound is None or not np.isfinite(bound):
        return step
    return np.where(busy <= bound * (1 + TIE) + 1e-12, step, np.inf)


def _better(p: np.ndarray, q: np.ndarray, bp: np.ndarray, bq: np.ndarray) -> np.ndarray:
    """Where (p, q) beats (bp, bq): a lower primary, or a tie and a lower secondary."""
    tol = TIE * np.maximum(1.0, np.abs(np.where(np.isfinite(bp), bp, 0.0)))
    return (p < bp - tol) | ((p <= bp + tol) & (q < bq))


def _step(prev_p, prev_q, cp, cq, combine):
    """Best (primary, secondary, start) to reach each end e from the states `prev` through one stage."""
    p = combine(prev_p[:, None], cp)  # (start, end)
    q = np.maximum(prev_q[:, None], cq)
    best_p = p.min(axis=0)
    tol = TIE * np.maximum(1.0, np.abs(np.where(np.isfinite(best_p), best_p, 0.0)))
    q = np.where(p <= best_p + tol, q, np.inf)
    start = q.argmin(axis=0)
    return best_p, q[start, np.arange(q.shape[1])], start


def _search(
    exact: bool, cp: list[np.ndarray], cq: list[np.ndarray], combine, rank: list[float], stages: int | None
):
    """The best plan by the primary costs `cp` (combined by `combine`), ties by the greatest of `cq`."""
    return _subsets(cp, cq, combine, stages) if exact else _ordered(cp, cq, combine, rank)


def _held_search(
    exact: bool,
    lat: list[np.ndarray],
    busy: list[np.ndarray],
    held: list[np.ndarray],
    rank: list[float],
    stages: int | None,
):
    """The least max(Σ steps, the longest any quota holds a stage) over the latency tables `lat`.

    For a limit on what a quota may hold a stage to, the plan of least Σ within it; that Σ falls as the
    limit rises, so the best is where it crosses the limit, found by bisection over the limits there are.
    """
    limits = np.unique(np.concatenate([h[np.isfinite(h)] for h in held]))
    if not len(limits):  # no host can hold any stage
        return _search(exact, lat, busy, np.add, rank, stages)
    tried: dict[int, tuple] = {}

    def within(i: int) -> tuple:
        if i not in tried:
            masked = [np.where(h <= limits[i], t, np.inf) for t, h in zip(lat, held, strict=True)]
            tried[i] = _search(exact, masked, busy, np.add, rank, stages)
        return tried[i]

    lo, hi = 0, len(limits) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if within(mid)[0] <= limits[mid] else (mid + 1, hi)
    best = min({lo, max(lo - 1, 0)}, key=lambda i: max(within(i)[0], limits[i]))
    value, chosen, with_each = within(best)
    if not np.isfinite(value):
        return value, chosen, with_each
    most = max(held[h][s, e] for h, s, e in chosen)
    return max(value, float(most)), chosen, with_each


def _subsets(cp: list[np.ndarray], cq: list[np.ndarray], combine, stages: int | None = None):
    """Exact: the best over every subset and order of hosts, by (hosts used, layers covered).

    Returns the best value, its stages [(host, start, end)] in order, and per host
    the best value of a plan that uses it; with `stages`, of plans of exactly that many hosts.
    """
    count, n1 = len(cp), cp[0].shape[0]
    fp = np.full((1 << count, n1), np.inf)
    fq = np.full((1 << count, n1), np.inf)
    fp[0, 0] = fq[0, 0] = 0.0  # costs are >= 0: nothing yet, for a sum as for a greatest
    came = np.full((1 << count, n1, 2), -1, dtype=np.int64)
    for mask in range(1, 1 << count):
        for h in range(count):
            prev = mask ^ (1 << h)
            if not mask & (1 << h) or not np.isfinite(fp[prev]).any():
                continue
            p, q, start = _step(fp[prev], fq[prev], cp[h], cq[h], combine)
            won = _better(p, q, fp[mask], fq[mask])
            fp[mask] = np.where(won, p, fp[mask])
            fq[mask] = np.where(won, q, fq[mask])
            came[mask][won] = np.stack([np.full(won.sum(), h), start[won]], axis=1)
    ends = fp[:, -1].copy()
    if stages is not None:
        ends[[m.bit_count() != stages for m in range(1 << count)]] = np.inf
    best = min(range(1 << count), key=lambda m: (ends[m], fq[m, -1]))
    with_each = [
        min((ends[m] for m in range(1 << count) if m & (1 << h)), default=np.inf) for h in range(count)
    ]
    stages, mask, end = [], best, n1 - 1
    while mask:
        h, start = came[mask, end]
        stages.insert(0, (int(h), int(start), end))
        mask, end = mask ^ (1 << int(h)), int(start)
    return float(ends[best]), stages, with_each


def _ordered(cp: list[np.ndarray], cq: list[np.ndarray], combine, rank: list[float]):
    """Beyond EXACT_HOSTS: hosts by whole-model speed, each tried last, the rest given a range or skipped."""
    count, n1 = len(cp), cp[0].shape[0]
    order = sorted(range(count), key=lambda h: (rank[h], h))
    best: tuple[float, float, list] = (np.inf, np.inf, [])
    # The hosts whose stage of the last layer alone costs least (their link carries the logits) are tried.
    lasts = sorted(range(count), key=lambda h: (cp[h][-2, -1], rank[h], h))[:LAST_TRIED]
    for last in lasts:
        p = np.full(n1, np.inf)
        q = np.full(n1, np.inf)
        p[0] = q[0] = 0.0
        trail: list[tuple[int, np.ndarray, np.ndarray]] = []  # per host: where each end came from
        for h in (h for h in order if h != last):
            sp, sq, start = _step(p, q, cp[h], cq[h], combine)
            won = _better(sp, sq, p, q)
            trail.append((h, won, start))
            p, q = np.where(won, sp, p), np.where(won, sq, q)
        sp, sq, start = _step(p, q, cp[last], cq[last], combine)
        if _better(sp[-1:], sq[-1:], np.array([best[0]]), np.array([best[1]]))[0]:
            stages, end = [(last, int(start[-1]), n1 - 1)], int(start[-1])
            for h, won, starts in reversed(trail):
                if end and won[end]:
                    stages.insert(0, (h, int(starts[end]), end))
                    end = int(starts[end])
            best = (float(sp[-1]), float(sq[-1]), stages)
    return best[0], best[2], [np.inf] * count


def _why_spare(
    host: Host, shape: ModelShape, value: float, with_each: list[float], i: int, objective: str
) -> str:
    """Why `host` serves nothing, for a person."""
    smallest = min(shape.held_bytes(layer, layer + 1) for layer in range(shape.n_layers))
    if smallest > host.memory_bytes:
        return f"its {size_text(host.memory_bytes)} cannot hold one layer ({size_text(int(smallest))})"
    what = "decode step" if objective == "latency" else "slowest stage"
    if np.isfinite(with_each[i]):
        return (f"too slow to help: the best plan that uses it takes {with_each[i]:.2f} ms a {what}, "
                f"without it {value:.2f} ms")  # fmt: skip
    if len(with_each) > EXACT_HOSTS:
        return f"left out by the ordered heuristic (over {EXACT_HOSTS} hosts): its layers and hop cost more"
    return "no plan that fits the hosts' memory can use it"


def _no_fit(hosts: Sequence[Host], shape: ModelShape) -> str:
    need = shape.held_bytes(0, shape.n_layers)
    free = sum(h.memory_bytes for h in hosts)
    return (f"the {len(hosts)} hosts cannot hold {shape.name}'s {shape.n_layers} layers in any placement: "
            f"together {size_text(free)}, the model needs about {size_text(int(need))}")  # fmt: skip
