"""The token table: its rows read from the file where a stage only embeds, held once where it is the head."""

from __future__ import annotations

import gc

import gguf
import numpy as np
import pytest

from tests.support.tiny_gguf import TINY_K_ARCHS, TinyLlama, write_tiny_arch, write_tiny_llama
from workers import memory, models
from workers.models import decode, dense, halves, kernels, unpack
from workers.models.footprint import footprint
from workers.models.gguf_file import open_gguf
from workers.models.kernels import PackedMatrix
from workers.models.weights import FileTable, Loader, TokenTable
from workers.protocol.report import LayerRange

T = gguf.GGMLQuantizationType
# A vocabulary big enough that the table (4.5 MB of Q8_0) stands well above the few hundred KB the
# stage's one layer and the noise of this process's allocator move its resident set by.
BIG_VOCAB = TinyLlama(n_layers=3, vocab=65536)  # hidden 64: two Q8_0 blocks a row
TABLE_TYPES = {"token_embd": T.Q8_0, "output.weight": T.Q8_0}
# Row lengths of 256, so that every type below has whole blocks.
WIDE = TinyLlama(n_layers=1, hidden=256, n_heads=4, n_kv_heads=2, ffn=256, vocab=70)
IDS = np.array([69, 0, 33, 33, 5, 64], dtype=np.intp)  # repeated, unsorted, in the last group of 32


def resident() -> int:
    """This process's resident set (VmRSS) in bytes, once the allocator has given back what it can."""
    gc.collect()
    memory.give_back()
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.fixture(scope="module")
def big_vocab(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("big") / "big_vocab.gguf"
    write_tiny_llama(path, BIG_VOCAB, types=TABLE_TYPES)
    return str(path)


def test_a_stage_that_only_embeds_leaves_the_table_in_the_file_and_its_resident_set_grows_less(big_vocab):
    table_bytes = open_gguf(big_vocab).entry("token_embd.weight").n_bytes
    decode.warm_up()  # the compiled kernels, loaded once per process, are not the stage's
    ids = np.arange(0, BIG_VOCAB.vocab, 2053, dtype=np.int32)  # 32 rows spread over the table
    # Nor is whatever a first build and a first forward of these rows set up in the process (the
    # kernels' thread pool, the allocator's arenas): seen as 4 MB grown once, under a loaded machine.
    first = models.build(big_vocab, LayerRange(0, 1), "packed")
    first.forward(ids, session="s", start_pos=0, last_only=False)
    first.reset("s")
    del first
    before = resident()
    stage = models.build(big_vocab, LayerRange(0, 1), "packed")
    stage.forward(ids, session="s", start_pos=0, last_only=False)
    grown = resident() - before
    assert isinstance(stage.token_embd, FileTable)
    # Holding the table (read and regrouped whole) grows it by at least table_bytes; a quarter leaves
    # room for the layer (~0.2 MB), the rows and the allocator's noise.
    assert grown < table_bytes / 4, f"grew {grown} bytes for a {table_bytes}-byte table"


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_1, T.Q5_0, T.Q4_K, T.Q6_K, T.F16, T.F32])
@pytest.mark.parametrize("precision", ["packed", "f32"])
def test_rows_read_from_the_file_are_bitwise_the_rows_of_the_table_held(tmp_path, qtype, precision):
    path = tmp_path / f"{qtype.name}.gguf"
    write_tiny_llama(path, WIDE, types={"token_embd": qtype} if qtype != T.F32 else {})  # F32 by default
    file = open_gguf(path)
    held = Loader(file, precision).table("token_embd.weight", WIDE.vocab, WIDE.hidden)
    in_file = Loader(file, precision).file_table("token_embd.weight", WIDE.vocab, WIDE.hidden)
    got = in_file.embed(IDS)
    assert got.dtype == np.float32 and got.shape == (len(IDS), WIDE.hidden)
    np.testing.assert_array_equal(got, held.embed(IDS))


