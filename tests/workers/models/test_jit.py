"""How the kernels are loaded: from a cache named by their sources, lean once loaded."""

from __future__ import annotations

import importlib
import sys

import numba
import numpy as np
import pytest

from workers.models import jit

CACHED = """
import numba

@numba.njit(cache=True)
def twice(x):
    return 2 * x
"""
CALLER = """
import numba
from {module} import twice

@numba.njit
def twice_plus_one(x):
    return twice(x) + 1
"""


@pytest.fixture
def cached_module(tmp_path, monkeypatch):
    """A module of one cached kernel, its cache in tmp_path, importable under a name of its own."""
    name = f"lean_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(CACHED)
    (tmp_path / f"{name}_caller.py").write_text(CALLER.format(module=name))
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    for module in (name, f"{name}_caller"):
        sys.modules.pop(module, None)


def loaded(module: str):
    """The kernel of `module`, its dispatcher made anew, so that a call loads it from the cache."""
    return importlib.reload(importlib.import_module(module)).twice


def test_a_kernel_loaded_from_the_cache_keeps_no_parsed_ir_and_code_compiled_later_still_links_it(
    cached_module,
):
    assert loaded(cached_module)(np.int64(20)) == 40  # compiled, and saved in the cache
    twice = loaded(cached_module)
    assert twice(np.int64(20)) == 40
    assert len(twice.stats.cache_hits) == 1, "the kernel was compiled again rather than loaded"
    (library,) = (result.library for result in twice.overloads.values())
    assert library._shared_module is None, "the IR to link the kernel was kept parsed"
    assert isinstance(library, jit.LeanLibrary)
    caller = importlib.import_module(f"{cached_module}_caller")
    assert caller.twice_plus_one(np.int64(20)) == 41  # compiled here, linking the loaded kernel's IR
