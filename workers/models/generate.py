"""Choose the next token from a position's logits."""

from __future__ import annotations

import numpy as np


def sample(
    logits: np.ndarray, temperature: float, top_k: int, rng: np.random.Generator | None, top_p: float = 1.0
) -> int:
    """The next token id: argmax at temperature 0, else drawn by `rng` from the softmax of the top_k logits.

    logits: (vocab,) or (1, vocab). top_k <= 0 keeps the whole vocabulary.
    top_p: then keep only the most likely tokens whose probabilities add up to
        at least top_p (nucleus sampling); 1 keeps them all.
    """
    logits = np.asarray(logits)
    if logits.ndim == 2 and logits.shape[0] == 1:
        logits = logits[0]
    if logits.ndim != 1 or logits.size == 0:
        raise ValueError(f"sample expects logits of shape (vocab,) or (1, vocab), got {logits.shape}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if temperature == 0:
        return int(np.argmax(logits))
    ids = np.arange(logits.size)
    if 0 < top_k < logits.size:
        ids = np.sort(np.argpartition(logits, logits.size - top_k)[-top_k:])
    # The whole vocabulary's logits taken as they are: indexing them by every id is a copy for nothing.
    scaled = (logits[ids] if ids.size < logits.size else logits).astype(np.float64) / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if top_p < 1:
        keep = nucleus(probs, top_p)
        ids, probs = ids[keep], probs[keep] / probs[keep].sum()
    if rng is None:
        raise ValueError(f"sampling at temperature {temperature} needs a random generator")
    return int(ids[rng.choice(ids.size, p=probs)])


# Tokens first looked at for a nucleus, and the factor they grow by while their mass falls short.
NUCLEUS_FIRST, NUCLEUS_GROWTH = 64, 8


def nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """The places of the most likely tokens whose mass first reaches top_p, most likely first.

    As a stable sort of the whole vocabulary by likelihood would give them, its cumulative sum cut at
    the first token that brings the mass to top_p (that token kept), without sorting the whole of it
    (a 49,152-token sort takes milliseconds): the tokens at least as likely as the m-th most likely,
    ties included, are the sorted order's first ones, and a cumulative sum adds in order, so their
    sums are its first sums, bit for bit; m grows until they reach top_p.
    """
    m = NUCLEUS_FIRST
    while m < probs.size:
        floor = np.partition(probs, probs.size - m)[probs.size - m]  # the m-th largest
        top = np.flatnonzero(probs >= floor)  # in id order, so that the stable sort breaks ties by id
        order = top[np.argsort(-probs[top], kind="stable")]
        sums = np.cumsum(probs[order])
        if sums[-1] >= top_p:
            return order[: int(np.searchsorted(sums, top_p)) + 1]
        m *= NUCLEUS_GROWTH
    order = np.argsort(-probs, kind="stable")
    # The nucleus ends at the first token that brings the mass to top_p: it is kept.
    return order[: int(np.searchsorted(np.cumsum(probs[order]), top_p)) + 1]
