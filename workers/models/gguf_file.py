"""Read a GGUF file: its metadata, a llama model's hyper-parameters, single tensors.

The `gguf` package parses the header (slow for big vocabularies: ~1.6 s for
SmolLM2), so the parsed table is cached per file; tensor bytes are then read
one tensor at a time, so a stage touches only the tensors it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from workers.models.spec import ModelSpecError

GGUF_MAGIC = b"GGUF"
# Arrays longer than this (the vocabulary, the merges) stay out of the cached
# metadata: stages never need them and they would sit in every worker's memory.
SMALL_ARRAY = 64
_MISSING = object()


class GGUFError(ModelSpecError):
    """A GGUF file that cannot be read, or does not hold what was asked of it."""


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in the file and how it is stored.

    shape: numpy order, e.g. (out, in) for a matrix (GGUF lists it reversed).
    offset: absolute byte offset of its data in the file.
    n_bytes: bytes of data as stored (packed blocks for quantized types).
    """

    name: str
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int
    n_bytes: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))


@dataclass(frozen=True)
class LlamaParams:
    """A llama model's hyper-parameters, as its GGUF metadata states them."""

    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    eps: float
    rope_base: float
    context_length: int
    vocab: int


@dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF file: small metadata values and the tensor table."""

    path: Path
    fields: dict[str, Any]
    tensors: dict[str, TensorEntry]

    @property
    def architecture(self) -> str:
        return str(self.get("general.architecture"))

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """The metadata value at `key`; an error naming the key if absent and no default."""
        if key in self.fields:
            return self.fields[key]
        if default is _MISSING:
            raise GGUFError(f"{self.path}: metadata key {key!r} is missing")
        return default

    def entry(self, name: str) -> TensorEntry:
        """The table entry of tensor `name`; an error naming it if the file lacks it."""
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: tensor {name!r} is missing") from None

    def raw(self, name: str) -> np.ndarray:
        """Tensor `name` as stored: float arrays as they are, quantized ones as uint8 rows of blocks."""
        e = self.entry(name)
        if e.qtype == gguf.GGMLQuantizationType.F32:
            dtype, shape = np.dtype(np.float32), e.shape
        elif e.qtype == gguf.GGMLQuantizationType.F16:
            dtype, shape = np.dtype(np.float16), e.shape
        else:
            dtype, shape = np.dtype(np.uint8), gguf.quant_shape_to_byte_shape(e.shape, e.qtype)
        data = np.empty(e.n_bytes, dtype=np.uint8)
        with open(self.path, "rb") as f:
            f.seek(e.offset)
            got = f.readinto(memoryview(data))
        if got != e.n_bytes:
            raise GGUFError(f"{self.path}: truncated file, tensor {name!r} has {got} of {e.n_bytes} bytes")
        return data.view(dtype).reshape(shape)

    def dequantize(self, name: str) -> np.ndarray:
        """Tensor `name` as float32 in numpy order (a matrix is (out, in))."""
        return dequantize(self.raw(name), self.entry(name).qtype)

    def llama_params(self) -> LlamaParams:
        """Read a llama model's hyper-parameters; an error if the file is not a llama model."""
        arch = self.architecture
        if arch != "llama":
            raise GGUFError(
                f"{self.path}: architecture {arch!r} is not supported; only 'llama' GGUF files are"
            )

        def number(key: str, default: Any = _MISSING) -> Any:
            value = self.get(f"{arch}.{key}", default)
            if isinstance(value, (list, str)):
                raise GGUFError(f"{self.path}: {arch}.{key} = {value!r} is not a single number")
            return value

        hidden = int(number("embedding_length"))
        n_heads = int(number("attention.head_count"))
        if n_heads <= 0 or hidden % n_heads:
            raise GGUFError(
                f"{self.path}: embedding_length {hidden} is not a multiple of head_count {n_heads}"
            )
        head_dim = hidden // n_heads
        n_kv_heads = int(number("attention.head_count_kv", n_heads))
        if n_kv_heads <= 0 or n_heads % n_kv_heads:
            raise GGUFError(
                f"{self.path}: head_count {n_heads} is not a multiple of head_count_kv {n_kv_heads}"
            )
        if int(number("attention.key_length", head_dim)) != head_dim:
            raise GGUFError(f"{self.path}: attention.key_length differs from embedding_length / head_count")
        if int(number("rope.dimension_count", head_dim)) != head_dim:
            raise GGUFError(f"{self.path}: partial RoPE (rope.dimension_count != head dim) is not supported")
        scaling = str(self.get(f"{arch}.rope.scaling.type", "none"))
        if scaling != "none" or "rope_freqs.weight" in self.tensors:
            raise GGUFError(f"{self.path}: RoPE scaling ({scaling}, rope_freqs) is not supported")
        vocab = number("vocab_size", None)
        if vocab is None:
            vocab = self.entry("token_embd.weight").shape[0]
        return LlamaParams(
            n_layers=int(number("block_count")),
            hidden=hidden,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            ffn=int(number("feed_forward_length")),
            eps=float(number("attention.layer_norm_rms_epsilon")),
            rope_base=float(number("rope.freq_base", 10000.0)),
            context_length=int(number("context_length")),
            vocab=int(vocab),
        )


