"""Read a GGUF file: its metadata and single tensors (workers.models.arch reads the hyper-parameters).

The header is walked in place (a memory map, values unpacked where they lie):
small metadata values are decoded, long arrays (the vocabulary, the merges)
are stepped over and only their place is kept, so opening SmolLM2 takes
milliseconds; `read_arrays` decodes such an array when a tokenizer needs it.
The parsed table is cached per file; tensor bytes are then read one tensor at
a time, so a stage touches only the tensors it holds. The `gguf` package
supplies the format's constants and the dequantizers.
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGUFValueType

from workers.spec import GGUFError

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)  # version 1 had 32-bit counts; no file worth reading uses it any more
# Arrays longer than this (the vocabulary, the merges) stay out of the cached
# metadata: stages never need them and they would sit in every worker's memory.
SMALL_ARRAY = 64
_MISSING = object()
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
# Fixed-size value types as struct codes; the file's byte order is checked to be little-endian first.
_CODES = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}
_SCALARS = {t: struct.Struct("<" + code) for t, code in _CODES.items()}


@dataclass(frozen=True)
class ArrayAt:
    """A metadata array left in the file: its item type, its length, the byte where its items start."""

    item: GGUFValueType
    count: int
    offset: int


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
class GGUFFile:
    """A parsed GGUF file: small metadata values, where the long arrays lie, and the tensor table."""

    path: Path
    fields: dict[str, Any]
    tensors: dict[str, TensorEntry]
    arrays: dict[str, ArrayAt]

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
        dtype, shape = stored_layout(e)
        data = np.empty(e.n_bytes, dtype=np.uint8)
        with open(self.path, "rb") as f:
            f.seek(e.offset)
            got = f.readinto(memoryview(data))
        if got != e.n_bytes:
            raise GGUFError(f"{self.path}: truncated file, tensor {name!r} has {got} of {e.n_bytes} bytes")
        return data.view(dtype).reshape(shape)

    def mapped(self, name: str) -> np.ndarray:
        """Tensor `name` as `raw` gives it, but read-only and mapped from the file rather than read.

        Nothing is read until it is used, and nothing is copied: what is made of it (a regrouped
        matrix) is the only copy, and the pages it touched leave the resident set with the mapping.
        """
        e = self.entry(name)
        dtype, shape = stored_layout(e)
        start = e.offset - e.offset % mmap.ALLOCATIONGRANULARITY  # a mapping starts on a page
        try:
            with open(self.path, "rb") as f:
                size = e.offset + e.n_bytes - start
                buf = mmap.mmap(f.fileno(), size, offset=start, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise GGUFError(f"{self.path}: cannot map tensor {name!r} ({exc})") from exc
        data = np.frombuffer(buf, dtype=np.uint8, count=e.n_bytes, offset=e.offset - start)  # keeps buf open
        return data.view(dtype).reshape(shape)

    def dequantize(self, name: str) -> np.ndarray:
        """Tensor `name` as float32 in numpy order (a matrix is (out, in))."""
        return dequantize(self.raw(name), self.entry(name).qtype)


def stored_layout(e: TensorEntry) -> tuple[np.dtype, tuple[int, ...]]:
    """The dtype and shape of a tensor's data as stored: floats as they are, blocks as uint8 rows."""
    if e.qtype == gguf.GGMLQuantizationType.F32:
        return np.dtype(np.float32), e.shape
    if e.qtype == gguf.GGMLQuantizationType.F16:
        return np.dtype(np.float16), e.shape
    return np.dtype(np.uint8), gguf.quant_shape_to_byte_shape(e.shape, e.qtype)


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
        with _mapped(key[0]) as buf:
            _remember(key, _parse(key[0], buf))
    return _parsed[key]


def read_arrays(path: Path | str, keys: list[str]) -> dict[str, list[Any]]:
    """Metadata arrays of any length (e.g. the vocabulary); absent keys are left out."""
    file = open_gguf(path)
    out: dict[str, list[Any]] = {}
    for k in keys:
        value = file.fields.get(k)
        if value is not None and not isinstance(value, list):
            raise GGUFError(f"{file.path}: metadata {k!r} = {value!r} is not an array")
        if value is not None:
            out[k] = list(value)
    if wanted := [k for k in keys if k in file.arrays]:
        with _mapped(file.path) as buf:
            for k in wanted:
                at = file.arrays[k]
                out[k] = _Cursor(file.path, buf, at.offset).items(at.item, at.count, f"metadata {k!r}")
    return out


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


