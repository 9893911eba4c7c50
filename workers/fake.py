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
  vocab=V           a language model: token ids in, the last stage's rows are V logits each
  tokenizer=F       the GGUF file (or shipped model: smollm2, gemma3) whose tokenizer the
                    coordinator uses with a fake language model

A knob written `knob@I=value` applies to the stage starting at layer I alone,
on top of the shared knobs, so several stages can misbehave differently in one
spec: `fake:layers=4,delay_ms=5,crash_on@2=3,hang_on@0=1`.

A fake language model (`vocab=V`) costs what the model's compute does not: its
last stage sends V float32 logits a row, as a real head does, so a served run on
it times the coordinator's part of a decode step (bench/overhead.py). A row's
logits are a seeded draw with one token far above the others, which moves with
the position; the ids below FIRST_TEXT_ID (the control and byte tokens of the
shipped vocabularies) are kept far below, so that no run ends early on an end
token, greedy or sampled.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Annotated

import msgspec
import numpy as np

from workers.protocol.info import ModelInfo
from workers.protocol.report import LayerRange
from workers.spec import ModelSpecError, parse_options
from workers.stage import StageError, StatelessStage, check_hidden

Positive = Annotated[int, msgspec.Meta(ge=1)]
Millis = Annotated[float, msgspec.Meta(ge=0)]


class FakeModel(msgspec.Struct, frozen=True):
    """The model a `fake[:knob=value,...]` spec names; its fields besides `name` are the knobs above.

    A knob left at 0 (or `stage` at None) is off.
    """

    name: str
    layers: Positive = 8
    hidden: Positive = 4
    delay_ms: Millis = 0.0
    exit_before_report: int = 0
    garbage: int = 0
    bad_report: int = 0
    late_ms: Millis = 0.0
    crash_on: int = 0
    hang_on: int = 0
    fail_on: int = 0
    stage: int | None = None
    vocab: Annotated[int, msgspec.Meta(ge=0)] = 0
    tokenizer: str = ""

    def describe(self) -> ModelInfo:
        """The fake model's shape: hidden states in and out, or token ids in and logits out."""
        if self.vocab:
            return ModelInfo(
                name=self.name, n_layers=self.layers, input="tokens", hidden=self.hidden, vocab=self.vocab
            )
        return ModelInfo(name=self.name, n_layers=self.layers, input="hidden", hidden=self.hidden)

    def build(self, layers: LayerRange, precision: str) -> FakeStage:
        """Build the stage holding `layers`, misbehaving as the knobs say."""
        return FakeStage(stage_knobs(self.name, layers.start), layers, precision)


# Knobs that describe the whole model: shared by every stage, never set per stage.
SHAPE = ("layers", "hidden", "stage", "vocab", "tokenizer")
# Ids a fake language model's logits keep far below the others: the shipped vocabularies' control
# and byte tokens (SmolLM2's end tokens are 0 and 2, Gemma 3's 1 and 106) all fall below it.
FIRST_TEXT_ID = 256
# How far the favoured token stands above the others, and the low ids below them, in logits: e^-20 of
# a token's probability at temperature 1, so a sampled run never draws a low id either.
FAKE_LOGIT_GAP = 20.0


def _options(spec: str) -> list[tuple[str, int | None]]:
    """Each `knob=value` of `spec` with the layer its `@I` names (None for a shared knob)."""
    options = []
    for item in filter(None, (p.strip() for p in spec.partition(":")[2].split(","))):
        key, _, value = item.partition("=")
        knob, at, layer = key.strip().partition("@")
        if not at:
            options.append((item, None))
        elif knob in SHAPE or not (layer.isascii() and layer.isdigit()):
            raise ModelSpecError(
                f"bad option {item!r} in model spec {spec!r}: a knob for one stage is written "
                f"KNOB@LAYER=VALUE (LAYER: the stage's first layer), for any knob but {', '.join(SHAPE)}"
            )
        else:
            options.append((f"{knob}={value}", int(layer)))
    return options


def stage_knobs(spec: str, start: int | None = None) -> FakeModel:
    """The knobs of the stage starting at layer `start`: shared ones (where `stage` allows), then its own.

    With `start` None, the shared knobs alone: the model as the coordinator sees it.
    """
    options = _options(spec)
    shared = [item for item, layer in options if layer is None]
    model = parse_options("fake:" + ",".join(shared), FakeModel)
    if start is not None:
        if model.stage is not None and model.stage != start:
            # Another stage's shared knobs leave this one well behaved: only the model's shape applies.
            shared = [item for item in shared if item.partition("=")[0].strip() in SHAPE]
        own = [item for item, layer in options if layer == start]
        try:
            model = parse_options("fake:" + ",".join(shared + own), FakeModel)
        except ModelSpecError as exc:
            raise ModelSpecError(f"{exc}; for the stage at layer {start} of model spec {spec!r}") from None
    return msgspec.structs.replace(model, name=spec)


