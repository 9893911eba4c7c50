"""A module imported when a test first uses it, not when every test process collects the file."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType


def lazy_import(name: str) -> ModuleType:
    """`name` as a module whose code runs on its first attribute access (importlib's LazyLoader).

    For a package that costs a second of CPU to import (openai) in a file that every xdist process
    collects and one runs: the others never pay for it.
    """
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"no module named {name!r}", name=name)
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
