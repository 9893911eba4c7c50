"""Sampling the next token from logits."""

from __future__ import annotations

import numpy as np
import pytest

from workers.models.generate import nucleus, sample

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


# Softmax of LOGITS by likelihood: token 1 0.552, 2 0.335, 0 0.075, 4 0.028, 3 0.010.


def test_top_p_keeps_the_fewest_likely_tokens_that_reach_it():
    rng = np.random.default_rng(0)
    assert {sample(LOGITS, 1.0, 0, rng, top_p=0.5) for _ in range(50)} == {1}
    assert {sample(LOGITS, 1.0, 0, rng, top_p=0.6) for _ in range(300)} == {1, 2}
    assert {sample(LOGITS, 1.0, 0, rng, top_p=0.95) for _ in range(600)} == {0, 1, 2}


def test_top_p_draws_follow_the_renormalized_nucleus():
    rng = np.random.default_rng(2)
    counts = np.bincount([sample(LOGITS, 1.0, 0, rng, top_p=0.8) for _ in range(4000)], minlength=5)
    p = np.exp(LOGITS - LOGITS.max())[[1, 2]]
    np.testing.assert_allclose(counts[[1, 2]] / counts.sum(), p / p.sum(), atol=0.03)


def test_top_p_applies_after_top_k():
    rng = np.random.default_rng(0)
    # Within the top 3 (tokens 1, 2, 0) token 1 has 0.57 of the mass: top_p 0.6 adds token 2 only.
    assert {sample(LOGITS, 1.0, 3, rng, top_p=0.6) for _ in range(300)} == {1, 2}
    assert {sample(LOGITS, 1.0, 2, rng, top_p=0.99) for _ in range(300)} == {1, 2}


def test_top_p_one_draws_as_without_it():
    with_p, without = np.random.default_rng(7), np.random.default_rng(7)
    draws = [(sample(LOGITS, 1.0, 0, with_p, top_p=1.0), sample(LOGITS, 1.0, 0, without)) for _ in range(50)]
    assert all(a == b for a, b in draws) and len({a for a, _ in draws}) > 1


def test_the_nucleus_found_without_sorting_the_vocabulary_is_the_one_a_full_stable_sort_gives():
    rng = np.random.default_rng(3)
    for trial in range(300):
        n = int(rng.integers(1, 5000))
        # Spread logits, flat ones, and few distinct values (ties at every cut) alike.
        kinds = [rng.standard_normal(n) * 4, np.zeros(n), rng.integers(0, 3, n).astype(np.float64)]
        logits = kinds[trial % 3]
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        order = np.argsort(-probs, kind="stable")
        sums = np.cumsum(probs[order])
        for top_p in (0.05, 0.5, 0.9, 0.999999, 1 - 1e-15):
            expected = order[: int(np.searchsorted(sums, top_p)) + 1]
            assert np.array_equal(nucleus(probs, top_p), expected), (trial, top_p)


@pytest.mark.parametrize("top_p", [0.0, -0.1, 1.5, float("nan")])
def test_a_top_p_outside_zero_to_one_is_an_error_naming_it(top_p):
    with pytest.raises(ValueError, match=rf"top_p must be in \(0, 1\], got {top_p}"):
        sample(LOGITS, 1.0, 0, np.random.default_rng(0), top_p=top_p)


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
