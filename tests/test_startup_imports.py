"""What a worker or a coordinator imports to start: hundreds start in a test run, each paying for it."""

from __future__ import annotations

import json
import subprocess
import sys

# Imported only to read or compute a model file: a fake or synthetic worker, and a coordinator (which
# reads a GGUF file's tokenizer lazily), start without them. The gguf package costs a tenth of a second
# of CPU (it brings yaml), numba half a second.
HEAVY = ("gguf", "yaml", "numba", "llvmlite")


def test_a_worker_and_a_coordinator_start_without_the_model_file_packages():
    code = (
        "import json, sys; import workers.__main__, coordinator.cli.main; "
        f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [], "imported at start by workers.__main__ or coordinator.cli.main"
