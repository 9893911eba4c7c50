"""ClusterRun and StageTiming keep the seed's semantics and its monitor table."""

from __future__ import annotations

import math

import msgspec
import pytest

from coordinator.stats import ClusterRun, ReduceKind, StageTiming
from workers.protocol.report import HeadRows, LayerRange

# The monitor table of the three-stage example, line for line as the original prints it.
EXPECTED_TABLE = (
    "node                  layers    device       build     forward    resident\n"
    "──────────────────────────────────────────────────────────────────────────\n"
    "127.0.0.1:40001       0..10     cpu           1.2s        1.7s       0.1G\n"
    "worker-b.example:7000 10..20    cpu           1.0s        2.1s       2.3G\n"
    "10.0.0.7:7001         20..30    cuda         15.0s        1.4s       0.0G\n"
    "──────────────────────────────────────────────────────────────────────────\n"
    "reduce: Σ resident 2.5 GB, max resident 2.3 GB | total forward 5.2s, "
    "critical path 2.1s across 3 stages\n"
)
BYTES = [123456789, 2345678901, 999]


def stage(
    addr: str, start: int, end: int, device: str, build_ms: int, forward_ms: float, resident: int
) -> StageTiming:
    return StageTiming(
        addr=addr,
        layers=LayerRange(start=start, end=end),
        device=device,
        build_ms=build_ms,
        forward_ms=forward_ms,
        resident_bytes=resident,
        compute_ms=forward_ms / 2,
    )


def three_stages() -> list[StageTiming]:
    return [
        stage("127.0.0.1:40001", 0, 10, "cpu", 1234, 1700, BYTES[0]),
        stage("worker-b.example:7000", 10, 20, "cpu", 987, 2100, BYTES[1]),
        stage("10.0.0.7:7001", 20, 30, "cuda", 15049, 1430, BYTES[2]),
    ]


def example_run() -> ClusterRun:
    return ClusterRun(timings=three_stages(), total_forward_ms=5230, output=[])


def test_the_table_of_the_three_stage_example_is_exactly_the_one_the_original_prints():
    table = example_run().table()
    assert table == EXPECTED_TABLE
    lines = table.splitlines(keepends=True)
    assert all(line.endswith("\n") for line in lines)
    assert len(lines[0]) - 1 == 74 and len(lines[1]) - 1 == 74
    assert {len(line) - 1 for line in lines[2:5]} == {73}


def test_a_run_built_from_its_required_fields_alone_serializes_to_the_served_fields_and_defaults():
    timing = StageTiming(
        addr="127.0.0.1:40001",
        layers=LayerRange(start=0, end=10),
        device="cpu",
        build_ms=1234,
        forward_ms=1700.0,
        resident_bytes=123456789,
        compute_ms=1500.0,
    )
    run = ClusterRun(timings=[timing], total_forward_ms=1700.0, output=[])
    assert msgspec.to_builtins(run) == {
        "timings": [
            {
                "addr": "127.0.0.1:40001",
                "layers": {"start": 0, "end": 10},
                "device": "cpu",
                "build_ms": 1234,
                "forward_ms": 1700.0,
                "resident_bytes": 123456789,
                "compute_ms": 1500.0,
                "stage": 0,
                "precision": "",
            }
        ],
        "total_forward_ms": 1700.0,
        "output": [],
        "id": 0,
        "status": "ok",
        "seq": 0,
        "error": None,
        "model": "",
        "created_at": 0.0,
        "finished_at": None,
        "prompt": None,
        "text": None,
        "tokens": [],
        "decode": None,
        "finish_reason": None,
        "output_shape": [],
        "output_digest": None,
        "output_omitted": False,
        "steps": [],
        "steps_omitted": 0,
        "accepted": None,
        "resumed": [],
        "recoveries": [],
    }


def test_an_empty_run_reduces_to_positive_zero_for_every_kind():
    run = ClusterRun(timings=[], total_forward_ms=0, output=[])
    for kind in ReduceKind:
        value = run.reduce_resident_gb(kind)
        assert value == 0.0, kind
        assert math.copysign(1.0, value) == 1.0, f"{kind} gave -0.0"
    assert run.critical_path_ms() == 0


def test_an_empty_run_still_prints_the_header_the_rules_and_a_reduce_line_for_zero_stages():
    lines = ClusterRun(timings=[], total_forward_ms=0, output=[]).table().splitlines()
    assert lines[0] == EXPECTED_TABLE.splitlines()[0]
    rules = [i for i, line in enumerate(lines) if line == "─" * 74]
    assert len(rules) == 2 and rules[0] == 1
    assert lines[-1].startswith("reduce: Σ resident 0.0 GB, max resident 0.0 GB")
    assert lines[-1].endswith("critical path 0.0s across 0 stages")


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        (ReduceKind.SUM, sum(BYTES) / 1e9),
        (ReduceKind.MEAN, sum(BYTES) / 1e9 / 3),
        (ReduceKind.MAX, 2345678901 / 1e9),
        (ReduceKind.MIN, 999 / 1e9),
    ],
)
def test_each_reduce_kind_over_the_three_stages_gives_the_gigabytes_of_the_byte_counts(kind, expected):
    assert example_run().reduce_resident_gb(kind) == pytest.approx(expected, rel=1e-15, abs=0)


