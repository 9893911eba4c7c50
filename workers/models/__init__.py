"""Choose a model by its spec, in this one table.

Specs: `synthetic[:layers=N,hidden=H,seed=S]`, `fake[:knob=value,...]`,
`smollm2` and `gemma3` (GGUF files shipped by Python packages: workers.models.packages), or a path to a
`.gguf` file of an architecture workers.models.arch knows. Each kind parses its spec once into a Model
that describes the model and builds its stages.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import NamedTuple

import msgspec
import numpy as np

from workers import fake, memory
from workers.models import packages
from workers.models.synthetic import SyntheticModel, make_input
from workers.protocol.info import ModelInfo
from workers.protocol.report import LayerRange
from workers.spec import Model, ModelSpecError, parse_options
from workers.stage import Stage

__all__ = [
    "ACCEPTED",
    "ModelSpecError",
    "build",
    "default_precision",
    "describe",
    "gemma3_path",
    "gguf_path",
    "model_input",
    "parse",
    "smollm2_path",
    "tokenizer_path",
]


class GGUFModel(msgspec.Struct, frozen=True):
    """A GGUF file of an architecture workers.models.arch knows.

    name: the spec as given.
    path: the file.
    """

    name: str
    path: Path

    def describe(self) -> ModelInfo:
        """Read the model's shape from the file's metadata."""
        from workers.models import transformer  # the gguf package takes ~0.3 s to import: only when used

        return transformer.describe(self.path, self.name)

    def build(self, layers: LayerRange, precision: str) -> Stage:
        """Load the blocks of `layers` from the file."""
        from workers.models import transformer

        return transformer.build(self.path, self.name, layers, precision)


def smollm2_path() -> Path:
    """SmolLM2's GGUF file inside its installed package."""
    return packages.path("smollm2")


def gemma3_path() -> Path:
    """Gemma 3 270M's GGUF file, joined from its part packages into the model cache on first use."""
    return packages.path("gemma3")


def _shipped(spec: str) -> GGUFModel:
    if spec not in packages.SHIPPED:
        raise ModelSpecError(f"model spec {spec!r}: {spec.partition(':')[0]} takes no options")
    return GGUFModel(name=spec, path=packages.path(spec))


class Kind(NamedTuple):
    """One kind of model: how its spec is written, and how it is parsed."""

    usage: str
    parse: Callable[[str], Model]


KINDS: dict[str, Kind] = {
    "synthetic": Kind("synthetic[:layers=N,hidden=H,seed=S]", partial(parse_options, cls=SyntheticModel)),
    "fake": Kind("fake[:knob=value,...]", lambda spec: fake.parse(spec)),  # fake imports our spec module
    "smollm2": Kind("smollm2", _shipped),
    "gemma3": Kind("gemma3", _shipped),
    "*.gguf": Kind(
        "a path to a .gguf file (llama, qwen2, qwen3, gemma3, phi3)", lambda spec: GGUFModel(spec, Path(spec))
    ),
}
ACCEPTED = ", ".join(kind.usage for kind in KINDS.values())


def parse(spec: str) -> Model:
    """The model `spec` names, parsed once; an unknown kind is an error listing the accepted specs."""
    # A kind's own prefix first: a fake's tokenizer knob may end the spec in `.gguf`.
    kind = spec.partition(":")[0]
    kind = "*.gguf" if kind not in KINDS and spec.endswith(".gguf") else kind
    if kind not in KINDS:
        raise ModelSpecError(f"unknown model {spec!r}; accepted: {ACCEPTED}")
    return KINDS[kind].parse(spec)


def describe(spec: str) -> ModelInfo:
    """Read what the coordinator needs (layer count, input kind) without loading tensors."""
    return parse(spec).describe()


def model_input(info: ModelInfo, seq: int, seed: int) -> np.ndarray:
    """The input of a run of `seq` positions without a prompt: seeded activations, (seq, hidden) float32.

    A model that takes tokens has none: its runs start from a prompt.
    """
    if info.input != "hidden":
        raise ValueError(f"model {info.name!r} takes {info.input}: its runs start from a prompt, not a seq")
    return make_input(seq, info.hidden, seed)  # (seq, hidden)


def build(spec: str, layers: LayerRange, precision: str) -> Stage:
    """Build the stage holding `layers` of the model named by `spec`."""
    model = parse(spec)
    info = model.describe()
    n_layers = info.n_layers
    if (len(layers) == 0 and layers.head is None) or layers.end > n_layers:
        raise ModelSpecError(f"layers {layers} do not fit model {spec!r} with {n_layers} layers")
    if layers.head is not None and (layers.end != n_layers or layers.head.end > info.vocab):
        raise ModelSpecError(
            f"head rows {layers.head} do not fit model {spec!r}: a stage holds head rows only with its "
            f"last layer ({n_layers - 1}), rows within 0..{info.vocab}"
        )
    stage = model.build(layers, precision)
    memory.give_back()  # what the build read and let go, so that the report's resident set is the stage's
    return stage


def default_precision(spec: str) -> str:
    """The precision a model is built in unless another is asked for.

    A GGUF file's own blocks (packed), as llama.cpp runs a file in its own
    quantization: on SmolLM2 it decodes ~3x as fast as f32 in a third of the
    memory (README, Performance); f32 for the other models, which hold no blocks.
    """
    return "packed" if gguf_path(spec) is not None else "f32"


def gguf_path(spec: str) -> Path | None:
    """The GGUF file a spec names, or None when it names no file."""
    model = parse(spec)
    return model.path if isinstance(model, GGUFModel) else None


def tokenizer_path(spec: str) -> Path | None:
    """The GGUF file whose tokenizer a language model's runs use: its own, or the one a fake names."""
    model = parse(spec)
    if isinstance(model, fake.FakeModel):
        name = model.tokenizer
        return packages.path(name) if name in packages.SHIPPED else Path(name) if name else None
    return gguf_path(spec)
