"""NodeReport keeps the JSON contract of DESIGN.md; LayerRange parses what people type."""

from __future__ import annotations

import json
import mmap
import re
import resource
import sys

import msgspec
import pytest

from workers.protocol import report
from workers.protocol.report import (
    HeadRows,
    LayerRange,
    NodeReport,
    check_stages,
    decode_report,
    encode_report,
    resident_bytes,
)

# The example from DESIGN.md, verbatim.
DESIGN_EXAMPLE = """{"addr": "127.0.0.1:40123", "layers": {"start": 0, "end": 10}, "device": "cpu",
 "precision": "f32", "build_ms": 1234, "resident_bytes": 123456789,
 "n_params": 45000000, "n_packed": 0}"""
CONTRACT_FIELDS = {
    "addr",
    "layers",
    "device",
    "precision",
    "build_ms",
    "resident_bytes",
    "n_params",
    "n_packed",
}


def example_report(**changes) -> NodeReport:
    fields = dict(
        addr="127.0.0.1:40123",
        layers=LayerRange(start=0, end=10),
        device="cpu",
        precision="f32",
        build_ms=1234,
        resident_bytes=123456789,
        n_params=45000000,
        n_packed=0,
    )
    fields.update(changes)
    return NodeReport(**fields)


def example_dict(**changes) -> dict:
    data = json.loads(DESIGN_EXAMPLE)
    data.update(changes)
    return data


def test_a_report_encodes_to_the_contract_field_names_and_shapes_on_one_line():
    line = encode_report(example_report())
    assert "\n" not in line
    data = json.loads(line)
    assert set(data) >= CONTRACT_FIELDS
    assert data["addr"] == "127.0.0.1:40123"
    assert data["layers"] == {"start": 0, "end": 10}
    assert data["device"] == "cpu"
    assert data["precision"] == "f32"
    for name, value in [
        ("build_ms", 1234),
        ("resident_bytes", 123456789),
        ("n_params", 45000000),
        ("n_packed", 0),
    ]:
        assert data[name] == value and type(data[name]) is int, name


def test_the_design_example_decodes_to_the_report_it_describes():
    assert decode_report(DESIGN_EXAMPLE) == example_report()
    assert decode_report(DESIGN_EXAMPLE.encode()) == example_report()


def test_a_report_survives_an_encode_decode_round_trip():
    report = example_report(addr="[::1]:9", precision="q4_1+q8_0", n_packed=7, pid=4242, model="synthetic")
    assert decode_report(encode_report(report)) == report


def test_fields_a_reader_does_not_know_are_ignored():
    line = json.dumps(example_dict(gpu={"name": "x", "mem": [1, 2]}, hostname="node-7", version=3))
    assert decode_report(line) == example_report()


def test_optional_fields_default_when_absent():
    data = example_dict()
    del data["n_packed"]
    report = decode_report(json.dumps(data))
    assert report.n_packed == 0 and report.pid == 0 and report.model == ""


@pytest.mark.parametrize(
    ("line", "named"),
    [
        (json.dumps({k: v for k, v in example_dict().items() if k != "addr"}), "addr"),
        (json.dumps({k: v for k, v in example_dict().items() if k != "layers"}), "layers"),
        (json.dumps(example_dict(build_ms="1234")), "build_ms"),
        (json.dumps(example_dict(build_ms=12.5)), "build_ms"),
        (json.dumps(example_dict(layers=[0, 10])), "layers"),
        (json.dumps(example_dict(layers={"start": 0})), "end"),
        (json.dumps(example_dict(layers={"start": 10, "end": 2})), "10..2"),
        (json.dumps(example_dict(layers={"start": -1, "end": 2})), "-1..2"),
        (json.dumps(example_dict(addr="127.0.0.1")), "addr"),
        (json.dumps(example_dict(addr=":40123")), "addr"),
        (json.dumps(example_dict(addr="127.0.0.1:")), "addr"),
        (json.dumps(example_dict(addr="127.0.0.1:http")), "addr"),
        (json.dumps(example_dict(addr="127.0.0.1:0")), "addr"),
        (json.dumps(example_dict(addr="127.0.0.1:65536")), "addr"),
        (json.dumps(example_dict(addr="127.0.0.1:-1")), "addr"),
        (json.dumps(example_dict(addr="127.0.0.1:²")), "addr"),
        (json.dumps(example_dict(addr="127.0.0.1:٤٠")), "addr"),
        (json.dumps(example_dict(addr="::1:40123")), "addr"),  # an IPv6 host goes in brackets
        ("listening on 127.0.0.1:40123", "NodeReport"),
        ("", "NodeReport"),
        ("[1, 2, 3]", "NodeReport"),
        (json.dumps(example_dict())[:-1] + ', "x": ' + "[" * 5000 + "]" * 5000 + "}", "NodeReport"),
        (DESIGN_EXAMPLE[:-1], "NodeReport"),
    ],
)
def test_an_invalid_report_raises_value_error_naming_the_problem(line, named):
    with pytest.raises(ValueError, match="not a NodeReport") as info:
        decode_report(line)
    assert named in str(info.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("0..10", (0, 10)), ("10..20", (10, 20)), (" 3 .. 5 ", (3, 5)), ("7..7", (7, 7)), ("0..0", (0, 0))],
)
def test_layer_range_parses_a_dot_dot_b(text, expected):
    parsed = LayerRange.parse(text)
    assert (parsed.start, parsed.end) == expected
    assert str(parsed) == f"{expected[0]}..{expected[1]}"
    assert len(parsed) == expected[1] - expected[0]