def test_a_table_left_in_the_file_counts_as_the_held_one_in_the_stage_parameters_and_precision(tmp_path):
    path = tmp_path / "q8.gguf"
    write_tiny_llama(path, WIDE, types={"token_embd": T.Q8_0})
    loads = [Loader(open_gguf(path), "packed") for _ in range(2)]
    loads[0].table("token_embd.weight", WIDE.vocab, WIDE.hidden)
    loads[1].file_table("token_embd.weight", WIDE.vocab, WIDE.hidden)
    assert [(load.n_params, load.n_packed, load.precision_name()) for load in loads] == [
        (WIDE.vocab * WIDE.hidden, WIDE.vocab * WIDE.hidden, "q8_0")
    ] * 2


def test_a_stage_that_embeds_and_is_the_tied_head_holds_one_table_for_both(tmp_path):
    t = TINY_K_ARCHS["gemma3_k"]  # its tied table in Q6_K, as llama.cpp's Q4_K_M mix has it
    path = str(tmp_path / "tied.gguf")
    write_tiny_arch(tmp_path / "tied.gguf", t, "q4_k_m")
    whole = models.build(path, LayerRange(0, t.n_layers), "packed")
    assert isinstance(whole.token_embd, TokenTable) and isinstance(whole.head, PackedMatrix)
    assert whole.head is whole.token_embd.stored
    first = models.build(path, LayerRange(0, 1), "packed")
    last = models.build(path, LayerRange(1, t.n_layers), "packed")
    assert isinstance(first.token_embd, FileTable) and last.token_embd is None
    ids = np.array([3, 1, 4, 1, 5], dtype=np.int32)
    np.testing.assert_array_equal(first.token_embd.embed(ids), whole.token_embd.embed(ids))


def test_the_footprint_counts_a_first_stage_table_as_left_in_the_file_and_a_tied_head_as_held(tmp_path):
    t = TINY_K_ARCHS["gemma3_k"]
    path = tmp_path / "tied.gguf"
    write_tiny_arch(path, t, "q4_k_m")
    table = open_gguf(path).entry("token_embd.weight").n_bytes
    held = footprint(str(path), "packed")
    first, rest, whole = LayerRange(0, 1), LayerRange(1, t.n_layers), LayerRange(0, t.n_layers)
    assert held.in_file_bytes(first) == table and held.in_file_bytes(rest) == 0
    assert held.in_file_bytes(whole) == 0  # it holds the table as its head and embeds from there
    assert held.stage_bytes(first) == held.layers[0]
    assert held.stage_bytes(rest) == sum(held.layers[1:]) + held.embedding + held.head


def recorded(function, name: str, calls: list[str]):
    """`function`, appending `name` to `calls` each time it is called."""

    def record(*args):
        calls.append(name)
        return function(*args)

    return record


def test_a_stage_of_q8_0_blocks_alone_warms_its_type_and_no_dequantizer_or_kernel_of_another(
    tmp_path, monkeypatch
):
    path = tmp_path / "q8_0.gguf"
    write_tiny_llama(path, types={"weight": T.Q8_0})  # every matrix; the norms stay float32
    warmed: list[str] = []
    for module, name in [(kernels, "dequantize_groups"), (unpack, "dequantize_groups"),
                         (dense, "warm_up"), (halves, "warm_up")]:  # fmt: skip
        where = f"{module.__name__}.{name}"
        monkeypatch.setattr(module, name, recorded(getattr(module, name), where, warmed))
    kernels.warm_up.cache_clear()  # what other tests of this process warmed, warmed again if asked
    decode.warm_up.cache_clear()
    stage = models.build(str(path), LayerRange(0, 3), "packed")
    stage.forward(np.array([1, 2, 3], dtype=np.int32), session="s", start_pos=0, last_only=True)
    assert stage.precision == "q8_0" and stage.compiled
    # Q8_0's own dequantizer, for prompts past the kernels' rows; not the Q5 and K types' unpacking.
    assert set(warmed) == {"workers.models.kernels.dequantize_groups"}, warmed
