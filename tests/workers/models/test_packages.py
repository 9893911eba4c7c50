"""Model files shipped in packages: found without importing them, joined once, their digest checked."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from workers.models import packages
from workers.spec import ModelSpecError


def _part_packages(root: Path, chunks: list[bytes]) -> list[tuple[str, str]]:
    """Packages p0, p1, … under root, each holding one chunk as data/file.partNN."""
    parts = []
    for i, chunk in enumerate(chunks):
        pkg = root / f"rlxtestpart{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise ImportError('a part package is read, never imported')\n")
        (pkg / "data" / f"file.part{i:02d}").write_bytes(chunk)
        parts.append((pkg.name, f"data/file.part{i:02d}"))
    return parts


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    """A model 'parted' of three chunks in packages on sys.path, joined into a cache under tmp_path."""
    chunks = [b"GGUF" + bytes(range(256)) * 40, b"middle" * 999, b"end"]
    parts = _part_packages(tmp_path / "site", chunks)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("RLX_MODEL_CACHE", str(tmp_path / "cache"))
    whole = b"".join(chunks)
    entry = packages.Shipped(
        "parted", "pip install parted", tuple(parts), "parted.gguf", hashlib.sha256(whole).hexdigest()
    )
    monkeypatch.setitem(packages.SHIPPED, "parted", entry)
    return entry, whole


def test_a_parted_file_is_joined_into_the_cache_once_with_a_line_of_progress_per_part(shipped, tmp_path):
    entry, whole = shipped
    lines: list[str] = []
    path = packages.path("parted", lines.append)
    assert path == tmp_path / "cache" / "parted.gguf"
    assert path.read_bytes() == whole
    assert len(lines) == 1 + len(entry.parts) and lines[-1].endswith("100%")
    again: list[str] = []
    assert packages.path("parted", again.append) == path
    assert again == []  # found by its stamp: neither joined nor hashed again


def test_a_cached_file_changed_after_its_check_is_joined_again(shipped):
    _, whole = shipped
    path = packages.path("parted", lambda line: None)
    path.write_bytes(b"not the model")
    lines: list[str] = []
    assert packages.path("parted", lines.append).read_bytes() == whole
    assert lines


def test_parts_whose_digest_differs_are_refused_and_leave_no_file(shipped, monkeypatch, tmp_path):
    entry, _ = shipped
    monkeypatch.setitem(packages.SHIPPED, "parted", entry._replace(sha256="0" * 64))
    with pytest.raises(ModelSpecError, match=r"SHA-256 is [0-9a-f]{64}, not 0{64}.*pip install parted"):
        packages.path("parted", lambda line: None)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["parted.lock"]


def test_a_missing_part_package_is_named_with_the_command_that_installs_it(shipped, monkeypatch):
    entry, _ = shipped
    missing = ((entry.parts[0]), ("rlxtest_not_installed", "data/x"))
    monkeypatch.setitem(packages.SHIPPED, "parted", entry._replace(parts=missing))
    with pytest.raises(ModelSpecError, match="needs the rlxtest_not_installed package: pip install parted"):
        packages.path("parted", lambda line: None)


def test_processes_asking_at_once_all_get_the_whole_file(shipped, tmp_path):
    entry, whole = shipped
    code = (
        "import sys; from workers.models import packages; "
        f"packages.SHIPPED['parted'] = packages.Shipped(*{tuple(entry)!r}); "
        "print(packages.path('parted', lambda line: None))"
    )
    env = {
        "PYTHONPATH": f"{tmp_path / 'site'}:{Path(__file__).parents[3]}",
        "RLX_MODEL_CACHE": str(tmp_path / "cache"),
    }
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env) for _ in range(3)
    ]
    outs = [p.communicate(timeout=60)[0].decode().strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert {Path(o).read_bytes() == whole for o in outs} == {True}
