"""Hosts files: what they say read into hosts, the example in docs/ planned, bad input named."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from coordinator.plan.costmodel import LLAMA_70B, CostModelError, from_numbers, from_spec
from coordinator.plan.hosts import HostsError, load_hosts, model_shape
from coordinator.plan.placement import plan_hosts
from tests.support.tiny_gguf import TINY_ARCHS, write_tiny_arch
from workers.calibrate import Costs
from workers.models.footprint import footprint

DOCS = Path(__file__).parents[3] / "docs"
HOST = """
[[hosts]]
name = "box"
cores = 4
memory = "2GB"
speed = 0.5
latency_ms = 3
bandwidth_mbps = 100
"""


def hosts_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hosts.toml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny") / "gemma3.gguf"
    write_tiny_arch(path, TINY_ARCHS["gemma3"], "q8_0")
    return str(path)


def test_a_host_is_read_with_its_units_and_a_counted_entry_spreads_its_latency(tmp_path):
    text = HOST + '[[hosts]]\nname = "pi"\ncount = 3\ncores = 4\nmemory = "512MiB"\nspeed = 0.1\n'
    text += "latency_ms = [20, 100]\nbandwidth_mbps = 8\n"
    hosts = load_hosts(hosts_file(tmp_path, text)).hosts
    assert [h.name for h in hosts] == ["box", "pi-1", "pi-2", "pi-3"]
    box = hosts[0]
    assert (box.cores, box.memory_bytes, box.speed, box.latency_ms, box.bandwidth) == (
        4,
        2e9,
        0.5,
        3.0,
        12.5e6,
    )
    assert [h.latency_ms for h in hosts[1:]] == [20.0, 60.0, 100.0]
    assert hosts[1].memory_bytes == 512 * 2**20 and hosts[1].bandwidth == 1e6


@pytest.mark.parametrize(
    "change, message",
    [
        (("bandwidth_mbps = 100\n", ""), "host 'box': bandwidth_mbps is missing"),
        (("speed = 0.5", "speed = -1"), "host 'box': speed must be a number > 0, got -1"),
        (('memory = "2GB"', 'memory = "lots"'), "host 'box': memory must be bytes or a size such as"),
        (("cores = 4", "cores = 2.5"), "host 'box': cores must be a whole number >= 1, got 2.5"),
        (("latency_ms = 3", "latency_ms = [1, 2, 3]"), "host 'box': latency_ms must be ms or"),
        (("speed = 0.5", 'speed = 0.5\ncosts = "c.json"'), "host 'box': give speed .* or costs .*, one of"),
        (("speed = 0.5", "spede = 0.5"), r"host 'box': unknown field\(s\) spede"),
        (('name = "box"', 'name = "a b"'), r"hosts\[0\]: name must be a word"),
        (("[[hosts]]", "[[hostz]]"), r"unknown table\(s\) hostz"),
        (("cores = 4", "cores = = 4"), "not a TOML file"),
    ],
)
def test_a_bad_hosts_file_is_refused_naming_the_host_and_the_field(tmp_path, change, message):
    path = hosts_file(tmp_path, HOST.replace(*change))
    with pytest.raises(HostsError, match=message) as caught:
        load_hosts(path)
    assert str(path) in str(caught.value)


def test_two_hosts_of_one_name_are_refused(tmp_path):
    with pytest.raises(HostsError, match="given twice: box"):
        load_hosts(hosts_file(tmp_path, HOST + HOST))


def test_costs_measured_on_a_host_replace_its_speed_and_must_be_what_calibrate_prints(tmp_path):
    (tmp_path / "c.json").write_bytes(msgspec.json.encode(Costs([1.0, 2.0, 3.0], "packed", stage_ms=0.5)))
    model = "[model]\nlayers = 3\nhidden = 64\nheads = 4\nffn = 128\nvocab = 100\n"
    read = load_hosts(hosts_file(tmp_path, model + HOST.replace("speed = 0.5", 'costs = "c.json"')))
    costs = read.hosts[0].costs(model_shape(read, None), read.reference)
    # The measured step of each layer, shared between its weights and its rows as the cost model has it.
    assert [w + r for w, r in zip(costs.weights_ms, costs.row_ms, strict=True)] == pytest.approx(
        [1.0, 2.0, 3.0]
    )
    assert costs.stage_ms == 0.5
    (tmp_path / "c.json").write_text('{"layers": "many"}')
    with pytest.raises(
        HostsError, match=r"host 'box': costs: .*c\.json is not what workers\.calibrate prints"
    ):
        load_hosts(hosts_file(tmp_path, HOST.replace("speed = 0.5", 'costs = "c.json"')))


def test_costs_measured_for_another_number_of_layers_are_refused_naming_the_host(tmp_path):
    (tmp_path / "c.json").write_bytes(msgspec.json.encode(Costs([1.0, 2.0], "packed")))
    model = "[model]\nlayers = 3\nhidden = 64\nheads = 4\nffn = 128\nvocab = 100\n"
    read = load_hosts(hosts_file(tmp_path, model + HOST.replace("speed = 0.5", 'costs = "c.json"')))
    with pytest.raises(HostsError, match="host 'box': costs: 2 layers measured, the model has 3"):
        plan_hosts(read.hosts, model_shape(read, None), read.reference)


def test_the_example_hosts_file_plans_a_gguf_model_on_this_machine(tiny_gemma):
    read = load_hosts(DOCS / "hosts.toml")
    assert read.model is None and len(read.hosts) == 4
    shape = model_shape(read, tiny_gemma)
    plan = plan_hosts(read.hosts, shape, read.reference)
    assert plan.stages[0].layers.start == 0 and plan.stages[-1].layers.end == shape.n_layers
    assert len(plan.stages) + len(plan.spares) == 4 and all(why for _, why in plan.spares)


def test_the_70b_example_describes_a_model_this_machine_does_not_hold_and_64_hosts():
    read = load_hosts(DOCS / "hosts-70b.toml")
    assert read.model is not None and read.model.n_layers == 80 and len(read.hosts) == 64
    assert read.hosts[0].latency_ms == 20.0 and read.hosts[31].latency_ms == 100.0


def test_a_shape_from_a_gguf_file_has_its_tensors_bytes_and_its_head_on_the_last_layer(tiny_gemma):
    shape = from_spec(tiny_gemma)
    t = TINY_ARCHS["gemma3"]
    assert (shape.n_layers, shape.hidden, shape.n_heads, shape.hd, shape.ffn) == (
        t.n_layers, t.hidden, t.n_heads, t.head_dim, t.ffn)  # fmt: skip
    foot = footprint(tiny_gemma, "packed")
    assert shape.weight_bytes()[:-1] == foot.layers[:-1]
    assert shape.weight_bytes()[-1] == foot.layers[-1] + foot.head + foot.embedding  # tied: the last holds it


def test_a_70b_llama_weighs_what_its_q4_k_m_file_does():
    # Llama 3 70B: 70.6e9 weights; its Q4_K_M file is 42.5 GB. Within 2%: norms and the file's header
    # are left out, and the mix's bits per weight are an average.
    assert sum(LLAMA_70B.weight_bytes()) == pytest.approx(42.5e9, rel=0.02)
    weights = LLAMA_70B.layer_weights() * 80 + 2 * LLAMA_70B.vocab * LLAMA_70B.hidden
    assert weights == pytest.approx(70.6e9, rel=0.01)
    assert LLAMA_70B.out_bytes(False, 1) == 8192 * 4 and LLAMA_70B.out_bytes(True, 1) == 128256 * 4


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"layers": 2, "hidden": 8, "heads": 2, "ffn": 8}, "missing vocab"),
        ({"layers": 2, "hidden": 8, "heads": 3, "kv_heads": 2, "ffn": 8, "vocab": 9}, "not a multiple"),
        ({"layers": 0, "hidden": 8, "heads": 2, "ffn": 8, "vocab": 9}, "layers must be a whole number"),
        ({"layers": 2, "hidden": 8, "heads": 2, "ffn": 8, "vocab": 9, "quant": "Q3"}, "unknown quant 'Q3'"),
        (
            {"layers": 2, "hidden": 8, "heads": 2, "ffn": 8, "vocab": 9, "width": 3},
            r"unknown field\(s\) width",
        ),
    ],
)
def test_a_model_given_as_numbers_is_checked_naming_the_field(fields, message):
    with pytest.raises(CostModelError, match=message):
        from_numbers("m", fields)