@pytest.mark.parametrize(
    "text", ["", "0", "0..", "..10", "0...10", "0-10", "a..b", "-1..3", "1.5..3", "0..10..20"]
)
def test_layer_range_parse_rejects_what_is_not_a_dot_dot_b(text):
    with pytest.raises(ValueError, match=r"expected a\.\.b"):
        LayerRange.parse(text)


def test_layer_range_parse_rejects_an_end_before_its_start():
    with pytest.raises(ValueError, match=r"5\.\.3"):
        LayerRange.parse("5..3")


def test_layer_range_cannot_be_built_backwards_or_negative():
    with pytest.raises(ValueError):
        LayerRange(start=5, end=3)
    with pytest.raises(ValueError):
        LayerRange(start=-1, end=3)


def test_resident_bytes_is_positive_and_grows_after_touching_50_mb():
    before = resident_bytes()
    assert 1_000_000 < before < 1 << 40
    # A fresh anonymous mapping, written page by page: memory the allocator
    # freed earlier in this process cannot stand in for it.
    with mmap.mmap(-1, 50 * 1024 * 1024) as block:
        block.write(b"\1" * len(block))
        after = resident_bytes()
        assert block[len(block) - 1] == 1
    assert after - before >= 40 * 1024 * 1024


@pytest.mark.parametrize(("platform", "unit"), [("darwin", 1), ("linux", 1024), ("freebsd14", 1024)])
def test_without_proc_the_peak_resident_set_is_read_in_the_platforms_unit(monkeypatch, platform, unit):
    def no_proc(*args, **kwargs):
        raise FileNotFoundError(2, "No such file or directory", args[0])

    monkeypatch.setattr(report, "open", no_proc, raising=False)
    monkeypatch.setattr(sys, "platform", platform)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    got = resident_bytes()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert before * unit <= got <= after * unit


def test_a_layer_range_with_head_rows_parses_prints_and_travels_as_written():
    cut = LayerRange.parse("16..18 + head rows 0..120000")
    assert cut == LayerRange(16, 18, HeadRows(0, 120000))
    assert str(cut) == "16..18 + head rows 0..120000" and len(cut) == 2 and len(cut.head) == 120000
    assert LayerRange.parse(str(LayerRange(18, 18, HeadRows(120000, 262144)))).head == HeadRows(
        120000, 262144
    )
    assert msgspec.json.decode(msgspec.json.encode(cut), type=LayerRange) == cut
    # A range without head rows is written as it always was: a reader of the contract sees no change.
    assert msgspec.json.encode(LayerRange(0, 10)) == b'{"start":0,"end":10}'
    assert cut.gives_logits(18, 262144) is False
    assert LayerRange(18, 18, HeadRows(120000, 262144)).gives_logits(18, 262144) is True


@pytest.mark.parametrize(("start", "end"), [(5, 5), (7, 3), (-1, 4)])
def test_empty_or_backward_head_rows_are_refused_naming_them(start, end):
    with pytest.raises(ValueError, match=rf"bad head rows {start}\.\.{end}"):
        HeadRows(start, end)


def cut(*texts: str) -> list[LayerRange]:
    return [LayerRange.parse(t) for t in texts]


@pytest.mark.parametrize(
    ("ranges", "named"),
    [
        (
            cut("0..4", "4..6 + head rows 0..32", "6..6 + head rows 40..100"),
            "stage 2's head rows 40..100 do not follow row 32",
        ),
        (
            cut("0..4", "4..6 + head rows 0..32", "6..6 + head rows 32..90"),
            "the head rows end at row 90, the head has 100",
        ),
        (cut("0..4", "4..6 + head rows 0..32", "6..6 + head rows 32..120"), "the head rows end at row 120"),
        (
            cut("0..4 + head rows 0..32", "4..6"),
            "stage 0 (layers 0..4 + head rows 0..32) holds head rows but not the last layer",
        ),
        (cut("0..6", "6..6 + head rows 0..100"), "stage 1 (layers 6..6 + head rows 0..100) holds no layers"),
        (cut("0..6", "6..6"), "stage 1 (layers 6..6) holds neither layers nor head rows"),
        (
            cut("0..3", "4..6 + head rows 0..100"),
            "stage 1 (layers 4..6 + head rows 0..100) does not follow layer 3",
        ),
    ],
)
def test_stages_whose_head_rows_are_not_contiguous_or_out_of_range_are_refused_naming_them(ranges, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        check_stages(ranges, 6, 100)


def test_stages_that_cover_the_layers_and_the_head_rows_in_order_pass():
    check_stages(
        cut("0..4", "4..6 + head rows 0..32", "6..6 + head rows 32..64", "6..6 + head rows 64..100"), 6, 100
    )
    check_stages(cut("0..4", "4..6"), 6, 100)
