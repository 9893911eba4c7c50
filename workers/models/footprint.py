"""What a model is and weighs, found cheaply: its fingerprint, and the bytes each stage of it holds.

A worker that joins a coordinator sends its model's fingerprint, so that both
sides can tell they hold the same weights without reading them all: for a GGUF
file its name, size and a hash of its first bytes (the header, where the
metadata and the tensor table are); for a model made from its spec, the spec.
The coordinator sizes stages to its workers' memory with a model's footprint:
each layer's bytes at a precision, from the tensor table or the model's shapes.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import msgspec

from workers.fake import FakeModel
from workers.models import GGUFModel, parse
from workers.models.layout import check_precision
from workers.models.quants import by_id, half_bytes, regrouped_bytes
from workers.models.synthetic import SyntheticModel
from workers.protocol.messages import Fingerprint
from workers.protocol.report import LayerRange
from workers.spec import ModelSpecError

if TYPE_CHECKING:
    from workers.models.gguf_file import TensorEntry

HEAD_BYTES = 1 << 20
F32 = 4


def fingerprint(spec: str) -> Fingerprint:
    """The fingerprint of the model `spec` names; a ModelSpecError naming a file that cannot be read."""
    model = parse(spec)
    if not isinstance(model, GGUFModel):
        return Fingerprint(kind="spec", name=spec)
    try:
        with open(model.path, "rb") as f:
            head = f.read(HEAD_BYTES)
            size = f.seek(0, 2)
    except OSError as exc:
        raise ModelSpecError(f"{model.path}: cannot read model file ({exc.strerror or exc})") from exc
    digest = hashlib.sha256(head).hexdigest()
    return Fingerprint(kind="gguf", name=model.path.name, size=size, head_sha256=digest)


def describe_fingerprint(print_: Fingerprint) -> str:
    """A fingerprint for a person: the spec, or the file's name, size and the start of its hash."""
    if print_.kind == "spec":
        return f"model {print_.name!r}"
    return f"{print_.name} ({print_.size} bytes, header sha256 {print_.head_sha256[:12]}…)"


class Footprint(msgspec.Struct, frozen=True):
    """The bytes a stage of a model holds, estimated from its tensors' sizes.

    layers: bytes of each layer's tensors, in layer order.
    embedding: bytes of the token embedding as held: the last stage holds it when its head is
        tied to the embedding (and looks its rows up there too if it is also the first).
    head: bytes only the last stage holds: the final norm and an untied head.
    tied: whether the head reuses the token embedding.
    in_file: bytes of the token embedding in the file, which a first stage that does not hold it
        leaves there, reading the rows it looks up: none of it is resident.
    norm: bytes of the final norm (counted in head).
    rows: the head's rows (the vocabulary), by which a stage holding some of them counts its share.
    """

    layers: list[int]
    embedding: int = 0
    head: int = 0
    tied: bool = False
    in_file: int = 0
    norm: int = 0
    rows: int = 0

    def stage_bytes(self, layers: LayerRange) -> int:
        """Bytes the stage holding `layers` keeps in memory (a table left in the file counts nothing)."""
        total = sum(self.layers[layers.start : layers.end])
        if not layers.is_last(len(self.layers)):
            return total
        matrix = self.embedding if self.tied else self.head - self.norm
        if layers.head is None or not self.rows:
            return total + matrix + self.norm
        # A cut head's stage holds its rows of the matrix; the last layer's stage the final norm too.
        return total + matrix * len(layers.head) // self.rows + (self.norm if len(layers) else 0)

    def in_file_bytes(self, layers: LayerRange) -> int:
        """Bytes the stage leaves in the file and reads from (a first stage's embedding it does not hold)."""
        holds = layers.is_last(len(self.layers)) and self.tied and layers.head is None
        return self.in_file if layers.is_first and not holds else 0


def footprint(spec: str, precision: str) -> Footprint:
    """The footprint of the model `spec` names, built in `precision`."""
    check_precision(precision)
    model = parse(spec)
    if isinstance(model, GGUFModel):
        return _gguf_footprint(model, precision)
    if isinstance(model, SyntheticModel):
        h = model.hidden
        return Footprint(layers=[(h + 4 * h * h) * F32] * model.layers)  # norm, up (h, 2h), down (2h, h)
    if isinstance(model, FakeModel):
        return Footprint(layers=[model.hidden * F32] * model.layers)
    raise ModelSpecError(f"model {spec!r}: no footprint for a {type(model).__name__}")


def _gguf_footprint(model: GGUFModel, precision: str) -> Footprint:
    from workers.models.gguf_file import GGUFError, open_gguf
    from workers.models.quants import UnknownType

    file = open_gguf(model.path)
    try:
        return _stage_bytes(file, precision)
    except UnknownType as exc:
        raise GGUFError(f"{file.path}: {exc}") from None


def _stage_bytes(file, precision: str) -> Footprint:
    """The footprint of a parsed GGUF file's tensors (an UnknownType for a type the house does not know)."""
    from workers.models.arch import read_params

    n_layers = read_params(file).n_layers
    layers = [0] * n_layers
    for e in file.tensors.values():
        kind, _, rest = e.name.partition(".")
        if kind == "blk":
            index = int(rest.partition(".")[0])
            if index < n_layers:
                layers[index] += _held_bytes(e, precision)
    tied = "output.weight" not in file.tensors
    head = sum(_held_bytes(file.entry(n), precision) for n in ("output_norm.weight", "output.weight")
               if n in file.tensors)  # fmt: skip
    table = file.entry("token_embd.weight")
    norm = (
        _held_bytes(file.entry("output_norm.weight"), precision)
        if "output_norm.weight" in file.tensors
        else 0
    )
    return Footprint(layers=layers, embedding=_held_bytes(table, precision), head=head, tied=tied,
                     in_file=table.n_bytes, norm=norm, rows=table.shape[0])  # fmt: skip


def _held_bytes(e: TensorEntry, precision: str) -> int:
    """Bytes a tensor takes once loaded as workers.models.weights loads it.

    Vectors stay float32 in every precision; a packed stage keeps the matrices of a type with a kernel
    in their regrouped blocks, F16 ones as float16, and holds every other one as float32.
    """
    q = by_id(int(e.qtype), e.name)
    if len(e.shape) == 2 and precision == "packed" and q.kernel:
        return regrouped_bytes(q.name, *e.shape)
    if len(e.shape) == 2 and precision == "packed" and q.use == "half":
        return half_bytes(*e.shape)
    return e.n_elements * F32
