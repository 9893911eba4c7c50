"""The compiled pieces of a block that are not products, against workers.models.ops's numpy."""

from __future__ import annotations

import numpy as np
import pytest

from workers.models import decode_ops
from workers.models.ops import gelu_tanh, silu


def test_the_compiled_gelu_is_float64s_to_a_float32_step_of_its_input_over_every_range():
    # GELU's tanh form in float32 loses up to a step of its input where 1 + tanh cancels (numpy's
    # float32 gelu_tanh: 0.94 eps·max(1, |a|) measured); ours, with the tanh fit (decode_ops.TANH_P,
    # within 3.4e-7) and the vector reciprocal (fastmath), 1.33 eps: bounded by 2.
    a = np.concatenate([np.linspace(-20, 20, 400_001), np.geomspace(1e-12, 1, 10_001)]).astype(np.float32)
    a = np.concatenate([a, -a[-10_001:], np.float32([0, 7.9, 8, 1e4, -1e4])])
    got = decode_ops.gated(a[None, :], np.ones((1, a.size), np.float32), a.size, 1)[0]
    a64 = a.astype(np.float64)
    want = 0.5 * a64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (a64 + 0.044715 * a64**3)))
    eps = np.finfo(np.float32).eps
    assert np.all(np.abs(got - want) <= 2 * eps * np.maximum(1, np.abs(a64)))


def test_the_gate_is_gelu_or_silu_of_the_first_n_columns_times_up():
    rng = np.random.default_rng(0)
    gate = (4 * rng.standard_normal((5, 40))).astype(np.float32)
    up = rng.standard_normal((5, 40)).astype(np.float32)
    eps = np.finfo(np.float32).eps
    for gelu, act in ((1, gelu_tanh), (0, silu)):
        got = decode_ops.gated(gate, up, 33, gelu)
        assert got.shape == (5, 33)
        # the same formulas in float32, each within a couple of steps of the gate (as above), times up
        bound = 3 * eps * np.maximum(1, np.abs(gate[:, :33])) * np.abs(up[:, :33])
        assert np.all(np.abs(got - act(gate[:, :33]) * up[:, :33]) <= bound)


@pytest.mark.parametrize(("start", "window"), [(0, 0), (5, 0), (3, 64)])
def test_a_prompt_s_attention_split_between_threads_is_bitwise_one_thread_s(start, window):
    rng = np.random.default_rng(start)
    T, H, KV, hd = 37, 4, 2, 16
    q, k, v = (rng.standard_normal((T, n, hd), dtype=np.float32) for n in (H, KV, KV))
    capacity = window or start + T
    earlier = rng.standard_normal((KV, capacity, hd), dtype=np.float32)  # positions 0..start held
    outs = []
    for attend in (decode_ops.attend, lambda *a: decode_ops.attend_parallel(*a, 3)):
        keys, values, out = earlier.copy(), -earlier, np.empty((T, H * hd), np.float32)
        attend(q, k, v, keys, values, start, out, np.float32(0.25), window)
        outs.append((out, keys, values))
    for got, want in zip(outs[1], outs[0], strict=True):
        np.testing.assert_array_equal(got, want)
    assert decode_ops.stores_ahead(start, T, window)


def test_a_window_s_ring_that_wraps_within_the_rows_is_not_stored_ahead():
    # row t's key would take the place of a position an earlier row of the prompt still sees
    assert not decode_ops.stores_ahead(10, 60, 64)
    assert decode_ops.stores_ahead(4, 60, 64) and decode_ops.stores_ahead(100, 60, 0)
