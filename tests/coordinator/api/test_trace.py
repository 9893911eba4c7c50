"""GET /runs/{id}/trace: a run as Chrome trace-event JSON, drawn from the same numbers as its record."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.runs import recorder
from tests.coordinator.conftest import Api
from tests.support.tiny_chat import PROMPT, write_tiny_chat

MS = 1e-3  # the trace counts in µs


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "tiny-chat.gguf"
    write_tiny_chat(path, context_length=64)
    return path


async def traced(api: Api, body: dict) -> tuple[dict, dict]:
    """Run `body` to its end; return its stored record and its trace."""
    status, posted, _ = await api.post("/runs", json=body)
    assert status == 202, posted
    run = await api.finished(posted["id"])
    status, trace, r = await api.get(f"/runs/{run['id']}/trace")
    assert status == 200 and r.content_type == "application/json", trace
    return run, trace


def slices(trace: dict, tid: int, name: str | None = None) -> list[dict]:
    events = trace["traceEvents"]
    return [e for e in events if e["ph"] == "X" and e["tid"] == tid and name in (None, e["name"])]


def end(e: dict) -> float:
    return e["ts"] + e["dur"]


def assert_nested(trace: dict) -> None:
    """On every track any two slices are disjoint or one holds the other, as a trace viewer requires."""
    for tid in {e["tid"] for e in trace["traceEvents"]}:
        track = sorted(slices(trace, tid), key=lambda e: (e["ts"], -e["dur"]))
        for i, a in enumerate(track):
            for b in track[i + 1 :]:
                # Within a nanosecond, the trace's own resolution, summed in floats here.
                assert end(b) <= end(a) + 1e-6 or b["ts"] >= end(a) - 1e-6, (a, b)


def stage_forwards(trace: dict, stage: int) -> list[dict]:
    """A stage's forward slices (the parents of its network and compute slices), in time order."""
    kept = [e for e in slices(trace, stage + 1) if e["cat"] == "forward"]
    return sorted(kept, key=lambda e: e["ts"])


def assert_split(trace: dict, forward: dict) -> None:
    """A forward slice is network, compute, network back to back, filling it exactly."""
    inside = [e for e in slices(trace, forward["tid"]) if e["cat"] != "forward"
              and forward["ts"] <= e["ts"] and end(e) <= end(forward) + 1e-6]  # fmt: skip
    inside.sort(key=lambda e: e["ts"])
    assert [e["name"] for e in inside] == ["network", "compute", "network"]
    assert inside[0]["ts"] == forward["ts"] and end(inside[2]) == pytest.approx(end(forward), abs=1e-6)
    assert end(inside[0]) == pytest.approx(inside[1]["ts"], abs=1e-6)
    assert end(inside[1]) == pytest.approx(inside[2]["ts"], abs=1e-6)
    assert inside[1]["dur"] * MS == pytest.approx(forward["args"]["compute_ms"], abs=1e-5)


async def test_each_stage_draws_a_forward_as_network_compute_network_adding_up_to_its_forward_ms(api_factory):
    api = await api_factory("fake:layers=6,delay_ms=15", 3)
    run, trace = await traced(api, {"seq": 4})
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names[0] == "coordinator"
    for t in run["timings"]:
        layers = f"{t['layers']['start']}..{t['layers']['end']}"
        assert names[t["stage"] + 1] == f"stage {t['stage']} {t['addr']} layers {layers}"
    previous_end = 0.0
    for t in run["timings"]:
        (forward,) = stage_forwards(trace, t["stage"])
        assert forward["name"] == "forward"
        assert forward["dur"] * MS == pytest.approx(t["forward_ms"], abs=1e-5)
        assert forward["args"]["compute_ms"] == t["compute_ms"] >= 15
        assert_split(trace, forward)
        assert forward["ts"] >= previous_end  # a stage starts once the one before it has replied
        previous_end = end(forward)
    (step,) = slices(trace, 0, "forward")
    (whole,) = slices(trace, 0, f"run {run['id']}")
    # The coordinator's step spans its stages (to within the µs of a hook's call).
    assert whole["ts"] == 0 and step["ts"] <= stage_forwards(trace, 0)[0]["ts"] + 1
    assert end(step) >= previous_end - 1 and end(whole) >= end(step) - 1e-6  # float sums of µs
    assert_nested(trace)
    assert trace["otherData"]["steps_omitted"] == 0 and trace["otherData"]["status"] == "ok"


async def test_a_generations_stages_add_up_to_its_stored_prefill_and_decode_times(api_factory, tiny_chat):
    api = await api_factory(str(tiny_chat), 2)
    run, trace = await traced(api, {"prompt": PROMPT, "max_new_tokens": 8})
    assert len(run["tokens"]) == 8
    for prefill, decode in zip(run["timings"], run["decode"]["timings"], strict=True):
        forwards = stage_forwards(trace, prefill["stage"])
        assert [f["name"] for f in forwards] == ["prefill"] + [f"decode {n}" for n in range(1, 8)]
        assert forwards[0]["dur"] * MS == pytest.approx(prefill["forward_ms"], abs=1e-5)
        decoded = sum(f["dur"] for f in forwards[1:]) * MS
        assert decoded == pytest.approx(decode["forward_ms"], abs=1e-4)
        for forward in forwards:
            assert_split(trace, forward)
    steps = [e["name"] for e in sorted(slices(trace, 0), key=lambda e: e["ts"]) if e["cat"] == "step"]
    assert steps == ["prefill"] + [f"decode {n}" for n in range(1, 8)]
    assert_nested(trace)
    assert trace["otherData"]["decode_steps_kept"] == 7 and trace["otherData"]["steps_omitted"] == 0


async def test_a_long_generation_keeps_its_first_forward_and_last_steps_and_says_how_many_are_left_out(
    api_factory, tiny_chat, monkeypatch
):
    monkeypatch.setattr(recorder, "KEPT_STEPS", 4)
    api = await api_factory(str(tiny_chat), 2)
    run, trace = await traced(api, {"prompt": PROMPT, "max_new_tokens": 12})
    assert "steps" not in run and run["steps_omitted"] == 7  # 11 decode steps, the last 4 kept
    kept = ["prefill", "decode 8", "decode 9", "decode 10", "decode 11"]
    for stage in (0, 1):
        assert [f["name"] for f in stage_forwards(trace, stage)] == kept
    other = trace["otherData"]
    assert other["steps_omitted"] == 7 and other["decode_steps_kept"] == 4
    assert other["note"].startswith("decode steps 1..7 left out")
    assert_nested(trace)


async def test_the_trace_of_an_unknown_run_is_404(api):
    status, body, _ = await api.get("/runs/41/trace")
    assert status == 404 and body["error"] == "no run 41"