def test_reduce_accepts_each_kind_by_its_lowercase_name_and_rejects_anything_else():
    run = example_run()
    by_name = {"sum": sum(BYTES), "mean": sum(BYTES) / 3, "max": max(BYTES), "min": min(BYTES)}
    for name, total in by_name.items():
        assert run.reduce_resident_gb(name) == pytest.approx(total / 1e9, rel=1e-15, abs=0)
    for bad in ("SUM", "avg", "", "median"):
        with pytest.raises(ValueError):
            ReduceKind(bad)
        with pytest.raises(ValueError):
            run.reduce_resident_gb(bad)


def test_critical_path_is_the_slowest_stage_forward():
    assert example_run().critical_path_ms() == 2100


def test_tokens_per_s_is_zero_when_no_time_passed_and_seq_over_seconds_otherwise():
    assert ClusterRun(timings=[], total_forward_ms=0, output=[]).tokens_per_s(16) == 0.0
    assert ClusterRun(timings=[], total_forward_ms=250.0, output=[]).tokens_per_s(16) == 64.0
    assert example_run().tokens_per_s(523) == pytest.approx(100.0)


def test_a_long_address_widens_the_node_column_and_both_rules_by_the_same_amount():
    long_addr = "a-very-long-hostname.internal.example:40001"
    timings = three_stages()
    timings[1] = stage(long_addr, 10, 20, "cpu", 987, 2100, BYTES[1])
    lines = ClusterRun(timings=timings, total_forward_ms=5230, output=[]).table().splitlines()
    grow = len(long_addr) + 1 - 22
    assert grow > 0
    header, rule, row0, row1, row2, rule2 = lines[:6]
    assert rule == rule2 == "─" * (74 + grow)
    assert len(header) == 74 + grow
    assert {len(row0), len(row1), len(row2)} == {73 + grow}
    assert row1.startswith(long_addr + " 10..20")
    # Every column after the node one starts at the same offset in every line.
    layers_at = header.index("layers")
    assert layers_at == len(long_addr) + 1
    for row, layers in ((row0, "0..10"), (row1, "10..20"), (row2, "20..30")):
        assert row[layers_at:].startswith(layers)
        assert row[layers_at + 10 :].startswith("cpu" if layers != "20..30" else "cuda")
    assert [line.rstrip()[-1] for line in (row0, row1, row2)] == ["G", "G", "G"]
    expected_rows = EXPECTED_TABLE.splitlines()[2:5]
    assert row0[layers_at:] == expected_rows[0][22:]
    assert row2[layers_at:] == expected_rows[2][22:]


@pytest.mark.parametrize(("addr_len", "rule"), [(21, 74), (22, 75)])
def test_the_node_column_widens_only_for_addresses_longer_than_21_characters(addr_len, rule):
    addr = "h" * (addr_len - 5) + ":7000"
    timings = three_stages()
    timings[1] = stage(addr, 10, 20, "cpu", 987, 2100, BYTES[1])
    table = ClusterRun(timings=timings, total_forward_ms=5230, output=[]).table()
    header, line, _, row = table.splitlines()[:4]
    assert line == "─" * rule and len(header) == rule
    assert row.startswith(addr + " " * (rule - 74 + 22 - addr_len) + "10..20")


def test_a_generation_run_prints_its_decode_table_under_the_prefill_one():
    decode = ClusterRun(timings=three_stages(), total_forward_ms=2000.0, output=[], seq=32)
    run = ClusterRun(timings=three_stages(), total_forward_ms=5230, output=[], decode=decode)
    table = run.table()
    assert table.startswith(EXPECTED_TABLE)
    rest = table[len(EXPECTED_TABLE) :]
    assert rest == "\ndecode: 32 tokens, 16.0 tokens/s\n" + decode.table()


def test_a_cluster_run_with_a_decode_survives_a_json_round_trip():
    decode = ClusterRun(timings=three_stages(), total_forward_ms=2000.5, output=[], seq=32, tokens=[1, 2, 3])
    run = ClusterRun(
        timings=three_stages(),
        total_forward_ms=5230.25,
        output=[0.5, -1.25, 3.0],
        id=7,
        status="ok",
        seq=16,
        model="synthetic:layers=30",
        created_at=1700000000.5,
        finished_at=1700000005.75,
        prompt="Hello",
        text=" world",
        tokens=[9, 8],
        decode=decode,
    )
    data = msgspec.json.encode(run)
    back = msgspec.json.decode(data, type=ClusterRun)
    assert back == run
    assert back.decode == decode
    assert back.table() == run.table()


def test_a_stage_of_a_cut_head_widens_the_layers_column_and_both_rules_by_the_same_amount():
    timings = three_stages()
    cut = LayerRange(20, 30, HeadRows(0, 128672))
    timings[2] = StageTiming(**{**msgspec.structs.asdict(timings[2]), "layers": cut})
    lines = ClusterRun(timings=timings, total_forward_ms=5230, output=[]).table().splitlines()
    grow = len(str(cut)) + 1 - 10
    header, rule, row0, row1, row2, rule2 = lines[:6]
    assert rule == rule2 == "─" * (74 + grow) and len(header) == 74 + grow
    assert row2.startswith("10.0.0.7:7001" + " " * 9 + "20..30 + head rows 0..128672 cuda")
    device_at = header.index("device")
    assert all(row[device_at:].startswith(("cpu", "cuda")) for row in (row0, row1, row2))
