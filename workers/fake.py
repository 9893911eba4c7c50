"""A fake stage for tests: the real process, report and protocol; toy compute.

Each layer l maps x to 2·x + l, so the output tells how many layers ran and
in which order (these affine maps do not commute). Knobs in the spec, e.g.
`fake:layers=8,delay_ms=5,crash_on=2`, make the worker misbehave on cue:

  layers=N          layers in the whole model (default 8)
  hidden=H          activation width (default 4)
  delay_ms=D        sleep D ms in every forward
  exit_before_report=1   exit with status 3 while building
  garbage=1         print a line that is not JSON on stdout before the report
  bad_report=1      print an invalid report, then never a valid one
  late_ms=D         take D ms longer to build (report late)
  crash_on=N        die (SIGKILL itself) on the N-th forward, counting from 1
  hang_on=N         never answer the N-th forward
  fail_on=N         answer the N-th forward with an error
  stage=I           apply the knobs only to the stage starting at layer I
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import numpy as np

from workers.models import parse_options
from workers.report import LayerRange
from workers.stage import ModelInfo, StageError

OPTIONS = {
    "layers": int,
    "hidden": int,
    "delay_ms": float,
    "exit_before_report": int,
    "garbage": int,
    "bad_report": int,
    "late_ms": float,
    "crash_on": int,
    "hang_on": int,
    "fail_on": int,
    "stage": int,
}
DEFAULTS: dict[str, object] = {"layers": 8, "hidden": 4, "delay_ms": 0.0}


def describe(spec: str) -> ModelInfo:
    """Describe the fake model named by `spec`."""
    o = DEFAULTS | parse_options(spec, OPTIONS)
    return ModelInfo(name=spec, n_layers=int(o["layers"]), input="hidden", hidden=int(o["hidden"]))


def reference(x: np.ndarray, layers: range) -> np.ndarray:
    """What the fake layers compute, for tests to compare against."""
    for layer in layers:
        x = 2 * x + np.float32(layer)
    return x


class FakeStage:
    """Layers `start..end` of the fake model, misbehaving as its knobs say."""

    def __init__(self, info: ModelInfo, spec: str, layers: LayerRange, precision: str) -> None:
        o = DEFAULTS | parse_options(spec, OPTIONS)
        targeted = "stage" not in o or o["stage"] == layers.start
        self.knobs = o if targeted else DEFAULTS | {"layers": o["layers"], "hidden": o["hidden"]}
        self.info = info
        self.layers = layers
        self.precision = precision
        self.n_params = len(layers) * info.hidden
        self.n_packed = 0
        self.forwards = 0
        self._misbehave_at_build()

    def _misbehave_at_build(self) -> None:
        k = self.knobs
        if k.get("late_ms"):
            time.sleep(float(k["late_ms"]) / 1000)
        if k.get("exit_before_report"):
            print(f"fake stage {self.layers}: exiting before the report, as asked", file=sys.stderr, flush=True)
            sys.exit(3)
        if k.get("garbage"):
            print("this line is not a report", flush=True)
        if k.get("bad_report"):
            print('{"addr": 12, "layers": "everything"}', flush=True)
            print(f"fake stage {self.layers}: printed a bad report, now waiting", file=sys.stderr, flush=True)
            threading.Event().wait()

    def forward(self, x: np.ndarray, *, session: str, start_pos: int, last_only: bool) -> np.ndarray:
        """Apply 2·x + l for each layer l, after the configured delay and failures."""
        self.forwards += 1
        k = self.knobs
        if k.get("crash_on") == self.forwards:
            print(f"fake stage {self.layers}: crashing on forward {self.forwards}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if k.get("hang_on") == self.forwards:
            threading.Event().wait()
        if k.get("fail_on") == self.forwards:
            raise StageError(f"fake failure on forward {self.forwards}, as asked")
        if x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != self.info.hidden:
            raise StageError(f"fake stage expects float32 (T, {self.info.hidden}), got {x.dtype} {x.shape}")
        time.sleep(float(k["delay_ms"]) / 1000)
        out = reference(x, range(self.layers.start, self.layers.end))
        return out[-1:] if last_only and self.layers.end == self.info.n_layers else out

    def reset(self, session: str) -> None:
        """Nothing is held per session."""

    def n_sessions(self) -> int:
        """No sessions are held."""
        return 0