@contextmanager
def _mapped(path: Path) -> Iterator[mmap.mmap]:
    """The file's bytes, mapped read-only, once its magic says it is GGUF."""
    try:
        with open(path, "rb") as f:
            magic = f.read(len(GGUF_MAGIC))
            if len(magic) < len(GGUF_MAGIC):
                raise GGUFError(f"{path}: not a GGUF file (only {len(magic)} bytes long)")
            if magic != GGUF_MAGIC:
                raise GGUFError(f"{path}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as exc:
        raise GGUFError(f"{path}: cannot read model file ({exc.strerror or exc})") from exc
    try:
        yield buf
    finally:
        buf.close()


class _Cursor:
    """Unpack a GGUF header where it lies; running off the end is an error naming what was being read."""

    def __init__(self, path: Path, buf: mmap.mmap, pos: int = 0) -> None:
        self.path, self.buf, self.pos = path, buf, pos

    def take(self, n: int, what: str) -> int:
        """Step over `n` bytes of `what`; the offset where they start."""
        start, self.pos = self.pos, self.pos + n
        if self.pos > len(self.buf):
            raise GGUFError(
                f"{self.path}: truncated file, it ends inside {what} "
                f"(byte {self.pos} needed, the file has {len(self.buf)})"
            )
        return start

    def unpack(self, fmt: struct.Struct, what: str) -> Any:
        return fmt.unpack_from(self.buf, self.take(fmt.size, what))[0]

    def string(self, what: str) -> str:
        n = self.unpack(_U64, what)
        start = self.take(n, what)
        try:
            return str(self.buf[start : start + n], "utf-8")
        except UnicodeDecodeError as exc:
            raise GGUFError(f"{self.path}: {what} is not UTF-8 text (byte {start + exc.start})") from None

    def value_type(self, what: str) -> GGUFValueType:
        raw = self.unpack(_U32, what)
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise GGUFError(f"{self.path}: {what} has an unknown value type {raw}") from None

    def value(self, vtype: GGUFValueType, what: str) -> Any:
        """One value of `vtype`; an array becomes a list."""
        if vtype == GGUFValueType.STRING:
            return self.string(what)
        if vtype == GGUFValueType.ARRAY:
            item = self.value_type(what)
            return self.items(item, self.unpack(_U64, what), what)
        return self.unpack(_SCALARS[vtype], what)

    def items(self, item: GGUFValueType, count: int, what: str) -> list[Any]:
        """The `count` items of an array of `item`s."""
        code = _CODES.get(item)
        if code is not None:
            start = self.take(count * _SCALARS[item].size, what)
            return list(struct.unpack_from(f"<{count}{code}", self.buf, start))
        if item != GGUFValueType.STRING:
            return [self.value(item, what) for _ in range(count)]
        start = self.pos
        self.skip(item, count, what)  # bounds checked once here, so the loop below cannot run off the end
        strings, buf, pos, length = [], self.buf, start, _U64.unpack_from
        for _ in range(count):
            n = length(buf, pos)[0]
            strings.append(buf[pos + 8 : pos + 8 + n])
            pos += 8 + n
        try:
            return [str(b, "utf-8") for b in strings]
        except UnicodeDecodeError as exc:
            raise GGUFError(f"{self.path}: {what} holds a string that is not UTF-8 text ({exc})") from None

    def skip(self, item: GGUFValueType, count: int, what: str) -> None:
        """Step over the `count` items of an array of `item`s without decoding them."""
        if item in _SCALARS:
            self.take(count * _SCALARS[item].size, what)
        elif item == GGUFValueType.STRING:
            # A tight loop: the vocabulary and the merges are 10^5 strings.
            buf, pos, end, length = self.buf, self.pos, len(self.buf), _U64.unpack_from
            for _ in range(count):
                if pos > end:
                    break
                pos += 8 + (length(buf, pos)[0] if pos + 8 <= end else 0)
            self.pos = pos
            self.take(0, what)  # past the end if a length, or the string it counts, was cut short
        else:
            for _ in range(count):
                inner = self.value_type(what)
                self.skip(inner, self.unpack(_U64, what), what)


def _parse(path: Path, buf: mmap.mmap) -> GGUFFile:
    """Walk the header: version, counts, metadata, tensor table; check the data fits in the file."""
    cur = _Cursor(path, buf, len(GGUF_MAGIC))
    version = cur.unpack(_U32, "the version")
    if version and not version & 0xFFFF:
        raise GGUFError(f"{path}: byte order differs from this machine's; not supported")
    if version not in GGUF_VERSIONS:
        raise GGUFError(f"{path}: GGUF version {version} is not supported (only {GGUF_VERSIONS})")
    n_tensors = cur.unpack(_U64, "the tensor count")
    n_fields = cur.unpack(_U64, "the metadata count")
    fields, arrays = _metadata(cur, n_fields)
    table = [_tensor_info(cur, i) for i in range(n_tensors)]
    alignment = fields.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFError(f"{path}: general.alignment = {alignment!r} is not a power of two")
    data_start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, TensorEntry] = {}
    for name, dims, qtype, offset in table:
        if name in tensors:
            raise GGUFError(f"{path}: tensor {name!r} is listed twice")
        tensors[name] = _entry(path, name, dims, qtype, data_start + offset)
    end = max((e.offset + e.n_bytes for e in tensors.values()), default=0)
    if end > len(buf):
        raise GGUFError(f"{path}: truncated file, tensor data ends at byte {end} but the file has {len(buf)}")
    return GGUFFile(path=path, fields=fields, tensors=tensors, arrays=arrays)


