"""A model's tensors held in the chosen precision: f32, f16 or packed.

Every matrix is used as `x @ w` with x (T, in) and gives (T, out), whatever
its storage: a float32 array (in, out), or a `Half` or `Packed` that upcasts
or dequantizes itself for the product.
"""

from __future__ import annotations

import gguf
import numpy as np

from workers.models.gguf_file import GGUFError, GGUFFile, TensorEntry, dequantize

PRECISIONS = ("f32", "f16", "packed")


class Half:
    """A matrix (in, out) stored as float16 and upcast to float32 for each product."""

    __array_ufunc__ = None  # so that `x @ w` calls __rmatmul__

    def __init__(self, w: np.ndarray) -> None:
        self.w = w

    def __rmatmul__(self, x: np.ndarray) -> np.ndarray:
        return x @ self.w.astype(np.float32)


class Packed:
    """A matrix kept as the file stores it (out, in), dequantized for each product."""

    __array_ufunc__ = None  # so that `x @ w` calls __rmatmul__

    def __init__(self, raw: np.ndarray, qtype: gguf.GGMLQuantizationType) -> None:
        self.raw = raw
        self.qtype = qtype

    def __rmatmul__(self, x: np.ndarray) -> np.ndarray:
        return x @ dequantize(self.raw, self.qtype).T


Matrix = np.ndarray | Half | Packed


class TokenTable:
    """A (vocab, hidden) table: rows for the token embedding, all of it for the head."""

    def __init__(self, stored: np.ndarray, qtype: gguf.GGMLQuantizationType | None) -> None:
        self.stored = stored  # float32 or float16 when qtype is None, else packed blocks
        self.qtype = qtype

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """The float32 rows (T, hidden) of token ids (T,)."""
        if self.qtype is not None:
            return dequantize(self.stored[ids], self.qtype)
        return self.stored[ids].astype(np.float32, copy=False)

    @property
    def head(self) -> Matrix:
        """The table as a matrix (hidden, vocab): `h @ table.head` gives logits."""
        if self.qtype is not None:
            return Packed(self.stored, self.qtype)
        if self.stored.dtype == np.float16:
            return Half(self.stored.T)
        return self.stored.T


class Loader:
    """Read tensors of a file in one precision, counting the parameters held and kept packed."""

    def __init__(self, file: GGUFFile, precision: str) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision {precision!r} is not supported; accepted: {', '.join(PRECISIONS)}")
        self.file = file
        self.precision = precision
        self.n_params = 0
        self.n_packed = 0
        self.packed_types: set[str] = set()

    def vector(self, name: str, size: int) -> np.ndarray:
        """A float32 vector (norm weights stay float32 in every precision)."""
        self._entry(name, (size,))
        return self.file.dequantize(name)

    def matrix(self, name: str, out: int, inp: int) -> Matrix:
        """The weight stored as (out, in), ready for `x @ w`."""
        e = self._entry(name, (out, inp))
        if self._keeps_packed(e):
            return Packed(self.file.raw(name), e.qtype)
        w = self.file.dequantize(name).T  # (in, out): the hot path multiplies a contiguous matrix
        if self.precision == "f16":
            return Half(np.ascontiguousarray(w, dtype=np.float16))
        return np.ascontiguousarray(w)

    def table(self, name: str, rows: int, cols: int) -> TokenTable:
        """A (rows, cols) table for the embedding and the head."""
        e = self._entry(name, (rows, cols))
        if self._keeps_packed(e):
            return TokenTable(self.file.raw(name), e.qtype)
        w = self.file.dequantize(name)
        return TokenTable(w.astype(np.float16) if self.precision == "f16" else w, None)

    def precision_name(self) -> str:
        """ "f32", "f16", or the packed types held, e.g. "q4_1+q8_0"."""
        if self.precision != "packed":
            return self.precision
        return "+".join(sorted(self.packed_types)) or "f32"

    def _entry(self, name: str, shape: tuple[int, ...]) -> TensorEntry:
        e = self.file.entry(name)
        if e.shape != shape:
            raise GGUFError(f"{self.file.path}: tensor {name!r} has shape {e.shape}, expected {shape}")
        self.n_params += e.n_elements
        return e

    def _keeps_packed(self, e: TensorEntry) -> bool:
        if self.precision != "packed" or e.qtype == gguf.GGMLQuantizationType.F32:
            return False
        self.n_packed += e.n_elements
        self.packed_types.add(e.qtype.name.lower())
        return True
