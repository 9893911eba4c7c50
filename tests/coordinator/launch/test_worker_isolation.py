"""Workers import the project's code only, never a file from the coordinator's directory."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from tests.conftest import worker_pids

# Imported by tokenize, hence by logging, hence by every Python program that logs.
PLANTED = """\
import os, pathlib
pathlib.Path({marker!r}).write_text(f"imported by pid {{os.getpid()}}")
os._exit(3)
"""


async def test_a_stdlib_name_planted_in_the_coordinators_directory_is_never_imported(tmp_path):
    marker = tmp_path / "MARKER"
    (tmp_path / "token.py").write_text(PLANTED.format(marker=str(marker)))
    cli = Path(sys.executable).with_name("rlx-cluster")
    proc = await asyncio.create_subprocess_exec(
        str(cli), "run", "--model", "fake:layers=2", "--stages", "2", "--db", ":memory:",
        cwd=tmp_path, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert not marker.exists(), marker.read_text()
    assert proc.returncode == 0, err.decode()
    assert "across 2 stages" in out.decode()
    assert worker_pids(proc.pid) == []