def dequantize(data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """Stored tensor data (as `GGUFFile.raw` gives it) to float32."""
    try:
        out = gguf.quants.dequantize(data, qtype)
    except NotImplementedError as exc:
        raise GGUFError(f"tensor type {qtype.name} cannot be dequantized") from exc
    return out.astype(np.float32, copy=False)


def open_gguf(path: Path | str) -> GGUFFile:
    """Parse the GGUF file at `path` (cached while the file is unchanged)."""
    key = _key(path)
    if key not in _parsed:
        _remember(key, _summarize(key, _reader(key[0])))
    return _parsed[key]


def read_arrays(path: Path | str, keys: list[str]) -> dict[str, list[Any]]:
    """Metadata arrays of any length (e.g. the vocabulary); absent keys are left out."""
    key = _key(path)
    reader = _reader(key[0])
    if key not in _parsed:
        _remember(key, _summarize(key, reader))
    return {k: list(field.contents()) for k in keys if (field := reader.get_field(k)) is not None}


# Parsed files by (path, size, mtime): a changed file is parsed again.
_parsed: dict[tuple[Path, int, int], GGUFFile] = {}
CACHED_FILES = 4


def _key(path: Path | str) -> tuple[Path, int, int]:
    path = Path(path)
    try:
        st = path.stat()
    except OSError as exc:
        raise GGUFError(f"{path}: cannot read model file ({exc.strerror or exc})") from exc
    if not path.is_file():
        raise GGUFError(f"{path}: not a regular file")
    return path.resolve(), st.st_size, st.st_mtime_ns


def _remember(key: tuple[Path, int, int], file: GGUFFile) -> None:
    while len(_parsed) >= CACHED_FILES:
        _parsed.pop(next(iter(_parsed)))
    _parsed[key] = file


def _reader(path: Path) -> gguf.GGUFReader:
    with open(path, "rb") as f:
        magic = f.read(4)
    if len(magic) < len(GGUF_MAGIC):
        raise GGUFError(f"{path}: not a GGUF file (only {len(magic)} bytes long)")
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
    # The reader memory-maps the file and fails on a damaged one with whatever
    # numpy raises (reshape, view, mmap errors): name the file and the cause.
    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:
        raise GGUFError(f"{path}: not a readable GGUF file, truncated or corrupt ({exc})") from exc
    if reader.byte_order != "I":
        raise GGUFError(f"{path}: byte order differs from this machine's; not supported")
    return reader


def _summarize(key: tuple[Path, int, int], reader: gguf.GGUFReader) -> GGUFFile:
    path, size, _ = key
    fields = {
        k: field.contents()
        for k, field in reader.fields.items()
        if not k.startswith("GGUF.") and len(field.data) <= SMALL_ARRAY
    }
    tensors = {
        t.name: TensorEntry(
            name=t.name,
            qtype=t.tensor_type,
            shape=tuple(int(d) for d in reversed(t.shape.tolist())),
            offset=int(t.data_offset),
            n_bytes=int(t.n_bytes),
        )
        for t in reader.tensors
    }
    end = max((e.offset + e.n_bytes for e in tensors.values()), default=0)
    if end > size:
        raise GGUFError(f"{path}: truncated file, tensor data ends at byte {end} but the file has {size}")
    return GGUFFile(path=path, fields=fields, tensors=tensors)
