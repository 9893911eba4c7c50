"""How the coordinator writes for people: quantities, and the progress lines it may say."""

from __future__ import annotations


def quiet(text: str) -> None:
    """Say nothing: the progress of a caller with no one to tell."""


def size_text(n_bytes: int) -> str:
    """Bytes for a person, in decimal units: 512 B, 65.8 kB, 538 MB, 1.2 GB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n_bytes >= scale:
            value = n_bytes / scale
            return f"{value:.1f} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{n_bytes} B"
