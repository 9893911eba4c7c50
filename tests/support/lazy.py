"""A module imported when a test first uses it, not when every test process collects the file."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType


class LazyModule:
    """Module `name`, imported on the first access of one of its public attributes.

    For a package that costs a second of CPU to import (openai, ray) in a file that every xdist process
    collects and one runs: the others never pay for it. Private and dunder names are not looked up in the
    module: pytest's collection reads such names on everything a test module holds (`_mock_name`,
    `__wrapped__`), and importlib's LazyLoader imported the whole package on them, at collection.
    """

    def __init__(self, name: str) -> None:
        if importlib.util.find_spec(name) is None:
            raise ModuleNotFoundError(f"no module named {name!r}", name=name)
        self._name = name

    def __getattr__(self, attr: str) -> object:
        if attr.startswith("_"):
            raise AttributeError(attr)
        return getattr(self._module(), attr)

    def _module(self) -> ModuleType:
        return importlib.import_module(self._name)

    def __repr__(self) -> str:
        return f"<module {self._name!r}, imported on first use>"


def lazy_import(name: str) -> LazyModule:
    """`name` as a LazyModule."""
    return LazyModule(name)
