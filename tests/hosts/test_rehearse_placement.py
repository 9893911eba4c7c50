"""The speed-aware placement rehearsed on namespace hosts that differ, against the even split on them.

Three joiners: one as this machine is, one held to 40% of a core by a cgroup
CPU quota, one behind a 100 Mbit/s link (tbf both ways); the coordinator and
an HTTP client on hosts of their own. The short test (make test) checks what
the placement is made from: the quota'd joiner offers its share of a core,
the narrow link is probed at its rate, the quota holds a busy process to its
share. The rehearsal (make hosts; a soak test, ~2 minutes) serves SmolLM2 on
the same hosts placed by what the joiners measured and split evenly in join
order, in turn, and times generations through the API.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Iterator

import pytest

from tests.hosts.netns import wait_until
from tests.hosts.rehearsal import JOINERS, NARROW_MBIT, QUOTA_US, Case, Rehearsal, rehearsal_hosts

pytestmark = pytest.mark.timeout(900)

# A fake model's costs are declared, not measured: its joiners offer at once.
FAKE = "fake:layers=8,hidden=64"
MODEL = "smollm2"
PROMPT = "The lighthouse keeper's long story began on a stormy night, when"
TOKENS = 32
RUNS = 4  # timed generations per serve, after one that warms the caches and the links up
ROUNDS = (
    2  # each placement served this many times, in turn with the other: load that comes and goes hits both
)
PLANS = ("latency", "even")
SPIN_S = 1.0


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rehearsal]:
    with rehearsal_hosts(tmp_path_factory.mktemp("rehearse")) as made:
        yield made


def test_a_quotad_joiner_offers_its_share_and_the_narrow_link_is_probed_at_its_rate(hosts):
    try:
        case = hosts.serve(FAKE, "latency", list(JOINERS))
        by_host = {name: m for (name, _), m in zip(case.stages, case.members, strict=True)}
        assert hosts.procs["quota"].pid in hosts.quotas["quota"].pids()
    finally:
        hosts.stop()
    assert case.how.startswith("placed by measured speed, memory and link (latency)"), case.how
    shares = {name: m["speed"]["cpu_share"] for name, m in by_host.items()}
    assert shares == {"fast": None, "quota": QUOTA_US / 100_000, "narrow": None}, shares
    mbps = {name: m["link"]["bandwidth_mbps"] for name, m in by_host.items()}
    # tbf holds the rate to within a few percent; the probe's quickest echo of 1 MiB sees it so.
    assert NARROW_MBIT * 0.85 <= mbps["narrow"] <= NARROW_MBIT * 1.05, mbps
    assert min(mbps["fast"], mbps["quota"]) > 5 * NARROW_MBIT, mbps  # a veth pair: gigabits


def test_the_quota_holds_a_busy_process_to_its_share_of_a_core(hosts):
    spin = f"import time\nend = time.monotonic() + {SPIN_S}\nwhile time.monotonic() < end: pass\n"
    spin += "print('spun for cpu seconds:', time.process_time())"
    try:
        proc = hosts.start("quota", [sys.executable, "-I", "-c", spin])
        wait_until(lambda: proc.poll() is not None, 30, "the spin to end", lambda: hosts.tail("quota"))
    finally:
        hosts.stop()
    said = hosts.log("quota").read_text().splitlines()
    [cpu] = [float(line.rpartition(" ")[2]) for line in said if line.startswith("spun for cpu seconds:")]
    # 0.4 s of a second at 40%: the bucket's first period may run a little over, python's start is in it.
    assert 0.3 * SPIN_S <= cpu <= 0.5 * SPIN_S, cpu


@pytest.fixture(scope="module")
def cases(hosts: Rehearsal) -> dict[str, list[Case]]:
    """Each placement served ROUNDS times, in turn with the other, SmolLM2 timed through the API."""
    out: dict[str, list[Case]] = {}
    for _ in range(ROUNDS):
        for plan in PLANS:
            try:
                case = hosts.serve(MODEL, plan, list(JOINERS))
                hosts.decode(case, PROMPT, TOKENS, RUNS)
            finally:
                hosts.stop()
            out.setdefault(plan, []).append(case)
            print(f"\nrehearsal {json.dumps(case.summary())}")
    return out


def merged(rounds: list[Case]) -> Case:
    """The rounds of one placement as one case: every timed run, the first round's plan and prediction."""
    case = Case(rounds[0].plan, rounds[0].how, rounds[0].stages, members=rounds[0].members)
    for r in rounds:
        case.tokens_per_s += r.tokens_per_s
        case.stage_ms += r.stage_ms
        case.compute_ms += r.compute_ms
        case.throttled_ms += r.throttled_ms
    return case


@pytest.mark.soak
def test_the_speed_aware_placement_decodes_faster_than_the_even_split_on_the_same_hosts(cases):
    aware, even = merged(cases["latency"]), merged(cases["even"])
    speedup = statistics.median(aware.tokens_per_s) / statistics.median(even.tokens_per_s)
    predicted = even.predicted_ms() / aware.predicted_ms()
    note = {"speedup": round(speedup, 2), "predicted_speedup": round(predicted, 2),
            "cases": [aware.summary(), even.summary()]}  # fmt: skip
    print(f"\nrehearsal closing {json.dumps(note)}")
    # Every placement keeps one plan across rounds: the joiners measured once, their costs kept.
    assert all(r.stages == cases[p][0].stages for p in PLANS for r in cases[p]), note
    # The even split gives the last stage, whose link carries the logits (196 KB a token), to the narrow
    # host; the measured placement does not.
    assert even.stages[-1][0] == "narrow" and aware.stages[-1][0] != "narrow", note
    assert speedup >= 1.3, note
    # Both placements ran on the same hosts under the same load (which slows every compute alike): the
    # speedup the plan predicted is what was measured, within 15%.
    assert abs(speedup / predicted - 1) <= 0.15, note
    # A stage held by a quota is given no more than its share of the step: it was (all but) never
    # throttled while generating (5%: a prompt's forward may spend a period's quota at once). The
    # others share the rest evenly: the slowest within 15% of their mean.
    timed_ms = sum(TOKENS / tps * 1000 for tps in aware.tokens_per_s)
    assert aware.throttled_ms <= 0.05 * timed_ms, note
    free = [
        ms for (host, _), ms in zip(aware.stages, aware.median_stage_ms(), strict=True) if host != "quota"
    ]
    assert max(free) <= 1.15 * statistics.mean(free), note
