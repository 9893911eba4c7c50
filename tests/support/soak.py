"""Parametrizations split between `make test` and `make soak`."""

from __future__ import annotations

from collections.abc import Iterable

import pytest


def soak_beyond(values: Iterable, keep: Iterable) -> list:
    """The values as parameters: those in `keep` run in `make test`, the others under the soak mark.

    For the cases that take the same code path as a kept one with other data: `make soak` still runs
    every case, `make test` one per path. A tuple value is a case of several arguments.
    """
    kept = list(keep)
    out = []
    for value in values:
        args = value if isinstance(value, tuple) else (value,)
        out.append(pytest.param(*args, marks=() if value in kept else pytest.mark.soak))
    return out
