"""A big matrix is regrouped a chunk of rows at a time, into the layout it has regrouped at once."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from tests.support.kquants import random_blocks
from workers.models import regroup
from workers.models.quants import BY_ID, ROWS

T = gguf.GGMLQuantizationType


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q5_0, T.Q4_K])
def test_a_matrix_regrouped_in_chunks_is_bitwise_the_one_regrouped_at_once(monkeypatch, qtype):
    q = BY_ID[int(qtype)]
    nb = 2
    out = 5 * ROWS + 7  # a last chunk of fewer groups, its last group padded
    raw = random_blocks(qtype, out, nb, seed=1).reshape(out, nb * q.block_bytes)
    whole = regroup.regroup(raw, q, out, nb)
    monkeypatch.setattr(regroup, "CHUNK_BYTES", 2 * ROWS * raw.shape[1])  # two groups a chunk
    chunked = regroup.regroup(raw, q, out, nb)
    for a, b in zip(whole, chunked, strict=True):
        assert a.dtype == b.dtype and a.flags.c_contiguous and b.flags.c_contiguous
        np.testing.assert_array_equal(a, b)
