"""Sampling the next token from logits."""

from __future__ import annotations

import numpy as np
import pytest

from workers.models.generate import sample

LOGITS = np.array([1.0, 3.0, 2.5, -1.0, 0.0], dtype=np.float32)


def test_temperature_zero_is_greedy():
    rng = np.random.default_rng(0)
    assert sample(LOGITS, 0.0, 0, rng) == 1
    assert sample(LOGITS[None, :], 0.0, 3, rng) == 1


def test_top_k_one_is_greedy_at_any_temperature():
    rng = np.random.default_rng(0)
    assert {sample(LOGITS, 2.0, 1, rng) for _ in range(20)} == {1}


def test_sampling_stays_within_the_top_k():
    rng = np.random.default_rng(0)
    assert {sample(LOGITS, 5.0, 2, rng) for _ in range(200)} == {1, 2}


def test_the_same_seed_draws_the_same_tokens():
    draws = [[sample(LOGITS, 1.0, 0, np.random.default_rng(7)) for _ in range(10)] for _ in range(2)]
    assert draws[0] == draws[1]


def test_draws_follow_the_softmax():
    rng = np.random.default_rng(1)
    counts = np.bincount([sample(LOGITS, 1.0, 0, rng) for _ in range(4000)], minlength=5)
    p = np.exp(LOGITS - LOGITS.max())
    np.testing.assert_allclose(counts / counts.sum(), p / p.sum(), atol=0.03)


@pytest.mark.parametrize(
    ("logits", "temperature", "message"),
    [
        (LOGITS, -1.0, r"temperature must be >= 0, got -1.0"),
        (LOGITS, float("nan"), r"temperature must be >= 0, got nan"),
        (np.zeros((2, 5)), 1.0, r"logits of shape \(vocab,\) or \(1, vocab\), got \(2, 5\)"),
        (np.zeros(0), 1.0, r"logits of shape \(vocab,\) or \(1, vocab\), got \(0,\)"),
    ],
)
def test_bad_arguments_are_errors_naming_what_is_wrong(logits, temperature, message):
    with pytest.raises(ValueError, match=message):
        sample(logits, temperature, 0, np.random.default_rng(0))