def _metadata(cur: _Cursor, count: int) -> tuple[dict[str, Any], dict[str, ArrayAt]]:
    """Key/value pairs: small values decoded, long arrays only located."""
    fields: dict[str, Any] = {}
    arrays: dict[str, ArrayAt] = {}
    for i in range(count):
        key = cur.string(f"metadata key {i}")
        if key in fields or key in arrays:
            raise GGUFError(f"{cur.path}: metadata key {key!r} appears twice")
        what = f"metadata {key!r}"
        vtype = cur.value_type(what)
        if vtype != GGUFValueType.ARRAY:
            fields[key] = cur.value(vtype, what)
            continue
        item = cur.value_type(what)
        n = cur.unpack(_U64, what)
        if n <= SMALL_ARRAY:
            fields[key] = cur.items(item, n, what)
        else:
            arrays[key] = ArrayAt(item, n, cur.pos)
            cur.skip(item, n, what)
    return fields, arrays


def _tensor_info(cur: _Cursor, i: int) -> tuple[str, tuple[int, ...], gguf.GGMLQuantizationType, int]:
    """One row of the tensor table: name, dimensions (GGUF order), type, offset in the data section."""
    name = cur.string(f"the name of tensor {i}")
    what = f"the table entry of tensor {name!r}"
    n_dims = cur.unpack(_U32, what)
    dims = struct.unpack_from(f"<{n_dims}Q", cur.buf, cur.take(8 * n_dims, what))
    raw = cur.unpack(_U32, what)
    try:
        qtype = gguf.GGMLQuantizationType(raw)
    except ValueError:
        raise GGUFError(f"{cur.path}: tensor {name!r} has an unknown type {raw}") from None
    return name, dims, qtype, cur.unpack(_U64, what)


def _entry(
    path: Path, name: str, dims: tuple[int, ...], qtype: gguf.GGMLQuantizationType, offset: int
) -> TensorEntry:
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    if dims and dims[0] % block:
        raise GGUFError(
            f"{path}: tensor {name!r} has rows of {dims[0]}, not whole {qtype.name} blocks of {block}"
        )
    return TensorEntry(
        name=name,
        qtype=qtype,
        shape=tuple(reversed(dims)),
        offset=offset,
        n_bytes=math.prod(dims) * block_bytes // block,
    )
