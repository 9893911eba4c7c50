"""`rlx-cluster plan --hosts`: the placement, its times and a simulation printed; bad input exits 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.cli.main import amain
from coordinator.cli.options import parse_args

DOCS = Path(__file__).parents[3] / "docs"


async def plan(capsys, *argv: str) -> tuple[int, str, str]:
    status = await amain(parse_args(["plan", *argv]))
    out, err = capsys.readouterr()
    return status, out, err


async def test_plan_over_the_70b_example_prints_the_placement_the_times_and_a_simulation(capsys):
    status, out, _ = await plan(capsys, "--hosts", str(DOCS / "hosts-70b.toml"), "--simulate", "4",
                                "--new-tokens", "4", "--prompt-tokens", "16")  # fmt: skip
    assert status == 0
    lines = out.splitlines()
    assert lines[0].startswith("llama-70b over ") and lines[0].endswith(" of 64 hosts (heuristic)")
    stages = [line for line in lines if line.startswith("stage ")]
    assert stages[0].startswith("stage 0: ") and " layers 0.." in stages[0] and "..80 (" in stages[-1]
    assert any(line.startswith("spare: ") for line in lines)
    for start in ("decode: ", "prefill: ", "slowest stage: ", "simulated 4 generations of 16+4 tokens: "):
        assert any(line.startswith(start) for line in lines), start
    assert "time to first token p50" in out and "inter-token latency p50" in out


async def test_plan_over_hosts_takes_the_throughput_objective(capsys):
    status, out, _ = await plan(capsys, "--hosts", str(DOCS / "hosts-70b.toml"), "--objective", "throughput")
    assert status == 0 and "objective throughput" in out


async def test_a_bad_hosts_file_exits_2_naming_the_host_and_field(capsys, tmp_path):
    bad = tmp_path / "hosts.toml"
    bad.write_text('[[hosts]]\nname = "laptop"\ncores = 4\nmemory = "8GB"\nspeed = 0\nbandwidth_mbps = 10\n')
    status, out, err = await plan(capsys, "--hosts", str(bad), "--model", "fake:layers=2")
    assert status == 2 and out == ""
    assert f"rlx-cluster: {bad}: host 'laptop': speed must be a number > 0, got 0" in err


async def test_a_model_that_is_no_file_needs_the_hosts_file_to_give_its_shape(capsys, tmp_path):
    status, _, err = await plan(capsys, "--hosts", str(DOCS / "hosts.toml"), "--model", "fake:layers=2")
    assert status == 2 and "is not a GGUF file: give its shape in the hosts file's [model]" in err


def test_plan_without_a_model_or_hosts_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(["plan"])
    assert "the following arguments are required: --model" in capsys.readouterr().err