def parse(spec: str) -> FakeModel:
    """Parse a `fake:knob=value,...` spec, every stage's own knobs checked too."""
    for layer in {layer for _, layer in _options(spec) if layer is not None}:
        stage_knobs(spec, layer)
    return stage_knobs(spec)


def _say(text: str) -> None:
    """Write a line to stderr, where a worker's logs go."""
    print(text, file=sys.stderr, flush=True)


def reference(x: np.ndarray, layers: range) -> np.ndarray:
    """What the fake layers compute, for tests to compare against."""
    for layer in layers:
        x = 2 * x + np.float32(layer)
    return x


def fake_logits_base(vocab: int) -> np.ndarray:
    """The logits every row of a fake language model starts from: a seeded draw, the low ids far below."""
    base = np.random.default_rng(vocab).standard_normal(vocab).astype(np.float32)
    base[: low_ids(vocab)] -= FAKE_LOGIT_GAP
    return base


def low_ids(vocab: int) -> int:
    """How many of the first ids a fake language model never favours: FIRST_TEXT_ID, or half a small vocab."""
    return min(FIRST_TEXT_ID, vocab // 2)


def favoured(vocab: int, position: int) -> int:
    """The token a fake language model's logits put far above the others at `position`."""
    low = low_ids(vocab)
    return low + position % (vocab - low)


def fake_logits(base: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """A fake language model's logits for rows at `positions`: the base, each row's token raised."""
    out = np.tile(base, (len(positions), 1))  # (rows, vocab)
    tokens = [favoured(len(base), int(p)) for p in positions]
    out[np.arange(len(positions)), tokens] += FAKE_LOGIT_GAP
    return out


class FakeStage(StatelessStage):
    """Layers `start..end` of the fake model, misbehaving as its knobs say."""

    def __init__(self, model: FakeModel, layers: LayerRange, precision: str) -> None:
        self.knobs = model
        self.info = model.describe()
        self.layers = layers
        self.precision = precision
        self.n_params = len(layers) * model.hidden
        self.n_packed = 0
        self.forwards = 0
        self._logits = fake_logits_base(model.vocab) if model.vocab else np.empty(0, np.float32)
        self._misbehave_at_build()

    def _misbehave_at_build(self) -> None:
        k = self.knobs
        if k.late_ms:
            time.sleep(k.late_ms / 1000)
        if k.exit_before_report:
            _say(f"fake stage {self.layers}: exiting before the report, as asked")
            sys.exit(3)
        if k.garbage:
            print("this line is not a report", flush=True)
        if k.bad_report:
            print('{"addr": 12, "layers": "everything"}', flush=True)
            _say(f"fake stage {self.layers}: printed a bad report, now waiting")
            threading.Event().wait()

    def forward(self, x: np.ndarray, *, session: str, start_pos: int, last_only: bool) -> np.ndarray:
        """Apply 2·x + l for each layer l, after the configured delay and failures."""
        self.forwards += 1
        k = self.knobs
        if k.crash_on == self.forwards:
            _say(f"fake stage {self.layers}: crashing on forward {self.forwards}")
            os.kill(os.getpid(), signal.SIGKILL)
        if k.hang_on == self.forwards:
            threading.Event().wait()
        if k.fail_on == self.forwards:
            raise StageError(f"fake failure on forward {self.forwards}, as asked")
        x = self._embed(x) if k.vocab and self.layers.start == 0 else x
        x = check_hidden(x, self.info.hidden, self.layers)
        time.sleep(k.delay_ms / 1000)
        out = reference(x, range(self.layers.start, self.layers.end))
        if not self.layers.is_last(self.info.n_layers):
            return out
        out = out[-1:] if last_only else out
        if not k.vocab:
            return out
        positions = start_pos + np.arange(len(x))[-len(out) :]
        return fake_logits(self._logits, positions)

    def _embed(self, ids: np.ndarray) -> np.ndarray:
        """A fake language model's token ids as hidden rows: each row the id, `hidden` times."""
        if ids.dtype != np.int32 or ids.ndim != 1 or ids.size == 0:
            raise StageError(f"stage {self.layers} expects int32 token ids (T,), got {ids.dtype} {ids.shape}")
        return np.repeat(ids.astype(np.float32)[:, None], self.info.hidden, axis=1)  # (T, hidden)
