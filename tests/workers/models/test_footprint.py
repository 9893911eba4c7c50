"""A model's fingerprint tells files apart cheaply; its footprint is what a built stage really holds."""

from __future__ import annotations

import itertools
import shutil
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest

from tests.support.tiny_gguf import TinyLlama, tiny_arch, write_tiny_arch, write_tiny_llama
from workers.measured import memory_available
from workers.models import ModelSpecError, build, describe
from workers.models.footprint import HEAD_BYTES, fingerprint, footprint
from workers.models.halves import HalfMatrix
from workers.models.kernels import PackedMatrix
from workers.models.weights import TokenTable
from workers.protocol.report import HeadRows, LayerRange

SPLITS = [[LayerRange(0, 3)], [LayerRange(0, 1), LayerRange(1, 3)], [LayerRange(0, 2), LayerRange(2, 3)]]


@pytest.fixture(scope="module", params=[False, True], ids=["f32-file", "mixed-types-file"])
def tiny(request, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    write_tiny_llama(path, TinyLlama(), mixed_types=request.param)
    return str(path)


def held_bytes(stage) -> int:
    """Bytes of the distinct arrays a built llama stage keeps, counted once each."""
    parts = [getattr(block, f.name) for block in stage.blocks for f in fields(block)]
    parts += [stage.token_embd, stage.output_norm, stage.head]
    arrays: dict[int, np.ndarray] = {}
    while parts:
        match parts.pop():
            case np.ndarray() as array:
                base = array if array.base is None else array.base
                arrays[id(base)] = base
            case PackedMatrix(quants=quants, scales=scales):
                parts += [quants, scales]
            case TokenTable(stored=array) | HalfMatrix(stored=array):
                parts.append(array)
    return sum(a.nbytes for a in arrays.values())


@pytest.mark.parametrize("precision", ["f32", "packed"])
@pytest.mark.parametrize("ranges", SPLITS, ids=lambda rs: "+".join(map(str, rs)))
def test_the_footprint_of_a_stage_is_the_bytes_its_built_stage_holds(tiny, precision, ranges):
    estimate = footprint(tiny, precision)
    for layers in ranges:
        assert estimate.stage_bytes(layers) == held_bytes(build(tiny, layers, precision)), f"layers {layers}"


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_stage_of_a_cut_head_counts_only_the_rows_it_holds(tmp_path, tied):
    path = tmp_path / "cut.gguf"
    if tied:
        write_tiny_arch(path, tiny_arch("qwen2"), "f32")
    else:
        write_tiny_llama(path, TinyLlama())
    n, vocab = describe(str(path)).n_layers, describe(str(path)).vocab
    estimate = footprint(str(path), "f32")
    ends = [0, 32, 96, vocab] if vocab > 96 else [0, 32, vocab]  # tiny llama's vocabulary has 40 rows
    cut = [LayerRange(0 if a == 0 else n, n, HeadRows(a, b)) for a, b in itertools.pairwise(ends)]
    for layers in cut:
        assert estimate.stage_bytes(layers) == held_bytes(build(str(path), layers, "f32")), f"layers {layers}"
    whole = estimate.stage_bytes(LayerRange(0, n))
    assert estimate.stage_bytes(cut[0]) < whole


def test_synthetic_and_fake_footprints_follow_their_shapes():
    synthetic = footprint("synthetic:layers=4,hidden=8", "f32")
    assert synthetic.stage_bytes(LayerRange(0, 4)) == 4 * (8 + 2 * 8 * 16) * 4
    assert synthetic.stage_bytes(LayerRange(1, 2)) == (8 + 2 * 8 * 16) * 4
    assert footprint("fake:layers=6,hidden=4", "f32").stage_bytes(LayerRange(0, 3)) == 3 * 4 * 4


def test_an_unknown_precision_is_an_error_naming_it():
    with pytest.raises(ValueError, match=r"precision 'q2' is not supported; accepted: packed, f32"):
        footprint("fake:layers=4", "q2")


def test_a_fingerprint_tells_apart_files_that_differ_in_name_size_or_header(tmp_path, tiny):
    original = fingerprint(tiny)
    assert original.kind == "gguf" and original.name == "tiny.gguf"
    assert original.size == Path(tiny).stat().st_size and len(original.head_sha256) == 64

    same = tmp_path / "tiny.gguf"
    shutil.copy(tiny, same)
    assert fingerprint(str(same)) == original

    renamed = tmp_path / "other.gguf"
    shutil.copy(tiny, renamed)
    assert fingerprint(str(renamed)).name == "other.gguf"

    longer = tmp_path / "longer" / "tiny.gguf"
    longer.parent.mkdir()
    longer.write_bytes(Path(tiny).read_bytes() + b"\0" * 32)
    assert fingerprint(str(longer)).size == original.size + 32

    edited = tmp_path / "edited" / "tiny.gguf"
    edited.parent.mkdir()
    data = bytearray(Path(tiny).read_bytes())
    data[40] ^= 0xFF  # inside the metadata, well within the hashed head
    edited.write_bytes(bytes(data))
    assert fingerprint(str(edited)).head_sha256 != original.head_sha256
    assert fingerprint(str(edited)).size == original.size


def test_a_fingerprint_hashes_only_the_head_of_a_big_file(tmp_path, tiny):
    big = tmp_path / "big.gguf"
    big.write_bytes(Path(tiny).read_bytes().ljust(HEAD_BYTES + 4096, b"\0"))
    before = fingerprint(str(big))
    with open(big, "r+b") as f:
        f.seek(HEAD_BYTES + 100)
        f.write(b"\xff")
    assert fingerprint(str(big)) == before


def test_a_model_made_from_its_spec_is_fingerprinted_by_the_spec():
    spec = "synthetic:layers=3,hidden=8"
    print_ = fingerprint(spec)
    assert (print_.kind, print_.name, print_.size, print_.head_sha256) == ("spec", spec, 0, "")


def test_an_unreadable_model_file_is_an_error_naming_it(tmp_path):
    missing = tmp_path / "missing.gguf"
    with pytest.raises(ModelSpecError, match=r"missing\.gguf: cannot read model file"):
        fingerprint(str(missing))


def test_the_memory_a_worker_offers_is_at_most_what_the_machine_has():
    total = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                 if line.startswith("MemTotal:"))  # fmt: skip
    assert 0 < memory_available() <= total
