"""The pytest plugin from the built wheel alone: a fresh venv, the README's example test outside the repo.

The venv gets the wheel and its dependencies from the wheelhouse `make install`
fills (`pip download`), with `--no-index`: no network, and nothing of this
checkout or of the development venv is visible to it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
WHEELHOUSE = Path(sys.prefix) / "wheelhouse"
# What the wheel is built from (pyproject's packages and readme).
SOURCES = ("pyproject.toml", "README.md", "coordinator", "workers")
STEP_TIMEOUT_S = 90

# Appended to the README's example: where the fixture comes from, and a test that leaks a worker.
CHECKS = """

import os
import sys
from pathlib import Path

import coordinator.testing.plugin


def test_the_fixture_comes_from_the_installed_package(request):
    assert request.config.pluginmanager.get_plugin("rlx_cluster") is coordinator.testing.plugin
    assert Path(coordinator.testing.plugin.__file__).is_relative_to(sys.prefix)


def test_a_leaked_worker_fails_this_test(monkeypatch, rlx_cluster):
    monkeypatch.setattr("coordinator.testing.process.WORKER_EXIT_S", 1.0)  # undone after the fixture's end
    cluster = rlx_cluster("fake:layers=2", stages=1)
    argv = [sys.executable, "-c", "import time; time.sleep(60)", "--parent-pid", str(cluster.pid)]
    os.posix_spawn(sys.executable, argv, os.environ, setsid=True)  # it ignores the coordinator's going
"""


def readme_example() -> str:
    """The complete example test of the README's "Testing your tools against rlx-cluster" section."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Testing your tools against rlx-cluster", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def run(*argv: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    """Run a command to completion (bounded); its output, or a failure showing it."""
    done = subprocess.run(
        [str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=STEP_TIMEOUT_S
    )
    if done.returncode != 0:
        pytest.fail(
            f"{argv[:4]} exited {done.returncode} (wheelhouse {WHEELHOUSE}: `make install` refills it):\n"
            f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    return done.stdout


# Building, installing and the sample's four clusters: ~40 s on an idle 2-core machine, 70 s under load.
@pytest.mark.timeout(4 * STEP_TIMEOUT_S)
def test_the_built_wheel_brings_the_fixture_to_a_project_outside_the_repository(tmp_path):
    if not WHEELHOUSE.is_dir():
        pytest.fail(
            f"no wheelhouse at {WHEELHOUSE}: `make install` fills it (pip download of the dependencies)"
        )
    source = tmp_path / "source"
    source.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(REPO / name, source / name)
    offline = ("--no-index", "--find-links", WHEELHOUSE)
    run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *offline, "-w", tmp_path / "dist", source)
    [wheel] = (tmp_path / "dist").glob("rlx_cluster-*.whl")
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    # A dependency missing here is one added since the wheelhouse was filled: `make install` refills it.
    run(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-compile", *offline, wheel,
        "pytest", "pytest-asyncio")  # fmt: skip

    project = tmp_path / "project"
    project.mkdir()
    (project / "test_sample.py").write_text(readme_example() + CHECKS)
    ini = "[pytest]\nfilterwarnings = error\nasyncio_default_fixture_loop_scope = function\n"
    (project / "pytest.ini").write_text(ini)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PYTEST", "VIRTUAL_ENV"))}
    done = subprocess.run(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA"], cwd=project, env=env,
        capture_output=True, text=True, timeout=STEP_TIMEOUT_S,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert re.search(r"\b5 passed, 1 error\b", out), out[-5000:]
    assert "ERROR at teardown of test_a_leaked_worker_fails_this_test" in out, out[-5000:]
    assert "a worker leaked (killed now)" in out and "outlived it" in out, out[-5000:]
