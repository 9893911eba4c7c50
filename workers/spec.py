"""What a model spec names: the Model it parses into, its options, the error when it names nothing."""

from __future__ import annotations

from typing import Protocol, TypeVar

import msgspec

from workers.protocol.info import ModelInfo
from workers.protocol.report import LayerRange
from workers.stage import Stage


class ModelSpecError(ValueError):
    """A model spec that names nothing we can build."""


# Here rather than in workers.models.gguf_file, which imports the gguf package (a tenth of a second of
# every process's start): the architecture table raises it too, and a fake or synthetic worker (or a
# coordinator) imports that table without ever reading a file.
class GGUFError(ModelSpecError):
    """A GGUF file that cannot be read, or does not hold what was asked of it."""


class Model(Protocol):
    """A parsed model spec: enough to describe the model and build any of its stages."""

    name: str

    def describe(self) -> ModelInfo:
        """Read what the coordinator needs (layer count, input kind) without loading tensors."""
        ...

    def build(self, layers: LayerRange, precision: str) -> Stage:
        """Build the stage holding `layers`, already checked to fit the model."""
        ...


M = TypeVar("M", bound=msgspec.Struct)


def parse_options(spec: str, cls: type[M]) -> M:
    """Parse `kind:k=v,k=v` into `cls`, a Struct whose fields besides `name` are the options.

    Each value is converted to its field's type, constraints included; an
    unknown key or a bad value is a ModelSpecError naming it.
    """
    fields = {f.name: f.type for f in msgspec.structs.fields(cls) if f.name != "name"}
    _, _, rest = spec.partition(":")
    options: dict[str, object] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key not in fields:
            raise ModelSpecError(f"bad option {item!r} in model spec {spec!r}; options: {', '.join(fields)}")
        try:
            options[key] = msgspec.convert(value.strip(), fields[key], strict=False)
        except msgspec.ValidationError as exc:
            raise ModelSpecError(f"bad value for {key} in model spec {spec!r}: {value!r} ({exc})") from exc
    return cls(name=spec, **options)
